"""Training objective and held-out metrics of a draft head.

For every position p the head reads (f_p, x_{p+1}) and predicts f_{p+1}; with unrolled
steps (EAGLE-3 "training-time test") step j predicts f_{p+1} from its own earlier outputs.
  loss_j = reg_weight * SmoothL1(f^_{p+1}, f_{p+1})
         + cls_weight * CE(softmax(LM(f_{p+1})), log_softmax(LM_draft(f^_{p+1})))
over positions whose f_{p+1} belongs to an assistant token, weighted step_decay ** (j-1).
The target distribution is restricted to the draft vocabulary (renormalised) when the
head has a reduced one; verification still uses the full vocabulary, so this only
changes what the head learns, never the output.

Terms aimed at acceptance rather than likelihood, each off by default:
  accept_weight    + w * (1 - sum_v min(p_v, q_v)): one minus the probability that a token drawn
                   from the head is accepted at T=1 (the rejection rule's acceptance).
  distill_top_k    the cross-entropy sums over the target's K most likely tokens only (HASS):
                   the head spends no capacity matching the target's tail.
  align_top_k      step j >= 2 learns only where steps 1..j-1 of the same anchor ranked the target's
                   token within their top K (GRIFFIN): a draft after a rejected one is never verified.
  opening_tokens   the first N supervised tokens of each reply weigh opening_weight, where the head
                   is least sure and a reply's first rounds are decided.
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

OPENING_TOKENS = 64  # a reply's opening for the held-out metric: where the head accepts least


@dataclass
class LossConfig:
    reg_weight: float = 1.0  # Smooth-L1 on the predicted feature (EAGLE: 1.0)
    cls_weight: float = 0.1  # cross-entropy against the target's distribution (EAGLE: 0.1)
    noise_std: float = 0.05  # std of uniform noise on input features (EAGLE: U(-0.1, 0.1))
    step_decay: float = 0.8  # weight of unrolled step j is step_decay ** (j - 1) (EAGLE-3)
    mask_outside_draft_vocab: bool = False  # skip positions whose target token the draft cannot emit
    accept_weight: float = 0.0  # weight of 1 - sum min(p, q), the head's rejection rate at T=1
    distill_top_k: int = 0  # > 0: the cross-entropy over the target's K most likely tokens only
    align_top_k: int = 0  # > 0: step j >= 2 only where the same anchor's earlier steps ranked the token top-K
    opening_tokens: int = 0  # > 0: the first N supervised tokens of a reply weigh opening_weight
    opening_weight: float = 1.0


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


def reply_positions(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool -> [B, T] long: each True's place in its run of Trues (0 at a reply's first
    supervised token), -1 where False."""
    index = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)  # [B, T]
    before = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)  # [B, T] mask one place earlier
    starts = torch.where(mask & ~before, index, torch.zeros_like(index))  # a run's first index, else 0
    run_start = starts.cummax(dim=1).values  # [B, T] the latest run start at or before each index
    return torch.where(mask, index - run_start, torch.full_like(index, -1))


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
    if cfg.opening_tokens > 0:
        place = reply_positions(batch.loss_mask[:, 1:])  # [B, T-1] place of f_{p+1} in its reply
        opening = (place >= 0) & (place < cfg.opening_tokens)
        w = w * torch.where(opening, cfg.opening_weight, 1.0)
    return w


def _teacher(p: torch.Tensor, top_k: int) -> torch.Tensor:
    """[..., Vd] the target's distribution, zero outside its top_k tokens when top_k > 0 (not renormalised:
    a position whose mass sits in the tail teaches less)."""
    if top_k <= 0 or top_k >= p.shape[-1]:
        return p
    values, indices = p.topk(top_k, dim=-1)
    return torch.zeros_like(p).scatter_(-1, indices, values)


def _ranked(log_q: torch.Tensor, goal: torch.Tensor, top_k: int) -> torch.Tensor:
    """[B, T-1] bool: the goal token is among the head's top_k draft tokens."""
    return (log_q.topk(min(top_k, log_q.shape[-1]), dim=-1).indices == goal[..., None]).any(-1)


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
        teacher = _teacher(p, cfg.distill_top_k)
    total, metrics = 0.0, {}
    aligned = None  # [B, T-1] bool: the same anchor's earlier steps all ranked their token (align_top_k)
    for j, hidden in enumerate(outputs, start=1):
        w = _loss_weights(head, target, batch, cfg, j)
        denom = w.sum().clamp(min=1.0) if denominators is None else float(denominators[j - 1].clamp(min=1.0))
        reg = F.smooth_l1_loss(hidden.float(), goal.float(), reduction="none").mean(-1)  # [B, T-1]
        log_q = head.draft_logits(hidden, target_rows).float().log_softmax(-1)  # [B, T-1, Vd]
        ce = -(teacher * log_q).sum(-1)  # [B, T-1]
        per_position = cfg.reg_weight * reg + cfg.cls_weight * ce
        if cfg.accept_weight > 0:
            overlap = torch.minimum(p, log_q.exp()).sum(-1)  # [B, T-1] P(accept) of a draw from q at T=1
            per_position = per_position + cfg.accept_weight * (1.0 - overlap)
        learned = w if aligned is None else w * aligned  # masked: add nothing, still counted (split-invariant)
        step_loss = (per_position * learned).sum() / denom
        total = total + cfg.step_decay ** (j - 1) * step_loss
        if cfg.align_top_k > 0:
            with torch.no_grad():  # step j + 1 at index p continues the anchor of step j at index p - 1
                ranked = _ranked(log_q, p_top, cfg.align_top_k)
                aligned = ranked if aligned is None else aligned & ranked
                aligned = torch.nn.functional.pad(aligned[:, :-1], (1, 0), value=False)
        metrics[f"acc_{j}"] = float(((log_q.argmax(-1) == p_top).float() * w).sum() / denom)
        metrics[f"reg_{j}"] = float((reg.detach() * w).sum() / denom)
        metrics[f"ce_{j}"] = float((ce.detach() * w).sum() / denom)
    return total, metrics


@torch.no_grad()
def heldout_accuracy(head, target, batches, depth: int,
                     total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
    """Top-1 accuracy at draft positions 1..depth against the target's own argmax over the full vocabulary, and
    - eval_tau_chain: the chain tau those accuracies imply, 1 + sum_d prod_{i<=d} acc_i;
    - eval_tau_accepted: 1 + the mean number of leading drafts of a depth-long chain that equal the target's
      tokens, per anchor (what greedy verification accepts; unlike the product, it sees whether a later draft
      is right after the earlier ones were);
    - eval_acc_1_opening: position 1's accuracy over each reply's first OPENING_TOKENS supervised tokens;
    - eval_overlap_1: position 1's sum_v min(p_v, q_v), the chance that a draft drawn from the head at T=1 is
      accepted, p the target's distribution renormalised over the draft vocabulary (so an upper bound where the
      vocabulary is reduced).
    A draft LM predicts position 1 only here (its deeper positions need its own tokens: the bench measures them).
    total: sums a count vector over the ranks that each scored a share of the batches."""
    depth = 1 if isinstance(head, DraftLM) else min(depth, head.arch.num_heads) if isinstance(head, MedusaHeads) \
        else depth
    # [depth] hits per position, [depth] leading runs of hits, [1] position 1 in replies' openings, [1] overlap
    hits, counts = torch.zeros(2 * depth + 2), torch.zeros(2 * depth + 2)
    rows = draft_lm_head_weight(head, target).to(next(p for p in head.parameters() if p.requires_grad).dtype)
    for batch in batches:
        outputs = _predictions(head, target, batch, depth, 0.0)
        target_token = batch.greedy(target)[:, 1:]  # [B, T-1]
        anchors = _weights(batch, 1).bool()  # [B, T-1]
        leading = None  # [B, T-1] steps 1..j of the anchor p - j + 1 all right
        for j, hidden in enumerate(outputs, start=1):
            w = _weights(batch, j).bool()
            logits = head.draft_logits(hidden, rows).float()  # [B, T-1, Vd]
            right = (head.draft_to_target[logits.argmax(-1)] == target_token) & w  # [B, T-1]
            leading = right if leading is None else right & torch.nn.functional.pad(leading[:, :-1], (1, 0))
            hits[j - 1] += right.sum().item()
            counts[j - 1] += w.sum().item()
            hits[depth + j - 1] += leading.sum().item()
            counts[depth + j - 1] += anchors.sum().item()
            if j == 1:
                opening = w & (reply_positions(batch.loss_mask[:, 1:]) < OPENING_TOKENS)
                hits[-2] += (right & opening).sum().item()
                counts[-2] += opening.sum().item()
                p = F.linear(batch.top[:, 1:].float(), rows.float()).softmax(-1)  # [B, T-1, Vd]
                overlap = torch.minimum(p, logits.softmax(-1)).sum(-1)  # [B, T-1]
                hits[-1] += (overlap * w).sum().item()
                counts[-1] += w.sum().item()
    if total is not None:
        hits, counts = total(hits), total(counts)
    rates = (hits / counts.clamp(min=1)).tolist()
    acc, runs, (opening_acc, overlap) = rates[:depth], rates[depth: 2 * depth], rates[-2:]
    tau, chain = 1.0, 1.0
    for a in acc:
        chain *= a
        tau += chain
    return {**{f"eval_acc_{j + 1}": a for j, a in enumerate(acc)}, "eval_tau_chain": tau,
            "eval_tau_accepted": 1.0 + sum(runs), "eval_acc_1_opening": opening_acc, "eval_overlap_1": overlap}
