"""method=draft_model: a small LM with the target's tokenizer drafts; the output stays the target's."""

from __future__ import annotations

import json

import pytest
import torch

from eagle_lab.builders import build_draft_model_drafter
from eagle_lab.config import TreeConfig
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.drafters.draft_model.drafter import DraftModelDrafter, check_same_tokenizer
from eagle_lab.drafters.draft_model.store import is_layers_only, load_layers_only, save_draft_vocab, save_layers_only
from eagle_lab.drafters.growth import TreeShape, untuned_shape
from eagle_lab.errors import EagleLabError
from eagle_lab.models.target import Target, TargetConfig
from eagle_lab.models.tiny import TinyModelConfig, build_tiny_model, byte_tokenizer
from eagle_lab.serving.engine import drafter_factory
from tests.conftest import FAMILIES, small_vocab_target
from tests.test_greedy_lossless import prompts, run_both
from tests.test_sampling_lossless import ALPHA, chi_square_pvalue, exact_sequence_probs, sampled_sequences


def small_lm(target: Target, seed: int = 7, layers: int = 1) -> Target:
    """A one-layer LM of the target's family over the same byte tokenizer (a stand-in draft model)."""
    family = target.model.config.model_type.removesuffix("_text")  # gemma3_text: the Gemma 3 family
    model = build_tiny_model(TinyModelConfig(family=family, num_layers=layers, seed=seed),
                             vocab_size=target.vocab_size)
    return Target(model.eval(), byte_tokenizer(), name="draft")


@pytest.mark.parametrize("shape", [TreeShape(4, 1, 4), TreeShape(3, 3, 8)], ids=["chain", "tree"])
def test_greedy_output_equals_plain_decoding(tiny_target, shape):
    drafter = DraftModelDrafter(small_lm(tiny_target), shape, tiny_target.vocab_size)
    for prompt in prompts(3):
        plain, spec = run_both(tiny_target, drafter, prompt)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.new_tokens == 48


def test_the_target_as_its_own_draft_model_is_accepted_whole(tiny_target):
    """Every drafted token is the target's greedy one, so every round keeps its whole chain: this
    checks the draft model's cache, positions and tree masks."""
    drafter = DraftModelDrafter(tiny_target, TreeShape(4, 1, 4), tiny_target.vocab_size)
    plain, spec = run_both(tiny_target, drafter, prompts(1)[0], new_tokens=50)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.target_forwards == 1 + 10  # the prefill, then 5 tokens per round
    # a tree keeping all 2 + 4 + 4 candidates: the greedy path leaves the frontier only if both of
    # the second child's children outscore it, so nearly every round keeps all 3 levels
    tree_drafter = DraftModelDrafter(tiny_target, TreeShape(3, 2, 10), tiny_target.vocab_size)
    _, tree_spec = run_both(tiny_target, tree_drafter, prompts(1)[0], new_tokens=48)
    assert tree_spec.stats.accepted_draft_tokens >= 3 * tree_spec.stats.rounds - 1


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_keeps_the_targets_distribution(family):
    target = small_vocab_target(family=family)
    draft = small_vocab_target(seed=9, family=family)
    params, prompt, length, samples = SamplingParams(temperature=0.9), torch.tensor([1, 4, 2, 0]), 3, 3000
    drafter = DraftModelDrafter(draft, TreeShape(2, 2, 4), target.vocab_size)
    counts, accepted_any = sampled_sequences(target, drafter, prompt, params, length, samples, seed=13)
    assert 0.1 * samples < accepted_any < samples  # useful but imperfect drafts: the test means something
    assert chi_square_pvalue(counts, exact_sequence_probs(target, prompt, params, length), samples) > ALPHA


def test_another_tokenizer_is_refused(tiny_llama):
    other = byte_tokenizer()
    other.add_tokens(["<extra>"])
    draft = Target(small_lm(tiny_llama).model, other, name="other")
    with pytest.raises(EagleLabError, match="must share the target's tokenizer"):
        check_same_tokenizer(tiny_llama, draft)
    check_same_tokenizer(tiny_llama, small_lm(tiny_llama))  # the same tokenizer passes


def test_a_missing_or_bad_path_is_one_clear_error(tiny_llama, tmp_path):
    with pytest.raises(EagleLabError, match="draft_model.path=DIR"):
        build_draft_model_drafter(TargetConfig(name="draft_model", source="pretrained"), TreeConfig(), tiny_llama)
    with pytest.raises(EagleLabError, match="not a model directory"):
        build_draft_model_drafter(TargetConfig(name="draft_model", source="pretrained", path=str(tmp_path)),
                                  TreeConfig(), tiny_llama)


def test_layers_only_layout_takes_embeddings_from_the_target(tiny_llama, tmp_path):
    """The packaged layout keeps the draft LM's own layers only; loaded against its target it is
    the same model, sharing the target's embedding and LM-head tensors."""
    draft = small_lm(tiny_llama)
    draft.model.get_input_embeddings().weight.data.copy_(tiny_llama.embed_tokens.weight)
    draft.model.get_output_embeddings().weight.data.copy_(tiny_llama.lm_head.weight)
    draft.model.save_pretrained(tmp_path / "full")
    save_draft_vocab(torch.arange(0, tiny_llama.vocab_size, 2), tmp_path / "full")  # as the trainer's export
    compact = save_layers_only(tmp_path / "full", tiny_llama.name, tmp_path / "compact", dtype=torch.float32)
    assert is_layers_only(compact) and not is_layers_only(tmp_path / "full")
    loaded = load_layers_only(compact, tiny_llama)
    assert loaded.model.get_input_embeddings().weight is tiny_llama.embed_tokens.weight
    assert loaded.model.get_output_embeddings().weight is tiny_llama.lm_head.weight
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    torch.testing.assert_close(loaded.model(ids).logits, draft.model(ids).logits)
    drafter = build_draft_model_drafter(TargetConfig(name="draft_model", source="pretrained", path=str(compact)),
                                        TreeConfig(online=False, depth=3, topk=2, total_tokens=5), tiny_llama)
    assert torch.equal(drafter.draft_vocab, torch.arange(0, tiny_llama.vocab_size, 2))  # kept by the layout
    plain, spec = run_both(tiny_llama, drafter, prompts(1)[0], new_tokens=24)
    assert spec.token_ids == plain.token_ids
    with pytest.raises(EagleLabError, match="was trained for target"):
        load_layers_only(compact, small_vocab_target())
    with pytest.raises(EagleLabError, match="not a layers-only draft LM"):
        (compact / "layers.safetensors").unlink()
        load_layers_only(compact, tiny_llama)


def test_a_draft_vocabulary_limits_what_is_drafted(tiny_llama):
    vocab = torch.arange(0, tiny_llama.vocab_size, 3)
    drafter = DraftModelDrafter(small_lm(tiny_llama), TreeShape(3, 2, 5), tiny_llama.vocab_size, vocab)
    tree = drafter.draft(prompts(1)[0], torch.zeros(0), max_depth=4)
    assert tree.size == 6 and all(int(token) % 3 == 0 for token in tree.tokens[1:])
    plain, spec = run_both(tiny_llama, drafter, prompts(1)[0], new_tokens=24)
    assert spec.token_ids == plain.token_ids


def test_tree_shape_follows_the_tree_config():
    assert untuned_shape("draft_model", True, 3, 1, 3) == TreeShape(3, 1, 3)  # tree=online: a chain of tree.depth
    assert untuned_shape("draft_model", True, 2, 4, 12) == TreeShape(2, 1, 2)
    assert untuned_shape("draft_model", False, 4, 4, 12) == TreeShape(4, 4, 12)  # tree=cpu
    with pytest.raises(EagleLabError, match="tree.depth"):
        TreeConfig(online=False, depth=0, topk=0, total_tokens=0).validate()


def test_each_server_sequence_gets_its_own_cache_over_shared_weights(tiny_llama):
    prototype = build_draft_model_drafter(TargetConfig(name="draft", source="tiny", tiny=TinyModelConfig(seed=5)),
                                          TreeConfig(online=False, depth=2, topk=2, total_tokens=3), tiny_llama)
    make = drafter_factory(prototype)
    first, second = make(), make()
    assert first.model is second.model is prototype.model and first.cache is not second.cache
    first.draft(torch.tensor([1, 2, 3]), torch.zeros(0), max_depth=4)
    assert first.committed == 3 and second.committed == 0


def test_head_draft_lm_trains_exports_and_serves_losslessly(tmp_path):
    """train.py head=draft_lm: the same corpus and objective as an EAGLE head; the export is a
    Hugging Face model that method=draft_model serves, with the target's output."""
    from test_train import smoke_cfg

    from eagle_lab.builders import build_draft_model_drafter
    from eagle_lab.drafters.card import read_card
    from eagle_lab.training.trainer import Recipe

    recipe = Recipe(smoke_cfg(tmp_path / "run", "head=draft_lm", "head.draft_layers=1", "trainer.max_steps=12",
                              "trainer.eval_every=12", f"trainer.features_dir={tmp_path / 'features'}"))
    recipe.setup()
    frozen = recipe.head.model.get_input_embeddings().weight.clone()
    recipe.train()
    out = recipe.export()
    losses = [json.loads(line)["loss"] for line in recipe.metrics_path.read_text().splitlines()
              if "loss" in json.loads(line)]
    assert losses[-1] < losses[0]
    assert torch.equal(recipe.head.model.get_input_embeddings().weight, frozen)  # embeddings stay the target's
    card = read_card(out)
    assert card.kind == "draft_lm" and len(card.heldout_top1) == 1 and card.trainable_parameters > 0
    assert card.trainable_parameters < sum(p.numel() for p in recipe.head.parameters())

    target = recipe.target
    drafter = build_draft_model_drafter(TargetConfig(name="draft", source="pretrained", path=str(out)),
                                        TreeConfig(online=False, depth=3, topk=2, total_tokens=5), target)
    for prompt in prompts(2):
        plain, spec = run_both(target, drafter, prompt, new_tokens=24)
        assert spec.token_ids == plain.token_ids
