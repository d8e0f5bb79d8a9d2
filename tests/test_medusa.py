"""method=medusa: Medusa heads draft from the target's last feature; the output stays the target's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_lab.builders import build_medusa_drafter
from eagle_lab.config import MedusaConfig, TreeConfig
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.drafters.medusa.drafter import MedusaDrafter
from eagle_lab.drafters.medusa.heads import MedusaArch, MedusaHeads, load_medusa, save_medusa
from eagle_lab.drafters.medusa.layout import export_medusa_layout, is_medusa_layout, load_any_medusa
from eagle_lab.errors import EagleLabError
from eagle_lab.training.losses import Batch, _medusa_predictions
from tests.conftest import FAMILIES, small_vocab_target
from tests.test_greedy_lossless import prompts, run_both
from tests.test_sampling_lossless import ALPHA, chi_square_pvalue, exact_sequence_probs, sampled_sequences


def random_heads(target, num_heads: int = 3, seed: int = 0) -> MedusaHeads:
    heads = MedusaHeads(MedusaArch(target.hidden_size, target.vocab_size, num_heads))
    g = torch.Generator().manual_seed(seed)
    for block in heads.blocks:  # away from the zero start, so heads disagree with the target
        block.weight.data = torch.randn(block.weight.shape, generator=g) * 0.3
    return heads


@pytest.mark.parametrize("shape", [TreeShape(3, 1, 3), TreeShape(3, 3, 8)], ids=["chain", "tree"])
def test_greedy_output_equals_plain_decoding(tiny_target, shape):
    drafter = MedusaDrafter(random_heads(tiny_target), tiny_target, shape)
    for prompt in prompts(3):
        plain, spec = run_both(tiny_target, drafter, prompt)
        assert spec.token_ids == plain.token_ids and spec.stats.new_tokens == 48


def test_heads_read_the_feature_that_chose_the_root(tiny_llama):
    """Zero residual blocks return the feature itself, so every head's guess is the token that
    feature's LM-head row picks: the root (greedy), at every depth of a chain."""
    drafter = MedusaDrafter(MedusaHeads(MedusaArch(tiny_llama.hidden_size, tiny_llama.vocab_size, 3)), tiny_llama,
                            TreeShape(3, 1, 3))
    prompt = prompts(1)[0]
    features = tiny_llama.forward(prompt[None]).features[0]  # [T, H]
    root = int(tiny_llama.logits(features[-1]).argmax())
    tree = drafter.draft(torch.cat([prompt, torch.tensor([root])]), features, max_depth=8)
    assert tree.tokens.tolist() == [root] * 4 and tree.depths.tolist() == [0, 1, 2, 3]


def test_training_targets_line_up_with_each_heads_offset():
    heads = MedusaHeads(MedusaArch(hidden_size=4, vocab_size=10, num_heads=3))
    top = torch.arange(6 * 4, dtype=torch.float32).view(1, 6, 4)  # f_0 .. f_5, distinct
    batch = Batch(torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 6, dtype=torch.bool),
                  torch.ones(1, 6, dtype=torch.bool), top, top)
    outputs = _medusa_predictions(heads, batch)  # zero blocks: head j at anchor t outputs f_t
    for j, out in enumerate(outputs, start=1):  # index p holds head j's guess of f_{p+1}, from anchor p+1-j
        for p in range(j - 1, 5):
            assert torch.equal(out[0, p], top[0, p + 1 - j])


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_keeps_the_targets_distribution(family):
    target = small_vocab_target(family=family)
    params, prompt, length, samples = SamplingParams(temperature=0.9), torch.tensor([1, 4, 2, 0]), 3, 3000
    drafter = MedusaDrafter(random_heads(target, num_heads=2, seed=3), target, TreeShape(2, 2, 4))
    counts, accepted_any = sampled_sequences(target, drafter, prompt, params, length, samples, seed=17)
    assert 0.1 * samples < accepted_any < samples
    assert chi_square_pvalue(counts, exact_sequence_probs(target, prompt, params, length), samples) > ALPHA


def test_saved_heads_load_back_and_bad_directories_are_refused(tiny_llama, tmp_path):
    heads = random_heads(tiny_llama)
    loaded = load_medusa(save_medusa(heads, tmp_path / "m"), tiny_llama)
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), loaded.state_dict().values()))
    with pytest.raises(EagleLabError, match="medusa.path=DIR"):
        build_medusa_drafter(MedusaConfig(), TreeConfig(), tiny_llama)
    with pytest.raises(EagleLabError, match="not a Medusa head directory"):
        load_medusa(tmp_path, tiny_llama)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "hidden_size": 7}))
    with pytest.raises(EagleLabError, match="hidden size 7"):
        load_medusa(tmp_path / "m", tiny_llama)


def test_medusa_layout_round_trips_and_own_projections_are_kept(tiny_llama, tmp_path):
    """Export to the Medusa project's layout and back gives the same drafts; heads whose vocabulary
    projections were trained (not the target's LM head) keep them, and still verify losslessly."""
    heads = random_heads(tiny_llama)
    exported = export_medusa_layout(heads, tiny_llama, tmp_path / "medusa")
    assert is_medusa_layout(exported) and json.loads((exported / "config.json").read_text())["medusa_num_heads"] == 3
    back = load_any_medusa(exported, tiny_llama)
    assert not back.arch.own_projections
    feature = torch.randn(1, tiny_llama.hidden_size)
    for a, b in zip(heads(feature), back(feature)):
        torch.testing.assert_close(a, b)
    state = load_file(str(exported / "medusa_lm_head.safetensors"))
    state["1.1.weight"] = state["1.1.weight"] + 0.5 * torch.randn(state["1.1.weight"].shape)  # a trained projection
    save_file(state, str(exported / "medusa_lm_head.safetensors"))
    own = load_any_medusa(exported, tiny_llama)
    assert own.arch.own_projections and torch.equal(own.head_rows(1, tiny_llama.lm_head.weight), state["1.1.weight"])
    drafter = MedusaDrafter(own, tiny_llama, TreeShape(3, 2, 5))
    plain, spec = run_both(tiny_llama, drafter, prompts(1)[0], new_tokens=24)
    assert spec.token_ids == plain.token_ids
    state.pop("2.0.linear.bias")
    save_file(state, str(exported / "medusa_lm_head.safetensors"))
    with pytest.raises(EagleLabError, match="lacks Medusa weights"):
        load_any_medusa(exported, tiny_llama)


def test_head_medusa_trains_exports_and_serves_losslessly(tmp_path):
    from test_train import smoke_cfg

    from eagle_lab.drafters.card import read_card
    from eagle_lab.training.trainer import Recipe

    recipe = Recipe(smoke_cfg(tmp_path / "run", "head=medusa", "head.medusa_heads=3", "trainer.max_steps=12",
                              "trainer.eval_every=12", f"trainer.features_dir={tmp_path / 'features'}"))
    recipe.setup()
    recipe.train()
    out = recipe.export()
    losses = [json.loads(line)["loss"] for line in recipe.metrics_path.read_text().splitlines()
              if "loss" in json.loads(line)]
    assert losses[-1] < losses[0]
    card = read_card(out)
    assert card.kind == "medusa" and len(card.heldout_top1) == 3
    drafter = build_medusa_drafter(MedusaConfig(path=str(out)), TreeConfig(online=False, depth=3, topk=2,
                                                                            total_tokens=5), recipe.target)
    for prompt in prompts(2):
        plain, spec = run_both(recipe.target, drafter, prompt, new_tokens=24)
        assert spec.token_ids == plain.token_ids
