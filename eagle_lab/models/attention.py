"""SDPA with grouped-query attention done inside the kernel, for targets on CPU.

Transformers' `sdpa` attention copies each key/value head to every query head of its group
(`repeat_kv`) whenever a mask is given on CPU, which every tree forward has. The copies cost a
multi-token forward of SmolLM2 (9 query heads over 3 key/value heads) several milliseconds on 2
cores; `scaled_dot_product_attention(enable_gqa=True)` reads the shared heads in place. Registered
as attention implementation `sdpa_gqa` (with sdpa's masks), chosen for CPU targets at load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_gqa"


def gqa_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H, T, D], key / value [B, kvH, S, D], attention_mask [B, 1, T, >= S] or None
    -> [B, T, H, D]. Position biases and soft-capping go through transformers' own sdpa."""
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None or key.shape[1] == query.shape[1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    rows = query.shape[2]
    causal = rows > 1 and attention_mask is None and (is_causal if is_causal is not None
                                                      else getattr(module, "is_causal", True))
    if causal and key.shape[2] > rows:  # a prefill into an empty static cache: the rest is unwritten
        key, value = key[:, :, :rows], value[:, :, :rows]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, gqa_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_native_gqa(model) -> bool:
    """Switch a model loaded with `sdpa` to `sdpa_gqa` when its attention groups query heads; -> switched."""
    config = model.config
    groups = config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    if config._attn_implementation != "sdpa" or groups < 2:
        return False
    model.set_attn_implementation(NAME)
    return True
