"""Unrolled drafting over whole sequences in parallel ("training-time test", EAGLE-3).

At inference the head drafts a chain: step 1 reads the target's feature f_a and token
x_{a+1}; step j reads its own step j-1 output and x_{a+j}, attending to the committed
pairs (real, positions <= a) plus its own earlier draft steps for the same anchor a.
Indexing by query position p = a + j - 1, step j attends to
  - step-1 keys at positions s <= p - (j - 1)           (the committed prefix)
  - step-i keys at position p - (j - i), for i = 2..j    (its own earlier steps)
which this module computes for every p at once, so training and evaluation see exactly
what drafting sees (tests check it against sequential drafting).
"""

from __future__ import annotations

import math

import torch


def shift_right(x: torch.Tensor, by: int, dim: int) -> torch.Tensor:
    """Move entries `by` places to higher indices along `dim`, zero-filling the start."""
    if by == 0:
        return x
    length = x.shape[dim]
    kept = x.narrow(dim, 0, length - by)
    pad_shape = list(x.shape)
    pad_shape[dim] = by
    return torch.cat([x.new_zeros(pad_shape), kept], dim=dim)


def unrolled_attention(attn, q, k, v, history: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """q [B, nH, T, D], k/v [B, kvH, T, D] of step j = len(history) + 1 -> [B, nH, T, D]."""
    step = len(history) + 1
    k, v = attn.expand_kv(k), attn.expand_kv(v)
    if step == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    scale = 1.0 / math.sqrt(q.shape[-1])
    real_k, real_v = attn.expand_kv(history[0][0]), attn.expand_kv(history[0][1])
    length = q.shape[2]
    scores = (q @ real_k.transpose(-1, -2)) * scale  # [B, nH, T, T]
    pos = torch.arange(length, device=q.device)
    scores = scores.masked_fill(pos[None, :] > pos[:, None] - (step - 1), float("-inf"))
    diag_scores, diag_values = [], []
    own = [(attn.expand_kv(hk), attn.expand_kv(hv)) for hk, hv in history[1:]] + [(k, v)]
    for i, (ki, vi) in enumerate(own, start=2):
        shift = step - i
        ki, vi = shift_right(ki, shift, dim=2), shift_right(vi, shift, dim=2)  # key of step i at p - shift
        diag_scores.append((q * ki).sum(-1, keepdim=True) * scale)  # [B, nH, T, 1]
        diag_values.append(vi)
    weights = torch.cat([scores, *diag_scores], dim=-1).softmax(dim=-1)  # [B, nH, T, T + j - 1]
    out = weights[..., :length] @ real_v  # [B, nH, T, D]
    for offset, vi in enumerate(diag_values):
        out = out + weights[..., length + offset: length + offset + 1] * vi
    return out


def unrolled_hidden(head, token_embeds: torch.Tensor, features: torch.Tensor, cos, sin, steps: int):
    """Draft `steps` chain steps at every position at once.

    token_embeds: [B, T, H] embeddings of x_{p+1}; features: [B, T, F] target features f_p.
    Returns a list of `steps` tensors [B, T, H]; entry j-1 at position p predicts
    f_{p+1} from anchor a = p - j + 1 (valid where p >= j - 1).
    """
    attn = head.layer.self_attn
    b, t, _ = token_embeds.shape
    outputs, history = [], []
    current = features
    for step in range(steps):
        attn_in, residual = head.inputs(token_embeds, current, from_draft=step > 0)
        q, k, v = attn.project(attn_in, cos, sin)
        out = unrolled_attention(attn, q, k, v, history)  # [B, nH, T, D]
        history.append((k, v))
        hidden = head.layer.finish(residual, attn.o_proj(out.transpose(1, 2).reshape(b, t, -1)))  # [B, T, H]
        outputs.append(hidden)
        current = shift_right(hidden, 1, dim=1)  # step j+1 at p reads step j's output at p - 1
    return outputs
