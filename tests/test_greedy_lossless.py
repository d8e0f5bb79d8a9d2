"""Greedy speculative output equals plain greedy output, token for token."""

import pytest
import torch

from eagle_lab.decoding.generate import Stopper, generate, speculative_decode, vanilla_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.drafters.ngram import NgramDrafter, NgramProposer
from tests.conftest import OracleDrafter, small_vocab_target

GREEDY = SamplingParams()


def prompts(count: int, length: int = 16):
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, 256, (length + i,), generator=g) for i in range(count)]


def run_both(target, drafter, prompt, new_tokens=48):
    plain = generate(vanilla_decode(target, prompt, GREEDY, Stopper(target.tokenizer, new_tokens, set())))
    spec = generate(speculative_decode(target, drafter, prompt, GREEDY, Stopper(target.tokenizer, new_tokens, set())))
    return plain, spec


def test_random_head_matches_plain(tiny_target):
    drafter = EagleDrafter(new_head(tiny_target, seed=1), tiny_target, TreeShape(depth=4, topk=3, total_tokens=10))
    for prompt in prompts(3):
        plain, spec = run_both(tiny_target, drafter, prompt)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.new_tokens == 48 and spec.stats.stop_reason == "length"


def test_oracle_drafter_accepts_many_and_matches(tiny_target):
    drafter = OracleDrafter(tiny_target, depth=4)
    for prompt in prompts(3):
        plain, spec = run_both(tiny_target, drafter, prompt)
        assert spec.token_ids == plain.token_ids
        # nearly every draft accepted: ~5 tokens per target forward
        assert spec.stats.accept_length > 3.5, spec.stats
        assert spec.stats.target_forwards < plain.stats.target_forwards / 3


def test_large_tree_matches_plain(tiny_llama):
    """EAGLE's GPU tree (60 tokens, depth 6, top-10) with a random head."""
    drafter = EagleDrafter(new_head(tiny_llama, seed=2), tiny_llama, TreeShape(depth=6, topk=10, total_tokens=60))
    for prompt in prompts(2):
        plain, spec = run_both(tiny_llama, drafter, prompt, new_tokens=32)
        assert spec.token_ids == plain.token_ids


def test_context_limit_stops_cleanly(tiny_llama):
    limit_before = tiny_llama.max_context
    tiny_llama.max_context = 40
    try:
        prompt = prompts(1, length=30)[0]
        plain, spec = run_both(tiny_llama, OracleDrafter(tiny_llama, depth=4), prompt, new_tokens=100)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.stop_reason == plain.stats.stop_reason == "context"
        assert len(plain.token_ids) == 40 - 30 + 1
    finally:
        tiny_llama.max_context = limit_before


def test_eos_stops_both(tiny_llama):
    prompt = prompts(1)[0]
    plain = generate(vanilla_decode(tiny_llama, prompt, GREEDY, Stopper(tiny_llama.tokenizer, 40, set())))
    eos = {plain.token_ids[10]}
    stop_at = plain.token_ids.index(plain.token_ids[10]) + 1
    for decoder in (
        vanilla_decode(tiny_llama, prompt, GREEDY, Stopper(tiny_llama.tokenizer, 40, eos)),
        speculative_decode(tiny_llama, OracleDrafter(tiny_llama), prompt, GREEDY,
                           Stopper(tiny_llama.tokenizer, 40, eos)),
    ):
        result = generate(decoder)
        assert result.token_ids == plain.token_ids[:stop_at]
        assert result.stats.stop_reason == "eos"


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_max_new_tokens(bad):
    """The typed config refuses a budget below one token before anything decodes."""
    from eagle_lab.config import ServeConfig
    from eagle_lab.errors import EagleLabError

    with pytest.raises(EagleLabError, match="max_new_tokens must be >= 1"):
        ServeConfig(max_new_tokens=bad)


class EagleWithOracleTree:
    """Runs the EAGLE drafter every round (so its head cache sees real multi-token commits)
    but proposes the oracle's tree, so several tokens are accepted per round."""

    def __init__(self, eagle, oracle):
        self.eagle, self.oracle = eagle, oracle

    def reset(self):
        self.eagle.reset()

    def draft(self, sequence, new_features, max_depth, sampling=None):
        self.eagle.draft(sequence, new_features, max_depth)
        return self.oracle.draft(sequence, new_features, max_depth)


def test_head_cache_equals_recomputation_after_multi_token_rounds(tiny_target):
    """After rounds that accept several tokens, the head's committed KV cache must equal a
    fresh head forward over the whole committed sequence (cache compaction is right)."""
    from eagle_lab.drafters.eagle.head import HeadKVCache

    eagle = EagleDrafter(new_head(tiny_target, seed=3), tiny_target, TreeShape(depth=3, topk=2, total_tokens=5))
    drafter = EagleWithOracleTree(eagle, OracleDrafter(tiny_target, depth=4))
    prompt = prompts(1)[0]
    stopper = Stopper(tiny_target.tokenizer, 30, set())
    result = generate(speculative_decode(tiny_target, drafter, prompt, GREEDY, stopper))
    assert result.stats.accept_length > 3
    sequence = torch.cat([prompt, torch.tensor(result.token_ids)])
    committed = eagle.committed  # pairs (f_t, x_{t+1}) for t < committed
    features = tiny_target.forward(sequence[None]).features  # [1, T, H]
    fresh = HeadKVCache()
    embeds = tiny_target.embed_tokens(sequence[1:committed + 1][None])
    positions = torch.arange(committed)[None]
    cos, sin = eagle.rotary(embeds, positions)
    with torch.no_grad():
        eagle.head(embeds, features[:, :committed], cos, sin, fresh, None)
    cached = eagle.cache.keys[:, :, :committed]
    assert cached.shape == fresh.keys.shape
    torch.testing.assert_close(cached, fresh.keys, atol=1e-4, rtol=1e-4)


def test_drafting_off_skips_the_head_and_matches(tiny_llama):
    """A round may draft nothing (tree=online's controller): then it is a plain one-token step."""
    drafter = EagleDrafter(new_head(tiny_llama, seed=5), tiny_llama, TreeShape(0, 0, 0))
    plain, spec = run_both(tiny_llama, drafter, prompts(1)[0], new_tokens=20)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.target_forwards == plain.stats.target_forwards and drafter.committed == 0


def test_root_only_rounds_run_the_plain_forward(tiny_llama, monkeypatch):
    """A round that drafted nothing scores its root as vanilla decoding does: no positions, no mask."""
    calls = []
    forward = type(tiny_llama).forward

    def spy(self, input_ids, cache=None, position_ids=None, tree_mask=None, *args, **kwargs):
        calls.append((input_ids.shape[1], position_ids is None and tree_mask is None))
        return forward(self, input_ids, cache, position_ids, tree_mask, *args, **kwargs)

    monkeypatch.setattr(type(tiny_llama), "forward", spy)
    drafter = EagleDrafter(new_head(tiny_llama, seed=5), tiny_llama, TreeShape(0, 0, 0))
    plain, spec = run_both(tiny_llama, drafter, prompts(1)[0], new_tokens=12)
    assert spec.token_ids == plain.token_ids
    assert calls and all(plain_call for width, plain_call in calls if width == 1)
    drafting = EagleDrafter(new_head(tiny_llama, seed=5), tiny_llama, TreeShape(2, 2, 3))
    calls.clear()
    run_both(tiny_llama, drafting, prompts(1)[0], new_tokens=12)
    assert any(width > 1 and not plain_call for width, plain_call in calls)  # trees still get their mask


# ---- hybrid drafting: n-gram branches merged into the tree ------------------------------------

def repetitive_prompts(count: int, vocab: int, length: int = 10):
    """Prompts that repeat themselves (a block, then the block again), as code and rewrites do."""
    g = torch.Generator().manual_seed(99)
    return [torch.randint(0, vocab, (length + i,), generator=g).repeat(2) for i in range(count)]


def test_hybrid_random_head_matches_plain(tiny_target):
    """Random head + n-gram branches on the byte-vocabulary targets, prompts with repetition."""
    drafter = EagleDrafter(new_head(tiny_target, seed=1), tiny_target, TreeShape(depth=4, topk=3, total_tokens=10),
                           ngram=NgramProposer(min_match=1, max_match=3, max_tokens=6))
    for prompt in repetitive_prompts(2, 256) + prompts(1):
        plain, spec = run_both(tiny_target, drafter, prompt)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.ngram_tree_tokens > 0  # chains were proposed and scored


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def looping_target(request):
    """A small-vocabulary target of each family: its greedy output repeats, as real text often does."""
    return small_vocab_target(vocab_size=8, seed=0, family=request.param)


def test_hybrid_accepts_ngram_tokens_and_matches(looping_target):
    drafter = EagleDrafter(new_head(looping_target, seed=1), looping_target, TreeShape(depth=3, topk=2, total_tokens=5),
                           ngram=NgramProposer(min_match=2, max_match=4, max_tokens=6))
    accepted_ngram = 0
    for prompt in repetitive_prompts(3, 8):
        plain, spec = run_both(looping_target, drafter, prompt)
        assert spec.token_ids == plain.token_ids
        accepted_ngram += spec.stats.accepted_ngram_tokens
        assert spec.stats.accepted_ngram_tokens <= spec.stats.accepted_draft_tokens
    assert accepted_ngram > 0  # the n-gram branches were really taken, not just scored


def test_ngram_alone_matches_and_skips_the_head(looping_target):
    """method=ngram (no head at all), and hybrid rounds with the head's drafting off (n-gram chains alone)."""
    proposer = NgramProposer(min_match=2, max_match=4, max_tokens=6)
    head_off = EagleDrafter(new_head(looping_target, seed=1), looping_target, TreeShape(0, 0, 0), ngram=proposer)
    for drafter in (NgramDrafter(proposer), head_off):
        accepted = 0
        for prompt in repetitive_prompts(3, 8):
            plain, spec = run_both(looping_target, drafter, prompt)
            assert spec.token_ids == plain.token_ids
            assert spec.stats.accepted_ngram_tokens == spec.stats.accepted_draft_tokens  # every draft is a copy
            accepted += spec.stats.accepted_draft_tokens
        assert accepted > 0
    assert head_off.committed == 0  # the head never ran


def test_ngram_chain_respects_the_context_limit(tiny_llama):
    limit_before = tiny_llama.max_context
    tiny_llama.max_context = 40
    try:
        prompt = torch.arange(10, 25).repeat(2)  # 30 tokens: chains are proposed up to the end
        drafter = NgramDrafter(NgramProposer(min_match=1, max_match=3, max_tokens=8))
        plain, spec = run_both(tiny_llama, drafter, prompt, new_tokens=100)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.stop_reason == plain.stats.stop_reason == "context"
    finally:
        tiny_llama.max_context = limit_before


def test_a_chain_drafts_what_the_dynamic_tree_grows_at_top_1(tiny_llama, monkeypatch):
    """A top-1 shape takes the chain path (no ranking); round after round it must draft the tree, and remember
    the candidates, that EAGLE-2's growth gives at top-1. A drafter whose chain path is switched off is the
    reference."""
    shape = TreeShape(depth=3, topk=1, total_tokens=3)
    drafters = [EagleDrafter(new_head(tiny_llama, seed=6), tiny_llama, shape) for _ in range(2)]
    trees = [[], []]

    def tree_drafter(index: int):
        class Recording:
            def reset(self):
                drafters[index].reset()

            def draft(self, sequence, new_features, max_depth, sampling=None):
                tree = drafters[index].draft(sequence, new_features, max_depth)
                cands = drafters[index].last_candidates
                trees[index].append((tree.tokens.tolist(), tree.parents.tolist(), cands.tokens.tolist(),
                                     cands.parents.tolist(), cands.scores))
                return tree
        return Recording()

    chain_calls = []
    original = EagleDrafter._draft_chain
    monkeypatch.setattr(EagleDrafter, "_draft_chain", lambda self, *a: chain_calls.append(1) or original(self, *a))
    plain, spec = run_both(tiny_llama, tree_drafter(0), prompts(1)[0], new_tokens=40)
    assert chain_calls and plain.token_ids == spec.token_ids
    monkeypatch.setattr(EagleDrafter, "_draft_chain",
                        lambda self, sequence, features, depth: self._draft_tree(sequence, features, depth, shape))
    run_both(tiny_llama, tree_drafter(1), prompts(1)[0], new_tokens=40)
    assert len(trees[0]) == len(trees[1]) > 5
    for chain, grown in zip(*trees):
        assert chain[:4] == grown[:4] and len(chain[0]) == 4  # root + 3 levels, same tokens and parents
        torch.testing.assert_close(chain[4], grown[4], rtol=0, atol=1e-6)  # cumulative draft log-probs
