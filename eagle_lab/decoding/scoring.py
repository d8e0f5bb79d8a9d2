"""Scoring a round's tokens with the target: one forward, features and logits for every row.

A `Scorer` is one sequence's view of the target: the committed length `past`, `prefill`,
`score` (a chain or a tree of N tokens after `past`) and `commit` (keep the accepted path).
Two implementations share that contract:

  DynamicScorer  the target's Hugging Face DynamicCache, eager: tensors grow with the sequence.
  RowScorer      a row of static rows (static_rows.py): a preallocated cache and the step that also
                 scores the server's batches; N tokens are padded to a bucket, so a compiled graph
                 (compiled.py) serves every round.

Both return logits for all scored rows from one LM-head matmul, so verification reads the
LM head once per round, whatever path the walk takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from eagle_lab.decoding.cache import keep_accepted, truncate
from eagle_lab.models.target import Target


@dataclass
class Scored:
    features: torch.Tensor  # [N, H] top features (the LM-head input) at the scored tokens
    head_features: torch.Tensor  # [N, F] what the drafter reads there (the top feature, or fused layers)
    logits: torch.Tensor  # [N, V] float32 target logits; after prefill, the last prompt token's only: [1, V]


class Scorer(Protocol):
    past: int  # tokens committed to the cache
    max_context: int  # the committed length at which decoding must stop
    layer_ids: tuple[int, ...]  # target layers whose features it returns as head_features (() for the top)

    def prefill(self, prompt_ids: torch.Tensor) -> Scored: ...

    def score(self, tokens: torch.Tensor, depths: torch.Tensor | None = None,
              tree_mask: torch.Tensor | None = None) -> Scored: ...

    def commit(self, accepted: torch.Tensor) -> None: ...

    def rewind(self) -> None:
        """Forget whatever was scored after `past` (a timed or abandoned round)."""
        ...

    def release(self) -> None:
        """The sequence is done: free what it holds (a row of static rows)."""
        ...


def _scored(hidden: torch.Tensor, layers: torch.Tensor | None, logits: torch.Tensor) -> Scored:
    """hidden [N, H], layers [N, F] or None (the drafter then reads the top feature), logits [N or 1, V]."""
    return Scored(features=hidden, head_features=layers if layers is not None else hidden, logits=logits)


class DynamicScorer:
    """Eager forwards over a DynamicCache (the reference path; every family and attention kind)."""

    def __init__(self, target: Target, layer_ids: tuple[int, ...] = ()):
        self.target, self.layer_ids = target, layer_ids
        self.cache = target.new_cache()
        self.past = 0
        self.max_context = target.max_context

    def prefill(self, prompt_ids: torch.Tensor) -> Scored:
        """prompt_ids: [T] -> features [T, H], logits of the last token [1, V]."""
        out = self.target.forward(prompt_ids[None], self.cache, layer_ids=self.layer_ids)
        self.past = prompt_ids.numel()
        layers = out.layer_features[0] if out.layer_features is not None else None  # [T, F]
        return _scored(out.features[0], layers, self.target.logits(out.features[0, -1:]))

    def score(self, tokens: torch.Tensor, depths: torch.Tensor | None = None,
              tree_mask: torch.Tensor | None = None) -> Scored:
        """tokens: [N] after `past`; depths [N] and tree_mask [N, N] for a tree, None for a chain."""
        if tree_mask is None or tokens.numel() == 1:
            # a chain (or the root alone): the cache implies positions and causality, so no 4-D mask is
            # built and attention takes plain decoding's kernel
            out = self.target.forward(tokens[None], self.cache, layer_ids=self.layer_ids)
        else:
            positions = (self.past + depths)[None]  # [1, N]
            out = self.target.forward(tokens[None], self.cache, positions, tree_mask, self.layer_ids)
        layers = out.layer_features[0] if out.layer_features is not None else None
        return _scored(out.features[0], layers, self.target.logits(out.features[0]))  # [N, V]

    def commit(self, accepted: torch.Tensor) -> None:
        keep_accepted(self.cache, self.past, accepted)
        self.past += accepted.numel()

    def rewind(self) -> None:
        truncate(self.cache, self.past)

    def release(self) -> None:
        self.cache = None
