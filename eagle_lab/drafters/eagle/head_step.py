"""The draft head's step as it is exported and compiled: what a head-step package is built from.

One step feeds T rows (a round's new committed pairs, or one level's frontier) through the head and
returns each row's predicted feature and its top-k draft tokens, writing the rows' keys and values
into the head cache at given slots in place. Only this module (with the head's own code and kernels)
goes into a package's key; the code that pads rows and calls the packages lives in head_runner.py, so
changing it leaves the packages built on a machine valid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eagle_lab.drafters.eagle.head import EagleHead
from eagle_lab.models.stable_linear import StableLinear

# what the head step's packages are built from
STEP_SOURCES = ("drafters/eagle/head_step.py", "drafters/eagle/head.py", "drafters/eagle/eagle3.py",
                "models/stable_linear.py")  # the kernels it calls are not in it (decoding/compiled.py)


class HeadStep(nn.Module):
    """(keys, values [1, kvH, C, D], written at `slots`), tokens [1, T], features [1, T, F], positions [1, T],
    slots [T], mask [1, 1, T, C] additive -> hidden [1, T, H], top-k log-probs [T, k], top-k draft ids [T, k]."""

    def __init__(self, head: EagleHead, embed_tokens: nn.Module, rotary: nn.Module, lm_weight: torch.Tensor):
        super().__init__()
        self.head, self.embed_tokens, self.rotary = head, embed_tokens, rotary
        # tied rows (the full vocabulary of a target with tied embeddings) are read through the embedding: one
        # tensor under two names would not export
        weight = embed_tokens.weight
        self.rows_are_embedding = (lm_weight.data_ptr() == weight.data_ptr() and lm_weight.shape == weight.shape
                                   and lm_weight.dtype == weight.dtype)
        # a head on the row-stable kernel reads the target's LM-head rows through it too, in the same storage
        storage = getattr(head.fc, "storage", None)
        self.lm_linear = None
        if storage is not None and head.reads_target_lm_rows:
            rows = nn.Linear(lm_weight.shape[1], lm_weight.shape[0], bias=False)
            rows.weight = nn.Parameter(lm_weight.detach().float(), requires_grad=False)
            self.lm_linear = StableLinear(rows, storage)  # [Vd, H] in panels
        elif not self.rows_are_embedding:
            self.register_buffer("lm_rows", lm_weight)  # [Vd, H]

    @property
    def lm_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.rows_are_embedding else self.lm_rows

    def forward(self, keys, values, tokens, features, positions, slots, mask, k: int, from_draft: bool,
                last_only: bool = False):
        """last_only: top-k of the last row alone (an eager prompt commit reads nothing else)."""
        rows = tokens.shape[1]
        attention = self.head.layer.self_attn
        embeds = self.embed_tokens(tokens).to(self.head.dtype)  # [1, T, H] the target's table, the head's dtype
        cos, sin = self.rotary(embeds, positions)  # [1, T, D] each
        attn_in, residual = self.head.inputs(embeds, features, from_draft)  # [1, T, In], [1, T, H]
        query, key, value = attention.project(attn_in, cos, sin)  # [1, nH, T, D], [1, kvH, T, D] x2
        keys.index_copy_(2, slots, key)
        values.index_copy_(2, slots, value)
        grouped = query.shape[1] != keys.shape[1]  # key/value heads read in place for their query groups
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=grouped)  # [1, nH, T, D]
        hidden = self.head.layer.finish(residual, attention.o_proj(out.transpose(1, 2).reshape(1, rows, -1)))
        scored = hidden[0, -1:] if last_only else hidden[0]  # [T or 1, H]
        if self.lm_linear is not None:
            logits = self.lm_linear(scored)
        else:
            logits = self.head.draft_logits(scored, self.lm_weight)
        logp = logits.float().log_softmax(-1)  # [T or 1, Vd]
        top = logp.topk(k, dim=-1)
        return hidden, top.values, top.indices


class BoundHeadStep(nn.Module):
    """HeadStep with its constants bound: what one compiled bucket runs (export takes tensors only)."""

    def __init__(self, step: HeadStep, k: int, from_draft: bool):
        super().__init__()
        self.step, self.k, self.from_draft = step, k, from_draft

    def forward(self, keys, values, tokens, features, positions, slots, mask):
        return self.step(keys, values, tokens, features, positions, slots, mask, self.k, self.from_draft)
