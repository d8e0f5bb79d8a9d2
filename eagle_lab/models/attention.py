"""Attention for targets on CPU: row-stable where exactness needs it, grouped heads read in place.

A decode step or a draft tree (a few query rows under a mask) goes through eagle_lab's row-stable attention
(kernels/stable_attention.cpp): every query's sums run in one fixed order over the visible keys, so a tree
scored in one forward gets bitwise the hidden states one-token steps get, whatever the attended length or
batch. With the row-stable linear layers this makes every forward over N tokens give each token exactly
what a one-token forward gives; library attention changes its summation order with the shapes, and with
int8 activations (target.weights=w4a8) a last-bit difference can move a rounding and the greedy token.

A prompt's causal prefill (no mask, many rows) runs through `scaled_dot_product_attention`: plain and
speculative decoding prefill the same prompt the same way. There `enable_gqa=True` reads each key/value
head in place for its query heads, where transformers' `sdpa` copies them (`repeat_kv`) whenever a mask
is given on CPU. Registered as attention implementation `eagle_lab_cpu` (with sdpa's masks), chosen for
float32 CPU targets at load.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from eagle_lab.models import native

NAME = "eagle_lab_cpu"
STABLE_ROWS = 64  # query rows up to which a masked forward (a step, a tree, a batch of them) is row-stable


@functools.cache
def load_attention_kernel() -> None:
    native.load("stable_attention")

    def shape(query, key, value, mask, scale):
        return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])

    torch.library.register_fake("eagle_lab_attention::stable_attention")(shape)


def cpu_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H, T, D], key / value [B, kvH, S, D], attention_mask [B, 1, T, >= S] or None
    -> [B, T, H, D]. Position biases and soft-capping go through transformers' own sdpa."""
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    rows = query.shape[2]
    stable = (rows <= STABLE_ROWS and (attention_mask is not None or rows == 1) and query.dtype == torch.float32
              and query.device.type == "cpu" and dropout == 0.0)
    if stable:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return torch.ops.eagle_lab_attention.stable_attention(query, key, value, attention_mask, scale), None
    if key.shape[1] == query.shape[1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = rows > 1 and attention_mask is None and (is_causal if is_causal is not None
                                                      else getattr(module, "is_causal", True))
    if causal and key.shape[2] > rows:  # a prefill into an empty static cache: the rest is unwritten
        key, value = key[:, :, :rows], value[:, :, :rows]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, cpu_attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_cpu_attention(model) -> bool:
    """Switch a float32 CPU model loaded with `sdpa` to `eagle_lab_cpu`; -> switched."""
    parameter = next(model.parameters())
    if model.config._attn_implementation != "sdpa" or parameter.device.type != "cpu" \
            or parameter.dtype != torch.float32:
        return False
    load_attention_kernel()
    model.set_attn_implementation(NAME)
    return True
