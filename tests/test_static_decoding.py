"""The static cache and the compiled step change nothing but speed.

Static-cache scoring (eager) must equal the dynamic cache's on every family, through trees,
padding to a bucket and compaction of a non-contiguous accepted path; decoding with it must
give the same tokens. The compiled step must give the same tokens as eager, greedy, and
keep the target's distribution when sampling (chi-square, as tests/test_sampling_lossless.py).
"""

import pytest
import torch

from eagle_lab.decoding import compiled
from eagle_lab.decoding.backend import DecodingConfig, EagerBackend, StaticBackend, build_backend
from eagle_lab.decoding.compiled import doubling_lengths
from eagle_lab.decoding.generate import Stopper, generate, speculative_decode, vanilla_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.decoding.tree import build_tree
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.head_runner import GRAPH_TOP_K, ROW_BUCKETS
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.errors import EagleLabError
from tests.conftest import OracleDrafter, small_vocab_target
from tests.test_sampling_lossless import assert_noisy_drafts_keep_distribution

GREEDY = SamplingParams()


def prompt_for(target, text="The quick brown fox jumps over the lazy dog"):
    return torch.tensor(target.tokenizer.encode(text))


def test_static_scorer_matches_dynamic_through_a_tree_and_compaction(tiny_target):
    prompt = prompt_for(tiny_target)
    dynamic = EagerBackend(tiny_target).open(prompt.numel(), 32)
    static = StaticBackend(tiny_target, buckets=[4, 8], cache_block=64).open(prompt.numel(), 32)
    first = [scorer.prefill(prompt) for scorer in (dynamic, static)]
    torch.testing.assert_close(first[1].logits, first[0].logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first[1].features, first[0].features, atol=1e-4, rtol=1e-4)
    # root 0 -> children 1, 2; 1 -> 3; 3 -> 4: 5 nodes run in the 8-token bucket (3 padding rows)
    tree = build_tree(torch.tensor([5, 9, 11, 13, 17]), torch.tensor([-1, 0, 0, 1, 3]))
    scored = [s.score(tree.tokens, tree.depths, tree.mask) for s in (dynamic, static)]
    torch.testing.assert_close(scored[1].logits, scored[0].logits, atol=1e-4, rtol=1e-4)
    accepted = torch.tensor([0, 1, 3])  # not contiguous: node 2 is dropped, 3 moves
    for scorer in (dynamic, static):
        scorer.commit(accepted)
    assert dynamic.past == static.past == prompt.numel() + 3
    chain = torch.tensor([21, 23])
    after = [s.score(chain) for s in (dynamic, static)]
    torch.testing.assert_close(after[1].logits, after[0].logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after[1].features, after[0].features, atol=1e-4, rtol=1e-4)


def test_static_decoding_equals_dynamic_decoding(tiny_target):
    prompt = prompt_for(tiny_target)
    backends = {"dynamic": EagerBackend(tiny_target), "static": StaticBackend(tiny_target, [4, 8, 16], 64)}
    outputs = {}
    for name, backend in backends.items():
        plain = generate(vanilla_decode(tiny_target, prompt, GREEDY, Stopper(tiny_target.tokenizer, 40, set()),
                                        backend=backend))
        oracle = generate(speculative_decode(tiny_target, OracleDrafter(tiny_target), prompt, GREEDY,
                                             Stopper(tiny_target.tokenizer, 40, set()), backend=backend))
        eagle = generate(speculative_decode(tiny_target, EagleDrafter(new_head(tiny_target, seed=1), tiny_target,
                                                                      TreeShape(3, 2, 6)),
                                            prompt, GREEDY, Stopper(tiny_target.tokenizer, 40, set()), backend=backend))
        assert oracle.stats.accept_length > 2  # many-token acceptance: compaction ran
        outputs[name] = (plain.token_ids, oracle.token_ids, eagle.token_ids)
        assert plain.token_ids == oracle.token_ids == eagle.token_ids
    assert outputs["static"] == outputs["dynamic"]


def test_static_cache_stops_at_the_context_limit(tiny_llama):
    backend = StaticBackend(tiny_llama, [4], cache_block=64)
    prompt = prompt_for(tiny_llama)
    scorer = backend.open(prompt.numel(), 10_000)
    limit = scorer.max_context
    result = generate(vanilla_decode(tiny_llama, prompt, GREEDY, Stopper(tiny_llama.tokenizer, 10_000, set()),
                                     backend=backend))
    assert result.stats.stop_reason in ("context", "length") and prompt.numel() + result.stats.new_tokens <= limit + 1
    too_long = torch.randint(3, 200, (tiny_llama.max_context + 1,))
    with pytest.raises(EagleLabError, match="more than"):
        generate(vanilla_decode(tiny_llama, too_long, GREEDY, Stopper(tiny_llama.tokenizer, 4, set()), backend=backend))


def test_bad_compile_choice_and_buckets_are_refused(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path))  # a machine with no compiled graphs yet
    with pytest.raises(EagleLabError, match="compile must be auto, true or false"):
        build_backend(tiny_llama, "sometimes", DecodingConfig())
    with pytest.raises(EagleLabError, match="buckets"):
        StaticBackend(tiny_llama, [0, 4])
    assert isinstance(build_backend(tiny_llama, "False", DecodingConfig()), EagerBackend)  # Hydra's boolean, as text
    # compile=auto with little work ahead and no graphs built stays eager: compiling would cost more than it saves
    # (with graphs built it decodes compiled: tests/test_graph_store.py)
    assert isinstance(build_backend(tiny_llama, "auto", DecodingConfig(), planned_tokens=64), EagerBackend)


def test_a_compiled_step_attends_over_what_it_needs_and_a_cuda_graph_over_a_doubling_length(tiny_llama):
    compiled = StaticBackend(tiny_llama, [4], 64, compiled=True, min_attended_length=16)
    assert compiled.packages  # on CPU: one package per shape, whatever its attended length
    assert compiled.attended_lengths(192) == [192]  # built once, at the capacity
    needed = (5, 16, 17, 33, 129, 192)
    assert [compiled.attended_length(n, 192, 1, 4) for n in needed] == [16, 16, 32, 48, 144, 192]
    assert doubling_lengths(16, 192) == [16, 32, 64, 128, 192]  # a CUDA graph's lengths (one graph each)
    assert doubling_lengths(0, 192) == [192]
    eager = StaticBackend(tiny_llama, [4], 64, min_attended_length=16)  # no graphs: rounded to EAGER_BLOCK
    assert eager.attended_length(17, 192, 1, 4) == 32 and eager.attended_length(190, 192, 1, 4) == 192
    with pytest.raises(EagleLabError, match="min_attended_length"):
        StaticBackend(tiny_llama, [4], 64, min_attended_length=-1)


@pytest.mark.slow
def test_compiled_decoding_equals_eager_greedy(tiny_llama):
    """Through steps that attend over 16 to 128 positions of a 192-slot cache, each shape one package (its
    attended length dynamic) compiled ahead at the shape's first step, over the cache the prompt is in (what that
    writes is put back)."""
    prompt = prompt_for(tiny_llama, "The quick brown fox jumps over the lazy dog. " * 3)
    assert prompt.numel() > 16
    compiled = StaticBackend(tiny_llama, [4, 16], 64, compiled=True, min_attended_length=16, compile_ahead=True)
    eager = StaticBackend(tiny_llama, [4, 16], 64, min_attended_length=16)
    runs = {}
    for name, backend in (("compiled", compiled), ("eager", eager)):
        drafter = EagleDrafter(new_head(tiny_llama, seed=1), tiny_llama, TreeShape(3, 3, 8))
        plain = generate(vanilla_decode(tiny_llama, prompt, GREEDY, Stopper(tiny_llama.tokenizer, 48, set()),
                                        backend=backend))
        spec = generate(speculative_decode(tiny_llama, OracleDrafter(tiny_llama, depth=3), prompt, GREEDY,
                                           Stopper(tiny_llama.tokenizer, 48, set()), backend=backend))
        head = generate(speculative_decode(tiny_llama, drafter, prompt, GREEDY,
                                           Stopper(tiny_llama.tokenizer, 48, set()), backend=backend))
        runs[name] = (plain.token_ids, spec.token_ids, head.token_ids)
        assert plain.token_ids == spec.token_ids == head.token_ids
    assert runs["compiled"] == runs["eager"]
    assert all(key[0] is None for key in compiled._steps._graphs)  # a package per shape, not per length
    lengths = {view[2] for cache in compiled._caches.values() for view in cache._views}
    assert len(lengths) >= 4  # the packages ran over views of several attended lengths
    # logits: compiled against eager on the same cache contents
    scorers = [b.open(prompt.numel(), 8) for b in (compiled, eager)]
    for s in scorers:
        s.prefill(prompt)
    logits = [s.score(torch.tensor([7, 8, 9])).logits for s in scorers]
    assert (logits[0] - logits[1]).abs().max() < 1e-3


@pytest.mark.slow
def test_compiled_sampling_matches_target():
    target = small_vocab_target()
    assert_noisy_drafts_keep_distribution(target, SamplingParams(temperature=1.0),
                                          StaticBackend(target, [4, 8], 64, compiled=True))


class TreeLog:
    """A round observer keeping every drafted tree."""

    def __init__(self):
        self.trees = []

    def phase(self, name, seconds, tree) -> None:
        if tree is not None:
            self.trees.append(tree)


@pytest.mark.slow
def test_compiled_head_step_drafts_what_the_eager_head_drafts(tiny_llama):
    """Rows padded to a bucket, attention over widths of the head cache that grow with the sequence (64, then
    128), the prompt's first commit fed 16 rows at a time: every round's tree is the one the eager
    head step drafts."""
    head = new_head(tiny_llama, seed=2)
    prompt = prompt_for(tiny_llama)
    assert prompt.numel() > 2 * ROW_BUCKETS[-1]  # the first commit takes three chunks
    logs = {}
    for use_graphs in (False, True):
        drafter = EagleDrafter(head, tiny_llama, TreeShape(3, 3, 8), compiled=use_graphs)
        drafter.runner.min_width = 64
        logs[use_graphs] = TreeLog()
        generate(speculative_decode(tiny_llama, drafter, prompt, GREEDY,
                                    Stopper(tiny_llama.tokenizer, 24, set()), observer=logs[use_graphs]))
        assert drafter.runner.compiled == use_graphs
        assert drafter.cache.length > 64 or not use_graphs  # the sequence grew into the second width
    assert len(logs[True].trees) == len(logs[False].trees) > 3
    for eager, graphed in zip(logs[False].trees, logs[True].trees):
        assert torch.equal(eager.tokens, graphed.tokens) and torch.equal(eager.parents, graphed.parents)


def test_one_compiled_head_graph_serves_every_top_k_up_to_its_own(tiny_llama, monkeypatch, tmp_path):
    """Trees ask for top-k 1..8: a compiled step returns GRAPH_TOP_K drafts and slices them, so the
    same rows and cache need one graph, and each k gets what the eager step gives."""
    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path))
    head = new_head(tiny_llama, seed=4)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, tiny_llama.vocab_size, (3,), generator=generator)
    features = torch.randn(3, tiny_llama.config.hidden_size, generator=generator)
    visible = torch.ones(3, 3, dtype=torch.bool).tril()
    compiled = EagleDrafter(head, tiny_llama, TreeShape(2, 3, 4), compiled=True)
    eager = EagleDrafter(head, tiny_llama, TreeShape(2, 3, 4), compiled=False)
    for k in (1, 3, GRAPH_TOP_K):
        cache = compiled.new_cache()
        got = compiled.runner(cache, tokens, features, torch.arange(3), visible, k, from_draft=False)
        want = eager.runner(eager.new_cache(), tokens, features, torch.arange(3), visible, k, from_draft=False)
        assert got[2].shape == (3, k) and torch.equal(got[2], want[2])
        assert torch.allclose(got[1], want[1], atol=1e-4)
    assert len(compiled.runner._graphs) == 1  # one package: every width, every k up to GRAPH_TOP_K


@pytest.mark.slow
def test_compiled_head_commits_a_long_prompt_in_chunks_as_the_eager_head_does(tiny_llama):
    """A prompt longer than the largest row bucket goes through the compiled head step a chunk at a time:
    each chunk attends to the earlier ones at their positions, so features and top-k match one eager step."""
    head = new_head(tiny_llama, seed=3)
    rows = 2 * ROW_BUCKETS[-1] + 5
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, tiny_llama.vocab_size, (rows,), generator=generator)
    features = torch.randn(rows, tiny_llama.config.hidden_size, generator=generator)
    positions = torch.arange(rows)
    visible = torch.ones(rows, rows, dtype=torch.bool).tril()
    outs = []
    for use_graphs in (False, True):
        drafter = EagleDrafter(head, tiny_llama, TreeShape(2, 3, 4), compiled=use_graphs)
        cache = drafter.new_cache()
        outs.append(drafter.runner(cache, tokens, features, positions, visible, 3, from_draft=False))
        assert cache.length == rows
    (eager_hidden, eager_logp, eager_ids), (hidden, logp, ids) = outs
    assert hidden.shape == eager_hidden.shape == (rows, tiny_llama.config.hidden_size)
    assert torch.allclose(hidden, eager_hidden, atol=1e-4)
    assert torch.equal(ids, eager_ids) and torch.allclose(logp, eager_logp, atol=1e-4)


@pytest.mark.slow
def test_a_compiled_step_tells_caches_of_one_length_apart_by_their_strides(tiny_llama, monkeypatch):
    """A known step shape runs with only the guards that have told graphs apart (compiled.call_known_graph),
    so the step's key must name everything a graph depends on: a 64-position view of a 128-slot cache has
    the shape of a 64-slot cache but other strides, and must get its own graph without falling back to
    evaluating every guard."""
    monkeypatch.setattr(compiled._GuardSkipping, "enabled", True)
    backend = StaticBackend(tiny_llama, [4], 64, compiled=True)
    eager = StaticBackend(tiny_llama, [4], 64)
    prompt = prompt_for(tiny_llama)[:20]
    small, large = (backend.cache_for(capacity) for capacity in (64, 128))
    tokens, positions = torch.tensor([[5, 6, 7, 8]]), torch.arange(20, 24)[None]
    mask = backend.mask(torch.ones(4, 4, dtype=torch.bool).tril(), 20, 64, positions)
    results = []
    for runner, cache in ((backend, small), (backend, large), (backend, small), (eager, eager.cache_for(64))):
        runner.prefill(cache, 0, prompt, ())
        results.append(runner.step(cache, 20, 64, tokens, positions, mask, ())[2])  # logits [1, 4, V], 64 positions
    for logits in results[:3]:
        assert (logits - results[3]).abs().max() < 1e-3
    assert compiled._GuardSkipping.enabled


@pytest.mark.slow
def test_two_compiled_backends_on_one_target_each_use_their_own_cache(tiny_llama):
    """Caches of one shape share a graph (same key); each call must read and write the cache it is given.
    Hugging Face marks a static cache's tensors as static addresses, which inductor's freezing (CPU) builds
    into the graph: a second backend's steps then ran on the first one's cache and counters."""
    prompts = [prompt_for(tiny_llama), prompt_for(tiny_llama, "Once upon a time there was a small green frog")]
    eager = StaticBackend(tiny_llama, [4], 64)
    expected = [generate(vanilla_decode(tiny_llama, prompt, GREEDY, Stopper(tiny_llama.tokenizer, 24, set()),
                                        backend=eager)).token_ids for prompt in prompts]
    assert expected[0] != expected[1]
    backends = [StaticBackend(tiny_llama, [4], 64, compiled=True, min_attended_length=16) for _ in prompts]
    for _ in range(2):  # both alive, in turns, each on its own prompt
        for backend, prompt, tokens in zip(backends, prompts, expected):
            result = generate(vanilla_decode(tiny_llama, prompt, GREEDY, Stopper(tiny_llama.tokenizer, 24, set()),
                                             backend=backend))
            assert result.token_ids == tokens


def test_a_known_shape_call_that_needs_a_new_graph_falls_back_to_every_guard(monkeypatch, caplog):
    """Under guard skipping dynamo refuses to recompile; the call is made again with every guard instead."""
    monkeypatch.setattr(compiled._GuardSkipping, "enabled", True)
    double = torch.compile(lambda x: x * 2, dynamic=False)
    assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
    with caplog.at_level("WARNING"):
        out = compiled.call_known_graph(double, (torch.ones(4),), torch.device("cpu"))  # a shape never compiled
    assert torch.equal(out, torch.full((4,), 2.0))
    assert not compiled._GuardSkipping.enabled and "every guard is evaluated" in caplog.text
