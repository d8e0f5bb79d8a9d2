"""The loss terms aimed at acceptance, each against values worked out by hand on a three-token vocabulary.

The fake head's draft logits are its hidden state itself and the target's LM-head rows are the identity, so
p = softmax(next top feature) and q = softmax(head output): logits written as log-probabilities give
distributions that can be read off the test."""

from __future__ import annotations

import math

import pytest
import torch

from eagle_lab.config import TrainConfig
from eagle_lab.errors import EagleLabError
from eagle_lab.training import losses
from eagle_lab.training.losses import Batch, LossConfig, reply_positions, training_loss

ROWS = torch.eye(3)  # [Vd, H]: the target's logits are its top feature


class LogitsHead:
    """Draft logits = the hidden state: q = softmax(prediction)."""

    reduced_vocab = False

    def draft_logits(self, hidden, rows):
        return hidden @ rows.T


def _logits(*probabilities):
    return torch.tensor([[math.log(x) for x in probs] for probs in probabilities])  # [positions, 3]


def _batch(target_probs, loss_mask=None):
    """One sequence whose positions 1.. carry the target distributions (position 0's feature is unread)."""
    top = torch.cat([torch.zeros(1, 3), _logits(*target_probs)])[None]  # [1, T, 3]
    length = top.shape[1]
    mask = torch.ones(1, length, dtype=torch.bool) if loss_mask is None else torch.tensor([loss_mask])
    return Batch(input_ids=torch.zeros(1, length, dtype=torch.long), loss_mask=mask,
                 valid=torch.ones(1, length, dtype=torch.bool), top=top, inputs=top)


def _loss(monkeypatch, batch, predictions, **terms):
    """training_loss with the head's predictions (per step, [positions, 3] log-probabilities) given."""
    outputs = [_logits(*step)[None] for step in predictions]  # [[1, T-1, 3]]
    monkeypatch.setattr(losses, "_predictions", lambda *args: outputs)
    cfg = LossConfig(**{"reg_weight": 0.0, "cls_weight": 0.0, "noise_std": 0.0, "step_decay": 1.0, **terms})
    loss, metrics = training_loss(LogitsHead(), None, ROWS, batch, cfg, steps=len(outputs))
    return float(loss), metrics


P = (0.5, 0.3, 0.2)
Q = (0.2, 0.2, 0.6)


def test_acceptance_loss_is_one_minus_the_overlap_of_target_and_head(monkeypatch):
    # sum min(p, q) = 0.2 + 0.2 + 0.2 = 0.6 at the first position; q = p at the second (overlap 1)
    loss, _ = _loss(monkeypatch, _batch([P, P]), [[Q, P]], accept_weight=2.0)
    assert loss == pytest.approx(2.0 * ((1 - 0.6) + 0.0) / 2, abs=1e-6)


def test_top_k_distillation_sums_over_the_targets_k_likeliest_tokens(monkeypatch):
    full, _ = _loss(monkeypatch, _batch([P]), [[Q]], cls_weight=1.0)
    assert full == pytest.approx(-(0.5 * math.log(0.2) + 0.3 * math.log(0.2) + 0.2 * math.log(0.6)), abs=1e-6)
    top2, _ = _loss(monkeypatch, _batch([P]), [[Q]], cls_weight=1.0, distill_top_k=2)
    assert top2 == pytest.approx(-(0.5 + 0.3) * math.log(0.2), abs=1e-6)


def test_alignment_keeps_a_later_step_only_where_the_earlier_steps_ranked_the_token(monkeypatch):
    right, wrong = (0.7, 0.2, 0.1), (0.1, 0.2, 0.7)  # the target's token is 0 everywhere
    batch = _batch([P, P, P, P])
    step1 = [right, wrong, right, right]
    step2 = [Q, P, Q, Q]  # costs 0.4, 0, 0.4, 0.4
    # step 2 at index i continues the anchor of step 1 at index i - 1: index 0 has no anchor (weight 0),
    # index 1 follows a ranked draft, index 2 a rejected one, index 3 a ranked one
    plain, _ = _loss(monkeypatch, batch, [step1, step2], accept_weight=1.0)
    aligned, _ = _loss(monkeypatch, batch, [step1, step2], accept_weight=1.0, align_top_k=1)
    step1_loss = (3 * (1 - (0.5 + 0.2 + 0.1)) + (1 - (0.1 + 0.2 + 0.2))) / 4
    assert plain == pytest.approx(step1_loss + (0 + 0.4 + 0.4) / 3, abs=1e-6)
    assert aligned == pytest.approx(step1_loss + (0 + 0.4) / 3, abs=1e-6)  # the denominator keeps every position
    # every draft ranks token 0 within its top 3: nothing is masked
    every, _ = _loss(monkeypatch, batch, [step1, step2], accept_weight=1.0, align_top_k=3)
    assert every == pytest.approx(plain, abs=1e-6)


def test_reply_positions_count_within_each_run_of_supervised_tokens():
    mask = torch.tensor([[False, True, True, True, False, True, True], [True, True, False, False, True, False, True]])
    want = [[-1, 0, 1, 2, -1, 0, 1], [0, 1, -1, -1, 0, -1, 0]]
    assert reply_positions(mask).tolist() == want


def test_a_replys_opening_weighs_more(monkeypatch):
    # positions 1..6 supervised as [1, 1, 1, 0, 1, 1]: replies' places 0, 1, 2, -, 0, 1
    batch = _batch([P] * 6, loss_mask=[False, True, True, True, False, True, True])
    costs = [Q, P, P, P, Q, Q]  # 0.4 where q = Q, 0 where q = P
    loss, _ = _loss(monkeypatch, batch, [costs], accept_weight=1.0, opening_tokens=2, opening_weight=3.0)
    weights = [3, 3, 1, 0, 3, 3]
    assert loss == pytest.approx((3 * 0.4 + 3 * 0.4 + 3 * 0.4) / sum(weights), abs=1e-6)


@pytest.mark.parametrize("override", [{"accept_weight": -1.0}, {"distill_top_k": -2}, {"align_top_k": -1},
                                      {"opening_tokens": -5}, {"opening_weight": 0.0}])
def test_bad_acceptance_settings_are_refused(override):
    cfg = TrainConfig()
    for key, value in override.items():
        setattr(cfg.loss, key, value)
    with pytest.raises(EagleLabError, match="loss."):
        cfg.validate()


class LogitsHeadWithWeights(LogitsHead, torch.nn.Module):
    """The fake head as a module (held-out scoring reads its dtype) with a full draft vocabulary."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.register_buffer("draft_to_target", torch.arange(3))


def test_held_out_tau_counts_the_leading_run_of_right_drafts(monkeypatch):
    # the target's tokens at positions 1..4: 0, 1, 2, 0; step 1 drafts 0, 1, 0, 0 (3 of 4 right);
    # step 2 at index i continues anchor i - 1: drafts -, 0, 2, 0 -> right at indices 2, 3 (2 of 3)
    # but anchor 2's first draft was wrong, so only anchor 1 accepts two drafts
    one_hot = {0: (0.8, 0.1, 0.1), 1: (0.1, 0.8, 0.1), 2: (0.1, 0.1, 0.8)}
    step1 = [one_hot[t] for t in (0, 1, 0, 0)]
    step2 = [one_hot[t] for t in (1, 0, 2, 0)]
    outputs = [_logits(*step)[None] for step in (step1, step2)]
    monkeypatch.setattr(losses, "_predictions", lambda *args: outputs)
    batch = _batch([P] * 4)
    batch.target_token = torch.tensor([[0, 0, 1, 2, 0]])
    lm_head = torch.nn.Linear(3, 3, bias=False)
    lm_head.weight.data = ROWS.clone()
    target = type("Target", (), {"lm_head": lm_head})()
    result = losses.heldout_accuracy(LogitsHeadWithWeights(), target, [batch], depth=2)
    assert result["eval_acc_1"] == pytest.approx(3 / 4) and result["eval_acc_2"] == pytest.approx(2 / 3)
    assert result["eval_tau_chain"] == pytest.approx(1 + 3 / 4 + 3 / 4 * 2 / 3)
    assert result["eval_tau_accepted"] == pytest.approx(1 + 3 / 4 + 1 / 4)
    assert result["eval_acc_1_opening"] == pytest.approx(3 / 4)  # every position is within a reply's opening
    # p = P everywhere; q = (0.8, 0.1, 0.1) three times (overlap 0.5 + 0.1 + 0.1), (0.1, 0.8, 0.1) once (0.5)
    assert result["eval_overlap_1"] == pytest.approx((3 * 0.7 + 0.5) / 4)
