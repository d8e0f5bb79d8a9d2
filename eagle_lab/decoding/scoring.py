"""Scoring a round's tokens with the target: one forward, features and logits for every row.

A `Scorer` is one sequence's view of the target: the committed length `past`, `prefill`,
`score` (a chain or a tree of N tokens after `past`) and `commit` (keep the accepted path).
Two implementations share that contract:

  DynamicScorer  the target's Hugging Face DynamicCache, eager: tensors grow with the sequence.
  StaticScorer   a preallocated cache (static_cache.py) and a step of fixed shape: N tokens are
                 padded to a bucket, so a compiled graph (compiled.py) serves every round.

Both return logits for all scored rows from one LM-head matmul, so verification reads the
LM head once per round, whatever path the walk takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from eagle_lab.decoding.cache import keep_accepted, truncate
from eagle_lab.errors import EagleLabError
from eagle_lab.models.target import Target


@dataclass
class Scored:
    features: torch.Tensor  # [N, H] top features (the LM-head input) at the scored tokens
    head_features: torch.Tensor  # [N, F] what the drafter reads there (the top feature, or fused layers)
    logits: torch.Tensor  # [N, V] float32 target logits; after prefill, the last prompt token's only: [1, V]


class Scorer(Protocol):
    past: int  # tokens committed to the cache
    max_context: int  # the committed length at which decoding must stop

    def prefill(self, prompt_ids: torch.Tensor) -> Scored: ...

    def score(self, tokens: torch.Tensor, depths: torch.Tensor | None = None,
              tree_mask: torch.Tensor | None = None) -> Scored: ...

    def commit(self, accepted: torch.Tensor) -> None: ...

    def rewind(self) -> None:
        """Forget whatever was scored after `past` (a timed or abandoned round)."""
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


class StaticScorer:
    """A sequence on the runner's preallocated cache; rounds run the runner's fixed-shape step."""

    def __init__(self, runner, capacity: int, layer_ids: tuple[int, ...] = ()):
        self.runner, self.layer_ids = runner, layer_ids
        self.cache = runner.cache_for(capacity)
        self.past = 0
        self.max_context = min(runner.target.max_context, capacity - runner.slack)

    def prefill(self, prompt_ids: torch.Tensor) -> Scored:
        """Eager, over the static cache (prompt lengths vary; one graph per length would not pay)."""
        count = prompt_ids.numel()
        if count > self.max_context:
            raise EagleLabError(f"the prompt has {count} tokens, more than the cache holds ({self.max_context})")
        hidden, layers = self.runner.prefill(self.cache, 0, prompt_ids, self.layer_ids)
        self.past = count
        self.cache.set_length(count)
        return _scored(hidden[0], None if layers is None else layers[0],
                      self.runner.target.logits(hidden[0, -1:]))

    def score(self, tokens: torch.Tensor, depths: torch.Tensor | None = None,
              tree_mask: torch.Tensor | None = None) -> Scored:
        count = tokens.numel()
        bucket = self.runner.bucket(count)
        if self.past + bucket > self.cache.capacity:
            raise EagleLabError(f"the static cache ({self.cache.capacity}) cannot hold {count} more tokens "
                                f"after {self.past}")
        if tree_mask is None:
            tree_mask = torch.ones(count, count, dtype=torch.bool, device=tokens.device).tril()  # a chain
            depths = torch.arange(count, device=tokens.device)
        pad = bucket - count
        padded_tokens = torch.cat([tokens, tokens.new_zeros(pad)])  # [K]
        # padding rows sit after the tree, at fresh positions; they see only the prefix and themselves
        padded_depths = torch.cat([depths, torch.arange(count, bucket, device=tokens.device)])  # [K]
        full = torch.zeros(bucket, bucket, dtype=torch.bool, device=tokens.device)
        full[:count, :count] = tree_mask
        full[count:, count:] = torch.eye(pad, dtype=torch.bool, device=tokens.device)
        length = self.runner.attended_length(self.past + bucket, self.cache.capacity, 1, bucket, self.layer_ids)
        mask = self.runner.mask(full, self.past, length)  # [1, 1, K, L]
        hidden, layers, logits = self.runner.step(self.cache, self.past, length, padded_tokens[None],
                                                  (self.past + padded_depths)[None], mask, self.layer_ids)
        return _scored(hidden[0, :count], None if layers is None else layers[0, :count], logits[0, :count])

    def commit(self, accepted: torch.Tensor) -> None:
        self.cache.keep_accepted(self.past, accepted)
        self.past += accepted.numel()

    def rewind(self) -> None:
        self.cache.set_length(self.past)
