"""The draft vocabulary: the most frequent supervised tokens (verification keeps the full one)."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def supervised_counts(token_lists, vocab_size: int) -> torch.Tensor:
    """[V] how often each token id occurs under the loss mask; token_lists yields id tensors."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in token_lists:
        counts += torch.bincount(ids.long(), minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocabulary(counts: torch.Tensor, size: int, always: set[int]) -> torch.Tensor | None:
    """The `size` most frequent supervised target tokens (ties: lower id first), plus `always`
    (the eos ids); counts [V] from `supervised_counts`."""
    vocab_size = counts.numel()
    if size <= 0 or size >= vocab_size:
        return None
    chosen = [t for t in sorted(always) if t < vocab_size]
    ranked = counts.clone()
    ranked[chosen] = -1
    order = torch.sort(ranked, descending=True, stable=True).indices  # frequent first; unseen ids fill up
    chosen += order[: size - len(chosen)].tolist()
    total = int(counts.sum())
    covered = int(counts[chosen].sum())
    log.info("draft vocabulary: %d of %d tokens cover %.2f%% of supervised tokens", size, vocab_size,
             100.0 * covered / max(total, 1))
    return torch.tensor(sorted(chosen), dtype=torch.long)
