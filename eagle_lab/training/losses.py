"""Training objective and held-out metrics of a draft head.

For every position p the head reads (f_p, x_{p+1}) and predicts f_{p+1}; with unrolled
steps (EAGLE-3 "training-time test") step j predicts f_{p+1} from its own earlier outputs.
  loss_j = reg_weight * SmoothL1(f^_{p+1}, f_{p+1})
         + cls_weight * CE(softmax(LM(f_{p+1})), log_softmax(LM_draft(f^_{p+1})))
over positions whose f_{p+1} belongs to an assistant token, weighted step_decay ** (j-1).
The target distribution is restricted to the draft vocabulary (renormalised) when the
head has a reduced one; verification still uses the full vocabulary, so this only
changes what the head learns, never the output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle_lab.drafters.eagle.head import draft_lm_head_weight
from eagle_lab.drafters.medusa.heads import MedusaHeads
from eagle_lab.training.draft_lm import DraftLM
from eagle_lab.training.features import greedy_tokens
from eagle_lab.training.ttt import unrolled_hidden


@dataclass
class LossConfig:
    reg_weight: float = 1.0  # Smooth-L1 on the predicted feature (EAGLE: 1.0)
    cls_weight: float = 0.1  # cross-entropy against the target's distribution (EAGLE: 0.1)
    noise_std: float = 0.05  # std of uniform noise on input features (EAGLE: U(-0.1, 0.1))
    step_decay: float = 0.8  # weight of unrolled step j is step_decay ** (j - 1) (EAGLE-3)
    mask_outside_draft_vocab: bool = False  # skip positions whose target token the draft cannot emit


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] bool, assistant tokens
    valid: torch.Tensor  # [B, T] bool, False on padding
    top: torch.Tensor  # [B, T, H] target top features
    inputs: torch.Tensor  # [B, T, F] head input features (top, or concatenated layers for EAGLE-3)
    target_token: torch.Tensor | None = None  # [B, T] target's greedy next token; None = compute from top

    def greedy(self, target) -> torch.Tensor:
        """[B, T] the target's greedy token after each position (cached per example by the trainer)."""
        return self.target_token if self.target_token is not None else greedy_tokens(target, self.top)


def _predictions(head, target, batch: Batch, steps: int, noise_std: float) -> list[torch.Tensor]:
    """[[B, T-1, H]] per draft step j: at index p, the prediction of f_{p+1} (step j of an EAGLE
    head anchored j-1 places earlier, a draft LM after reading x_0..x_{p+1}, Medusa head j from f_{p+1-j})."""
    if isinstance(head, DraftLM):  # reads tokens only; one step
        return head.predictions(batch.input_ids, batch.valid)
    if isinstance(head, MedusaHeads):
        return _medusa_predictions(head, batch)
    return _unroll(head, target, batch, steps, noise_std)


def _medusa_predictions(head: MedusaHeads, batch: Batch) -> list[torch.Tensor]:
    feats = batch.top[:, :-1].to(head.blocks[0].weight.dtype)  # [B, T-1, H] anchors f_0 .. f_{T-2}
    outputs = []
    for j, hidden in enumerate(head(feats), start=1):  # hidden[:, t] guesses f_{t+j}
        shifted = torch.zeros_like(hidden)  # index p = t + j - 1; the first j - 1 have no anchor (weight 0)
        shifted[:, j - 1:] = hidden[:, : hidden.shape[1] - (j - 1)]
        outputs.append(shifted)
    return outputs


def prediction_steps(head, ttt_steps: int) -> int:
    """Draft steps the loss covers: an EAGLE head's unrolled steps, a draft LM's one, Medusa's heads."""
    if isinstance(head, DraftLM):
        return 1
    if isinstance(head, MedusaHeads):
        return head.arch.num_heads
    return ttt_steps


def _unroll(head, target, batch: Batch, steps: int, noise_std: float):
    dtype = head.fc.weight.dtype  # the target may run in another dtype (trainer.capture_dtype)
    embeds = target.embed_tokens(batch.input_ids[:, 1:]).to(dtype)  # [B, T-1, H] embeddings of x_{p+1}
    feats = batch.inputs[:, :-1].to(dtype)  # [B, T-1, F]
    if noise_std > 0:
        feats = feats + (torch.rand_like(feats) - 0.5) * (noise_std * 12 ** 0.5)  # uniform, std = noise_std
    positions = torch.arange(embeds.shape[1], device=embeds.device)[None].expand(embeds.shape[0], -1)  # [B, T-1]
    cos, sin = target.rotary(embeds, positions)
    return unrolled_hidden(head, embeds, feats, cos, sin, steps)


def _weights(batch: Batch, step: int) -> torch.Tensor:
    w = (batch.loss_mask[:, 1:] & batch.valid[:, 1:]).float()  # [B, T-1]
    if step > 1:
        w[:, : step - 1] = 0.0  # anchors before the sequence start do not exist
    return w


def _draftable(head, target, batch: Batch) -> torch.Tensor:
    """[B, T-1] 1.0 where the target's greedy token is in the draft vocabulary."""
    goal_token = batch.greedy(target)[:, 1:]  # [B, T-1]
    in_draft = torch.zeros(target.vocab_size, dtype=torch.bool, device=goal_token.device)
    in_draft[head.draft_to_target.to(goal_token.device)] = True
    return in_draft[goal_token].float()


def _loss_weights(head, target, batch: Batch, cfg: LossConfig, step: int) -> torch.Tensor:
    """[B, T-1] 1.0 on the positions step `step`'s loss averages over."""
    w = _weights(batch, step)
    if cfg.mask_outside_draft_vocab and head.reduced_vocab:
        w = w * _draftable(head, target, batch)
    return w


@torch.no_grad()
def supervised_positions(head, target, batch: Batch, cfg: LossConfig, steps: int) -> torch.Tensor:
    """[steps] how many positions each unrolled step's loss covers in `batch`."""
    return torch.stack([_loss_weights(head, target, batch, cfg, j).sum() for j in range(1, steps + 1)]).cpu()


def training_loss(head, target, target_rows: torch.Tensor, batch: Batch, cfg: LossConfig, steps: int,
                  denominators: torch.Tensor | None = None):
    """-> (scalar loss, {metric: float}). target_rows: [Vd, H] target LM-head rows of the draft vocab.

    denominators: [steps] positions per step over the whole global batch (every micro-batch on
    every rank, `supervised_positions` summed); the loss and metrics are then this batch's share
    of the global averages, so any split of a global batch sums to the same values. None: this
    batch's own counts (its averages)."""
    outputs = _predictions(head, target, batch, steps, cfg.noise_std)
    goal = batch.top[:, 1:].to(outputs[0].dtype)  # [B, T-1, H] f_{p+1}
    with torch.no_grad(), torch.autocast(device_type=goal.device.type, enabled=False):  # teacher in full precision
        p = F.linear(batch.top[:, 1:].float(), target_rows.float()).softmax(-1)  # [B, T-1, Vd], not autocast-rounded
        p_top = p.argmax(-1)
    total, metrics = 0.0, {}
    for j, hidden in enumerate(outputs, start=1):
        w = _loss_weights(head, target, batch, cfg, j)
        denom = w.sum().clamp(min=1.0) if denominators is None else float(denominators[j - 1].clamp(min=1.0))
        reg = F.smooth_l1_loss(hidden.float(), goal.float(), reduction="none").mean(-1)  # [B, T-1]
        log_q = head.draft_logits(hidden, target_rows).float().log_softmax(-1)  # [B, T-1, Vd]
        ce = -(p * log_q).sum(-1)  # [B, T-1]
        step_loss = ((cfg.reg_weight * reg + cfg.cls_weight * ce) * w).sum() / denom
        total = total + cfg.step_decay ** (j - 1) * step_loss
        metrics[f"acc_{j}"] = float(((log_q.argmax(-1) == p_top).float() * w).sum() / denom)
        metrics[f"reg_{j}"] = float((reg.detach() * w).sum() / denom)
        metrics[f"ce_{j}"] = float((ce.detach() * w).sum() / denom)
    return total, metrics


@torch.no_grad()
def heldout_accuracy(head, target, batches, depth: int,
                     total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
    """Top-1 accuracy at draft positions 1..depth against the target's own argmax over the
    full vocabulary, and the chain tau it implies: 1 + sum_d prod_{i<=d} acc_i. A draft LM
    predicts position 1 only here (its deeper positions need its own tokens: the bench measures them).
    total: sums a [depth] count over the ranks that each scored a share of the batches."""
    depth = 1 if isinstance(head, DraftLM) else min(depth, head.arch.num_heads) if isinstance(head, MedusaHeads) \
        else depth
    hits, counts = torch.zeros(depth), torch.zeros(depth)
    rows = draft_lm_head_weight(head, target).to(next(p for p in head.parameters() if p.requires_grad).dtype)
    for batch in batches:
        outputs = _predictions(head, target, batch, depth, 0.0)
        target_token = batch.greedy(target)[:, 1:]  # [B, T-1]
        for j, hidden in enumerate(outputs, start=1):
            w = _weights(batch, j).bool()
            draft_ids = head.draft_logits(hidden, rows).argmax(-1)
            draft_token = head.draft_to_target[draft_ids]
            hits[j - 1] += ((draft_token == target_token) & w).sum().item()
            counts[j - 1] += w.sum().item()
    if total is not None:
        hits, counts = total(hits), total(counts)
    acc = (hits / counts.clamp(min=1)).tolist()
    tau, chain = 1.0, 1.0
    for a in acc:
        chain *= a
        tau += chain
    return {**{f"eval_acc_{j + 1}": a for j, a in enumerate(acc)}, "eval_tau_chain": tau}
