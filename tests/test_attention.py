"""`sdpa_gqa` (eagle_lab/models/attention.py) computes what transformers' sdpa computes with copied
key/value heads: tree masks, causal prefills (into a longer static cache too) and single queries."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from eagle_lab.models.attention import gqa_sdpa_forward
from eagle_lab.models.target import TargetConfig, load_target


def _module(groups: int) -> nn.Module:
    module = nn.Module()
    module.num_key_value_groups, module.is_causal = groups, True
    return module


@pytest.mark.parametrize("rows, keys, masked", [(1, 9, True), (5, 12, True), (6, 6, False), (4, 16, False)])
def test_grouped_heads_in_the_kernel_equal_copied_heads(rows, keys, masked):
    g = torch.Generator().manual_seed(rows * 100 + keys)
    query = torch.randn(2, 6, rows, 8, generator=g)  # [B, H, T, D]
    key, value = torch.randn(2, 2, keys, 8, generator=g), torch.randn(2, 2, keys, 8, generator=g)  # [B, kvH, S, D]
    mask = None
    if masked:  # a tree over a past: each row sees the past and a random subset of the new rows, itself included
        seen = torch.rand(2, 1, rows, keys, generator=g) > 0.4
        seen[..., -rows:] |= torch.eye(rows, dtype=torch.bool)
        mask = torch.zeros(2, 1, rows, keys).masked_fill(~seen, torch.finfo(torch.float32).min)
    got, _ = gqa_sdpa_forward(_module(3), query, key, value, mask, scaling=0.35)
    want, _ = sdpa_attention_forward(_module(3), query, key, value, mask, scaling=0.35)
    assert got.shape == want.shape == (2, rows, 6, 8)
    assert torch.allclose(got, want, atol=1e-6)


def test_cpu_targets_with_grouped_heads_use_it():
    target = load_target(TargetConfig(name="tiny_llama", source="tiny", device="cpu"))
    assert target.config.num_key_value_heads < target.config.num_attention_heads
    assert target.config._attn_implementation == "sdpa_gqa"
