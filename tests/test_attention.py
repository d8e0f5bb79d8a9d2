"""eagle_lab's CPU attention (eagle_lab/models/attention.py): what transformers' sdpa computes (tree masks,
causal prefills into a longer static cache, single queries), and row-stable: a query's output is bitwise the
same alone or among other queries, before more masked keys or fewer, in any batch, and whether causality comes
as a mask or from the cache."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from eagle_lab.models.attention import NAME, cpu_attention_forward, load_attention_kernel
from eagle_lab.models.target import TargetConfig, load_target

LOWEST = torch.finfo(torch.float32).min


def _module(groups: int) -> nn.Module:
    module = nn.Module()
    module.num_key_value_groups, module.is_causal = groups, True
    return module


def _tree_mask(g: torch.Generator, batch: int, rows: int, keys: int) -> torch.Tensor:
    """A tree over a past: each row sees the past and a random subset of the new rows, itself included."""
    seen = torch.rand(batch, 1, rows, keys, generator=g) > 0.4
    seen[..., -rows:] |= torch.eye(rows, dtype=torch.bool)
    return torch.zeros(batch, 1, rows, keys).masked_fill(~seen, LOWEST)


@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("rows, keys, masked", [(1, 9, True), (5, 12, True), (6, 6, False), (4, 16, False),
                                                (1, 7, False), (80, 80, False)])
@pytest.mark.parametrize("head_dim", [16, 40, 96, 256])  # one vector chunk, no vector form, 3 and 2 chunks
def test_it_computes_what_sdpa_computes(rows, keys, masked, heads, kv_heads, head_dim):
    load_attention_kernel()
    g = torch.Generator().manual_seed(rows * 100 + keys)
    query = torch.randn(2, heads, rows, head_dim, generator=g)  # [B, H, T, D]
    key, value = (torch.randn(2, kv_heads, keys, head_dim, generator=g) for _ in range(2))  # [B, kvH, S, D]
    mask = _tree_mask(g, 2, rows, keys) if masked else None
    got, _ = cpu_attention_forward(_module(heads // kv_heads), query, key, value, mask, scaling=0.35)
    # sdpa's own float32 kernel rounds differently per CPU (up to 2e-5 from the exact values on an AMX Xeon):
    # what it computes is judged in float64
    exact, _ = sdpa_attention_forward(_module(heads // kv_heads), query.double(), key.double(), value.double(),
                                      None if mask is None else mask.double(), scaling=0.35)
    assert got.shape == exact.shape == (2, rows, heads, head_dim)
    assert torch.allclose(got.double(), exact, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_a_query_gets_bitwise_the_same_alone_among_others_and_over_more_masked_keys(head_dim):
    load_attention_kernel()
    g = torch.Generator().manual_seed(3)
    past, rows, extra = 37, 5, 27
    query = torch.randn(2, 6, rows, head_dim, generator=g)
    key, value = (torch.randn(2, 2, past + rows + extra, head_dim, generator=g) for _ in range(2))
    allowed = torch.zeros(2, 1, rows, past + rows + extra, dtype=torch.bool)
    allowed[..., :past] = True
    allowed[..., past:past + rows] = torch.ones(rows, rows, dtype=torch.bool).tril()
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, LOWEST)
    together, _ = cpu_attention_forward(_module(3), query, key, value, mask, scaling=0.125)
    for t in range(rows):
        visible = past + t + 1  # a one-token step attends over just what it sees
        alone, _ = cpu_attention_forward(_module(3), query[:, :, t:t + 1], key[:, :, :visible],
                                         value[:, :, :visible], mask[:, :, t:t + 1, :visible], scaling=0.125)
        assert torch.equal(alone[:, 0], together[:, t])
        first_row, _ = cpu_attention_forward(_module(3), query[:1, :, t:t + 1], key[:1], value[:1],
                                             mask[:1, :, t:t + 1], scaling=0.125)
        assert torch.equal(first_row[0, 0], together[0, t])  # batch of one
    boolean, _ = cpu_attention_forward(_module(3), query, key, value, allowed, scaling=0.125)
    assert torch.equal(boolean, together)  # a boolean mask means the same


def test_cpu_targets_use_it():
    target = load_target(TargetConfig(name="tiny_llama", source="tiny", device="cpu"))
    assert target.config._attn_implementation == NAME


def test_a_tree_node_gets_bitwise_what_its_step_gets_after_the_path_is_compacted():
    """In a tree a node's ancestors sit between siblings (slots past + 1, past + 3, ...); once accepted they are
    moved next to each other, and the same token's one-token step sees them there. Same keys, other slots."""
    load_attention_kernel()
    g = torch.Generator().manual_seed(5)
    past, slots = 33, 7
    query = torch.randn(1, 6, 1, 64, generator=g)
    key, value = (torch.randn(1, 2, past + slots, 64, generator=g) for _ in range(2))
    path = [past + 1, past + 4, past + 6]  # the node's ancestors among its tree's slots, then itself
    allowed = torch.zeros(1, 1, 1, past + slots, dtype=torch.bool)
    allowed[..., :past] = True
    allowed[..., path] = True
    in_tree, _ = cpu_attention_forward(_module(3), query, key, value,
                                       torch.zeros(allowed.shape).masked_fill(~allowed, LOWEST), scaling=0.125)
    kept = list(range(past)) + path  # compacted: the accepted path right after the prefix
    stepped, _ = cpu_attention_forward(_module(3), query, key[:, :, kept], value[:, :, kept], None, scaling=0.125)
    assert torch.equal(in_tree, stepped)


def test_a_causal_prefill_gets_what_the_same_rows_get_under_an_explicit_mask():
    """serve.py's reference path prefills with causality implied (no mask); the static cache passes an explicit
    causal mask over a longer view. Both must give the prompt the same bits."""
    load_attention_kernel()
    g = torch.Generator().manual_seed(9)
    rows, view = 70, 80
    query = torch.randn(1, 6, rows, 64, generator=g)
    key, value = (torch.randn(1, 2, view, 64, generator=g) for _ in range(2))
    implied, _ = cpu_attention_forward(_module(3), query, key[:, :, :rows], value[:, :, :rows], None, scaling=0.125)
    allowed = torch.zeros(1, 1, rows, view, dtype=torch.bool)
    allowed[..., :rows] = torch.ones(rows, rows, dtype=torch.bool).tril()
    explicit, _ = cpu_attention_forward(_module(3), query, key, value,
                                        torch.zeros(allowed.shape).masked_fill(~allowed, LOWEST), scaling=0.125)
    assert torch.equal(implied, explicit)
