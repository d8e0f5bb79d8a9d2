"""Training batches: examples by index (captured or computed), epoch order, and collation."""

from __future__ import annotations

import random

import torch

from eagle_lab.models.target import Target
from eagle_lab.training.corpus import CorpusStore
from eagle_lab.training.features import Example, compute_features, greedy_tokens
from eagle_lab.training.losses import Batch


def collate(examples: list[Example], device: torch.device, dtype: torch.dtype, use_layers: bool) -> Batch:
    longest = max(e.input_ids.numel() for e in examples)
    b = len(examples)
    width = examples[0].features.shape[-1]
    in_width = examples[0].layer_features.shape[-1] if use_layers else width
    ids = torch.zeros(b, longest, dtype=torch.long)
    mask = torch.zeros(b, longest, dtype=torch.bool)
    valid = torch.zeros(b, longest, dtype=torch.bool)
    top = torch.zeros(b, longest, width, dtype=dtype)
    inputs = top if not use_layers else torch.zeros(b, longest, in_width, dtype=dtype)
    for i, e in enumerate(examples):
        n = e.input_ids.numel()
        ids[i, :n], mask[i, :n], valid[i, :n] = e.input_ids, e.loss_mask, True
        top[i, :n] = e.features.to(dtype)
        if use_layers:
            inputs[i, :n] = e.layer_features.to(dtype)
    greedy = None
    if all(e.target_token is not None for e in examples):
        greedy = torch.zeros(b, longest, dtype=torch.long)
        for i, e in enumerate(examples):
            greedy[i, : e.target_token.numel()] = e.target_token
        greedy = greedy.to(device)
    return Batch(ids.to(device), mask.to(device), valid.to(device), top.to(device), inputs.to(device), greedy)


class ExampleSource:
    """Examples by index, from captured shards (offline) or computed on demand (online)."""

    def __init__(self, target: Target, dataset, store: CorpusStore | None, layer_ids: tuple[int, ...]):
        self.target, self.dataset, self.store, self.layer_ids = target, dataset, store, layer_ids
        self._lengths: list[int] | None = None
        self._greedy: dict[int, torch.Tensor] = {}  # example index -> the target's greedy tokens [T]

    def __len__(self) -> int:
        return len(self.store) if self.store is not None else len(self.dataset)

    def lengths(self) -> list[int]:
        if self._lengths is None:
            self._lengths = (self.store.lengths() if self.store is not None
                             else [len(r["input_ids"]) for r in self.dataset])
        return self._lengths

    def get(self, indices: list[int], with_greedy: bool = False) -> list[Example]:
        """with_greedy: also attach the target's greedy tokens, computed once per stored example
        (a full-vocabulary LM-head pass costs as much as a training step's head work)."""
        if self.store is not None:
            examples = [self.store[i] for i in indices]
        else:
            rows = [self.dataset[i] for i in indices]
            computed = compute_features(self.target, [r["input_ids"] for r in rows], self.layer_ids)
            examples = [Example(torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"], dtype=torch.bool), f, lf)
                        for r, (f, lf) in zip(rows, computed)]
        if with_greedy:
            for index, example in zip(indices, examples):
                if example.target_token is None:
                    if index not in self._greedy:
                        self._greedy[index] = greedy_tokens(self.target, example.features).cpu().to(torch.int32)
                    example.target_token = self._greedy[index].long()
        return examples

    @property
    def tokens(self) -> int:
        return sum(self.lengths())


def epoch_order(count: int, seed: int, epoch: int, lengths: list[int] | None = None,
                batch_size: int = 1) -> list[int]:
    """A seeded permutation of the examples for one epoch.

    With `lengths`, the permutation is cut into windows of 64 batches, each window sorted
    by length and its batches shuffled again: every batch holds sequences of similar
    length (little padding), while each epoch still visits every example once in an
    order that depends only on (seed, epoch), so resuming replays it exactly.
    """
    rng = random.Random(seed * 100003 + epoch)
    order = list(range(count))
    rng.shuffle(order)
    if lengths is None or batch_size < 1:
        return order
    window = 64 * batch_size
    batches = []
    for start in range(0, count, window):
        chunk = sorted(order[start: start + window], key=lambda i: lengths[i], reverse=True)
        batches += [chunk[i: i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return [i for batch in batches for i in batch]
