"""EAGLE-3 heads: lossless in the same tree and verifier, and trainable end to end."""

import pytest
import torch

from eagle_lab.decoding.generate import Stopper, generate, speculative_decode, vanilla_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.head import save_head
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.eagle.layouts import load_head
from eagle_lab.drafters.growth import TreeShape
from tests.conftest import small_vocab_target
from tests.test_sampling_lossless import ALPHA, chi_square_pvalue, exact_sequence_probs


def test_eagle3_greedy_equals_plain(tiny_target):
    vocab = torch.arange(0, 259, 2)  # a reduced draft vocabulary: every other token
    head = new_head(tiny_target, kind="eagle3", draft_vocab_ids=vocab, seed=5)
    assert head.arch.feature_layers and head.reduced_vocab
    drafter = EagleDrafter(head, tiny_target, TreeShape(depth=4, topk=3, total_tokens=10))
    greedy = SamplingParams()
    for seed in range(2):
        prompt = torch.randint(0, 256, (18,), generator=torch.Generator().manual_seed(seed))
        plain = generate(vanilla_decode(tiny_target, prompt, greedy, Stopper(tiny_target.tokenizer, 40, set())))
        spec = generate(speculative_decode(tiny_target, drafter, prompt, greedy,
                                           Stopper(tiny_target.tokenizer, 40, set())))
        assert spec.token_ids == plain.token_ids
        drafted = spec.stats.tree_tokens
        assert drafted > 0


def test_eagle3_save_load_roundtrip(tiny_llama, tmp_path):
    head = new_head(tiny_llama, kind="eagle3", draft_vocab_ids=torch.arange(100), seed=1)
    loaded = load_head(save_head(head, tmp_path / "h3"), tiny_llama)
    assert type(loaded) is type(head) and loaded.arch == head.arch
    for key, value in head.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key


@pytest.mark.slow
def test_eagle3_sampling_matches_target():
    target = small_vocab_target()
    params = SamplingParams(temperature=1.0, top_k=4)
    prompt = torch.tensor([1, 4, 2, 0])
    drafter = EagleDrafter(new_head(target, kind="eagle3", seed=2), target, TreeShape(depth=2, topk=2, total_tokens=4))
    g = torch.Generator().manual_seed(21)
    samples, counts = 2500, {}
    for _ in range(samples):
        result = generate(speculative_decode(target, drafter, prompt, params, Stopper(target.tokenizer, 3, set()), g))
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
    assert chi_square_pvalue(counts, exact_sequence_probs(target, prompt, params, 3), samples) > ALPHA
