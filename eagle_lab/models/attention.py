"""Attention for float32 targets on CPU: row-stable, so every path that scores the same token gets the same bits.

Every forward (a prompt's prefill, a decode step, a draft tree, a batch of rows) goes through eagle_lab's
row-stable attention (kernels/stable_attention.cpp): each query sums over its visible keys in one fixed
order, so a query's output depends on nothing but its own row and the keys it sees: not on the number of
queries beside it, the masked keys after it, the batch, or whether causality came as a mask or implied by
the cache. With the row-stable linear layers this makes a tree scored in one forward, a server row in a batch
and a one-token step of the same token give the same logits, bitwise; library attention changes its
summation order with the shapes and the mask's form, and with int8 activations (target.weights=w4a8) a
last-bit difference can move a rounding and the greedy token.

Its cost: a one-token step costs what SDPA's does, each extra row about two thirds of one more (each query on its
own); a long prompt's prefill is slower than SDPA's blocked kernel (docs/benchmarks.md).
Other dtypes and devices take SDPA with grouped heads read in place (`enable_gqa=True`, where transformers'
`sdpa` copies them whenever a mask is given on CPU). Registered as attention implementation `eagle_lab_cpu`
(with sdpa's masks), chosen at load for float32 CPU targets.
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
    causal = rows > 1 and attention_mask is None and (is_causal if is_causal is not None
                                                      else getattr(module, "is_causal", True))
    if causal and key.shape[2] > rows:  # a prefill into an empty static cache: the rest is unwritten
        key, value = key[:, :, :rows], value[:, :, :rows]
    if query.dtype == torch.float32 and query.device.type == "cpu" and dropout == 0.0:
        if causal:  # query t sees the keys up to its own position (the last `rows` keys are the new tokens)
            offset = key.shape[2] - rows
            attention_mask = torch.ones(rows, key.shape[2], dtype=torch.bool,
                                        device=query.device).tril(offset)[None, None]  # [1, 1, T, S]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return torch.ops.eagle_lab_attention.stable_attention(query, key, value, attention_mask, scale), None
    if key.shape[1] == query.shape[1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
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
