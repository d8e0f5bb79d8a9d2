"""CUDA paths: bf16 tree attention and the whole loop on a GPU (skipped on CPU)."""

import pytest
import torch

from eagle_lab.decoding.generate import Stopper, generate, speculative_decode, vanilla_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.models.target import TargetConfig, load_target
from tests.conftest import OracleDrafter


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_equals_plain_on_cuda(dtype):
    target = load_target(TargetConfig(name="tiny_llama", source="tiny", device="cuda", dtype=dtype))
    prompt = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0)).cuda()
    greedy = SamplingParams()
    plain = generate(vanilla_decode(target, prompt, greedy, Stopper(target.tokenizer, 40, set())))
    for drafter in (EagleDrafter(new_head(target), target, TreeShape(6, 10, 60)), OracleDrafter(target)):
        spec = generate(speculative_decode(target, drafter, prompt, greedy, Stopper(target.tokenizer, 40, set())))
        assert spec.token_ids == plain.token_ids


@pytest.mark.cuda
def test_ngram_branches_on_cuda():
    """Hybrid drafting and n-gram alone: proposer and merge on CUDA tensors, greedy still exact."""
    from eagle_lab.drafters.ngram import NgramDrafter, NgramProposer

    target = load_target(TargetConfig(name="tiny_llama", source="tiny", device="cuda", dtype="float32"))
    prompt = torch.arange(30, 50).repeat(2).cuda()
    greedy = SamplingParams()
    plain = generate(vanilla_decode(target, prompt, greedy, Stopper(target.tokenizer, 40, set())))
    proposer = NgramProposer(min_match=1, max_match=3, max_tokens=6)
    for drafter in (EagleDrafter(new_head(target), target, TreeShape(4, 4, 12), proposer), NgramDrafter(proposer)):
        spec = generate(speculative_decode(target, drafter, prompt, greedy, Stopper(target.tokenizer, 40, set())))
        assert spec.token_ids == plain.token_ids and spec.stats.ngram_tree_tokens > 0
