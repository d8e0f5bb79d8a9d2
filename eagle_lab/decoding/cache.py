"""Keep or discard entries of a Hugging Face KV cache after a verification round.

The target scores the whole draft tree in one forward, so its cache grows by every tree
node; only the accepted path may stay. `keep_accepted` moves the accepted entries right
after the committed prefix and drops the rest, in place.
"""

from __future__ import annotations

import torch


def _layers(cache):
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"unsupported cache type {type(cache).__name__}: expected a transformers DynamicCache")
    return layers


def cache_length(cache) -> int:
    return cache.get_seq_length()


def keep_accepted(cache, past_len: int, accepted: torch.Tensor) -> None:
    """Keep positions [0, past_len) plus `past_len + accepted` (tree-node indices, in order): the accepted
    entries move in place (move_row_entries, in every row) and the cache is cut after them.

    accepted: [L] int64 indices into the nodes scored after `past_len`.
    """
    count = accepted.numel()
    if not (count == cache_length(cache) - past_len
            and bool((accepted == torch.arange(count, device=accepted.device)).all())):
        for layer in _layers(cache):
            if not getattr(layer, "is_initialized", True) or layer.keys is None:
                continue
            if getattr(layer, "is_sliding", False):
                raise TypeError("a sliding-window cache layer drops old entries and cannot keep a tree's path; build "
                                "the cache from Target.cache_config (every layer keeps every position)")
            index = accepted.to(layer.keys.device) + past_len
            for row in range(layer.keys.shape[0]):  # keys/values: [B, kvH, T, D]
                move_row_entries((layer.keys, layer.values), row, index, past_len)
    truncate(cache, past_len + count)


def move_row_entries(tensors, row: int, source: torch.Tensor, start: int) -> None:
    """In place, in each cache tensor [R, kvH, T, D]: row `row`'s entries at positions `source` [L] move to
    positions [start, start + L). Source and destination may overlap (index_select copies first). How a static
    or batched cache keeps a round's accepted path right after the committed prefix."""
    for tensor in tensors:
        tensor[row, :, start:start + source.numel()] = tensor[row].index_select(1, source)


def truncate(cache, length: int) -> None:
    """Drop every entry at position >= length."""
    extra = cache_length(cache) - length
    if extra > 0:
        cache.crop(-extra)
