"""Attention masks for scoring trees and rows, sliding windows included.

Every forward that scores more than plain causal decoding implies (a draft tree, a server's rows, a
prefill into a static cache) passes the model an additive mask built here from a boolean one: True
where a query may attend to a key. A model whose layers attend over a sliding window (Mistral, Gemma 2/3,
Qwen2 with `use_sliding_window`, Phi-3) gets, for those layers, the same mask with every key at least
`window` positions behind its query hidden, judged by the tokens' positions, not their cache slots: a tree
node sits at slot past + i but at position past + depth(i).

The caches keep every position in every layer (`cache_config`): a sliding layer's cache that dropped old
entries could not score a tree and then keep any one of its paths, so the window lives in the mask alone,
and plain decoding reads the same cache through the same mask, which is what makes speculative output
equal to it.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch

from eagle_lab.errors import EagleLabError

FULL, SLIDING = "full_attention", "sliding_attention"

Mask = torch.Tensor | dict[str, torch.Tensor]  # one additive mask, or one per layer type (models that mix them)


@dataclass(frozen=True)
class AttentionLayout:
    """Which attention a model's decoder layers apply. window: a sliding layer's query at position p sees the
    keys at positions p - window < q <= p (Hugging Face's convention); None: every layer attends to all.
    mixed: full and sliding layers both, so the model takes a mask per layer type."""

    window: int | None = None
    mixed: bool = False

    @staticmethod
    def of(config) -> AttentionLayout:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        window = getattr(text, "sliding_window", None)
        types = getattr(text, "layer_types", None) or [SLIDING if window else FULL] * text.num_hidden_layers
        unknown = sorted(set(types) - {FULL, SLIDING})
        if unknown:
            raise EagleLabError(f"attention layers of type {', '.join(unknown)} are not supported "
                                f"(full and sliding-window attention are)")
        if not window or SLIDING not in types:
            return AttentionLayout()
        return AttentionLayout(window=int(window), mixed=FULL in types)

    def masks(self, allowed: torch.Tensor, query_positions: torch.Tensor, start: int, dtype: torch.dtype) -> Mask:
        """allowed [B, K, L] bool over cache slots, for K queries written at slots [start, start + K) at
        query_positions [B, K] (every other slot's position is its index: a committed prefix; the others are
        hidden) -> additive [B, 1, K, L], or {layer type: that} when mixed."""
        full = additive_mask(allowed, dtype)[:, None]
        if self.window is None:
            return full
        key_positions = slot_positions(query_positions, start, allowed.shape[-1])  # [B, L]
        behind = query_positions[:, :, None] - key_positions[:, None, :]  # [B, K, L]
        sliding = additive_mask(allowed & (behind < self.window), dtype)[:, None]
        return {FULL: full, SLIDING: sliding} if self.mixed else sliding


def cache_config(config):
    """The config a target's caches are built from: `config` itself, or for a model with sliding-window layers a
    copy whose layers all keep every position (the window is applied by the masks)."""
    if AttentionLayout.of(config).window is None:
        return config
    full = copy.deepcopy(config)
    text = full.get_text_config(decoder=True)
    text.layer_types = [FULL] * text.num_hidden_layers
    text.sliding_window = None
    return full


def slot_positions(positions: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """positions [B, K] of tokens written at cache slots [start, start + K) -> [B, length]: each slot's position
    (a committed slot's position is its index)."""
    rows, count = positions.shape
    slots = torch.arange(length, device=positions.device).repeat(rows, 1)  # [B, L]
    slots[:, start:start + count] = positions[:, :length - start]
    return slots


def contiguous(mask: Mask) -> Mask:
    if isinstance(mask, dict):
        return {kind: tensor.contiguous() for kind, tensor in mask.items()}
    return mask.contiguous()


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True: may attend) as the additive float mask attention takes: 0 where allowed,
    the dtype's lowest value elsewhere; same shape. One `where` over two cached scalars: a speculative round
    builds masks several times, and zeros + masked_fill cost three kernels each."""
    zero, lowest = _mask_values(dtype, allowed.device)
    return torch.where(allowed, zero, lowest)


@functools.lru_cache(maxsize=16)
def _mask_values(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d tensors (0, the dtype's lowest value) for additive_mask: read only."""
    return (torch.zeros((), dtype=dtype, device=device),
            torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=device))


def causal_mask(count: int, device: torch.device) -> torch.Tensor:
    """[count, count] bool, True on and below the diagonal: a chain's ancestor-or-self mask. Read only: the
    small ones a round asks for are cached (callers copy from them), and none is built with `tril`, which
    opens a parallel region on CPU (costly with the decoding threads asleep)."""
    return _small_causal_mask(count, device) if count <= 64 else _causal_mask(count, device)


@functools.lru_cache(maxsize=64)
def _small_causal_mask(count: int, device: torch.device) -> torch.Tensor:
    return _causal_mask(count, device)


def _causal_mask(count: int, device: torch.device) -> torch.Tensor:
    steps = torch.arange(count, device=device)
    return steps[:, None] >= steps[None, :]


def visibility(pasts: list[int], trees: list[torch.Tensor | None], queries: int, length: int, tree_start: int,
               query_start: int | None = None) -> torch.Tensor:
    """Which cache slots each query may attend to, for R rows that each write `queries` (K) queries at slots
    query_start .. query_start + K - 1 (default: tree_start) of a cache of `length` (L) slots: row r's query
    j < n_r sees the row's committed slots [0, pasts[r]) and the slots tree_start + c where trees[r][j, c]
    (trees[r]: [n_r, m_r] bool, its tree's ancestor-or-self rows, or a chain's causal mask); every other query
    (padding, or a whole row whose tree is None) sees only its own slot, so no softmax is empty. The one
    builder of prefix-plus-tree masks: the target's forwards (one sequence, static rows) and the drafters'.
    -> [R, K, L] bool."""
    device = next(tree.device for tree in trees if tree is not None)
    start = tree_start if query_start is None else query_start
    allowed = torch.zeros(len(trees), queries, length, dtype=torch.bool, device=device)  # [R, K, L]
    allowed[:, :, start:start + queries].diagonal(dim1=1, dim2=2).fill_(True)  # padding sees itself
    for row, (past, tree) in enumerate(zip(pasts, trees)):
        if tree is not None:
            count, width = tree.shape
            allowed[row, :count, :past] = True
            allowed[row, :count, tree_start:tree_start + width] = tree
    return allowed


def tree_attention_mask(tree_mask: torch.Tensor, past_len: int, positions: torch.Tensor | None,
                        layout: AttentionLayout, dtype: torch.dtype) -> Mask:
    """tree_mask [K, K] bool (ancestor or self), positions [1, K] the nodes' positions (needed for a window)
    -> [1, 1, K, past_len + K] additive (per layer type when mixed): the committed prefix is visible to every
    node, within its window."""
    k = tree_mask.shape[0]
    allowed = visibility([past_len], [tree_mask], k, past_len + k, past_len)  # [1, K, L]
    return layout.masks(allowed, positions, past_len, dtype)
