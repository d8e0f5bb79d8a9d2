"""Training batches: length-grouped epoch order, cached greedy tokens, autocast setting."""

from __future__ import annotations

import random

import pytest
import torch

from eagle_lab.config import LossConfig, TrainConfig
from eagle_lab.drafters.eagle.head import draft_lm_head_weight
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.errors import EagleLabError
from eagle_lab.models.target import TargetConfig, load_target
from eagle_lab.training.batches import collate, epoch_order
from eagle_lab.training.features import Example, greedy_tokens
from eagle_lab.training.losses import training_loss
from eagle_lab.training.trainer import Recipe


def test_grouped_epoch_order_is_a_permutation_of_similar_length_batches():
    rng = random.Random(1)
    lengths = [rng.randint(5, 1000) for _ in range(1000)]
    plain = epoch_order(1000, seed=3, epoch=0)
    grouped = epoch_order(1000, seed=3, epoch=0, lengths=lengths, batch_size=4)
    assert sorted(grouped) == list(range(1000))
    assert grouped == epoch_order(1000, seed=3, epoch=0, lengths=lengths, batch_size=4)  # resumable
    assert grouped != epoch_order(1000, seed=3, epoch=1, lengths=lengths, batch_size=4)

    def padding(order):  # padded positions if batched in fours
        return sum(4 * max(lengths[i] for i in order[k:k + 4]) - sum(lengths[i] for i in order[k:k + 4])
                   for k in range(0, 1000, 4))

    assert padding(grouped) < 0.2 * padding(plain)
    # batches are not simply sorted over the epoch: long and short ones stay mixed
    firsts = [lengths[grouped[k]] for k in range(0, 400, 4)]
    assert firsts != sorted(firsts) and firsts != sorted(firsts, reverse=True)


def test_cached_greedy_tokens_give_the_same_loss():
    target = load_target(TargetConfig(name="tiny_llama", source="tiny"))
    vocab = torch.arange(0, target.vocab_size, 2)  # half the vocabulary: masking matters
    head = new_head(target, kind="eagle3", draft_vocab_ids=vocab, seed=0).float()
    rows = draft_lm_head_weight(head, target).detach().float()
    torch.manual_seed(0)
    examples = []
    for length in (12, 9):
        ids = torch.randint(0, target.vocab_size, (length,))
        out = target.forward(ids[None], layer_ids=tuple(head.arch.feature_layers))
        examples.append(Example(ids, torch.ones(length, dtype=torch.bool), out.features[0], out.layer_features[0]))
    cfg = LossConfig(reg_weight=0.0, cls_weight=1.0, noise_std=0.0, step_decay=0.8, mask_outside_draft_vocab=True)
    fresh = collate(examples, target.device, torch.float32, use_layers=True)
    assert fresh.target_token is None
    for e in examples:
        e.target_token = greedy_tokens(target, e.features)
    cached = collate(examples, target.device, torch.float32, use_layers=True)
    assert cached.target_token.shape == cached.input_ids.shape
    want = torch.nn.functional.linear(examples[0].features, target.lm_head.weight).argmax(-1)
    assert torch.equal(cached.target_token[0, :12], want)
    loss_fresh, _ = training_loss(head, target, rows, fresh, cfg, steps=2)
    loss_cached, _ = training_loss(head, target, rows, cached, cfg, steps=2)
    assert torch.equal(loss_fresh, loss_cached)


def test_bad_cpu_autocast_is_refused(tmp_path):
    cfg = TrainConfig(run_dir=str(tmp_path / "run"))
    cfg.trainer.cpu_autocast = "maybe"
    with pytest.raises(EagleLabError, match="cpu_autocast"):
        Recipe(cfg).setup()
