"""Measuring costs for tree=auto: the target's forward cost for K scored tokens after a realistic
prefix, the drafter's cost per tree level for each frontier width k, and whole rounds timed in the
decoding loop. CostModel prices a round of any shape from them.

"Do not draft" competes like for like: it is priced by timing the no-draft path itself (the
same loop with the head switched off), not by a model.

Hybrid drafting (the drafter has an n-gram proposer): a round scores the tree's tokens plus the
chain tokens the tree did not already hold, which the cost model charges round by round
(target(K + 1) with the extra tokens in K, the overhead slope on them, plus the proposer's time).
"n-gram only" (no head run, the root plus the chain) is priced as target(K + 1) plus the measured
cost of such a round beyond its forward (timed n-gram-only rounds: proposing, verification,
compaction; it shares none of the head rounds' tree overhead), or as the measured no-draft round
when the chain is empty.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from eagle_lab.decoding.backend import Backend, EagerBackend
from eagle_lab.decoding.generate import Stopper, speculative_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.drafters.ngram import NgramProposer
from eagle_lab.models.masks import causal_mask
from eagle_lab.models.target import Target

K_GRID = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def forward_ms(timed: dict[int, float], k: int) -> float:
    """ms of a forward over k scored tokens from those timed at some sizes: linear between them, the smallest's
    below, extended linearly past the largest."""
    keys = sorted(timed)
    if k <= keys[0]:
        return timed[keys[0]]
    for lo, hi in zip(keys, keys[1:]):
        if k <= hi:
            w = (k - lo) / (hi - lo)
            return (1 - w) * timed[lo] + w * timed[hi]
    if len(keys) == 1:
        return timed[keys[0]]
    lo, hi = keys[-2], keys[-1]  # extrapolate linearly past the grid
    return timed[hi] + (k - hi) * (timed[hi] - timed[lo]) / (hi - lo)


@dataclass
class CostModel:
    target_ms: dict[int, float]  # K scored tokens -> ms
    level_ms: dict[int, float]  # frontier width k -> ms per tree level below the first
    first_level_ms: float  # feeding the accepted pairs + the root's children
    overhead_ms: float  # per tree round, outside the two models (verification, bookkeeping)...
    overhead_per_token_ms: float = 0.0  # ... plus this much per scored draft token
    plain_ms: float = 0.0  # measured: one round of the no-draft path (one token); 0 = not measured
    ngram_ms: float = 0.0  # measured: proposing one n-gram chain (hybrid drafting only)
    ngram_round_ms: float | None = None  # measured: an n-gram-only round beyond target(K); None = not measured

    def target(self, k: int) -> float:
        return forward_ms(self.target_ms, k)

    def round_ms(self, shape: TreeShape, extra: int = 0, ngram: bool = False) -> float:
        """One round of `shape` that also scores `extra` n-gram tokens (ngram: a chain was proposed)."""
        propose = self.ngram_ms if ngram else 0.0
        if shape.depth == 0 and extra == 0:  # no draft: one token per round, the head is not run at all
            return (self.plain_ms if self.plain_ms > 0 else self.target(1)) + propose
        if shape.depth == 0 and self.ngram_round_ms is not None:  # n-gram only, priced by its own timed rounds
            return self.target(extra + 1) + self.ngram_round_ms  # (the proposing is in the measured part)
        scored = shape.total_tokens + extra
        return self.model_ms(shape, extra) + self.overhead_ms + self.overhead_per_token_ms * scored + propose

    def row_ms(self, row: dict) -> float:
        """Mean ms per round of a replayed row: with n-gram branches, priced round by round by the
        tokens the chain added (a round pays for every token it scores)."""
        shape = TreeShape(**row["shape"])
        if not row.get("ngram_tokens"):
            return self.round_ms(shape)
        extra = {int(k): v for k, v in row["extra"].items()}
        return sum(v * self.round_ms(shape, k, ngram=True) for k, v in extra.items()) / max(sum(extra.values()), 1)

    def model_ms(self, shape: TreeShape, extra: int = 0) -> float:
        """The two models' share of a tree round: scoring total_tokens + extra + 1, drafting depth levels
        (none at depth 0: an n-gram-only round does not run the head)."""
        draft = 0.0
        if shape.depth > 0:
            level = self.level_ms.get(shape.topk) or max(self.level_ms.values())
            draft = self.first_level_ms + (shape.depth - 1) * level
        return self.target(shape.total_tokens + extra + 1) + draft


def _synchronize() -> None:
    """Wait for queued GPU work, so that a wall-clock interval holds what it times."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        _synchronize()
        start = time.perf_counter()
        fn()
        _synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


@torch.no_grad()
def measure_target_costs(target: Target, context: int, grid=K_GRID, backend: Backend | None = None,
                         reps: int = 5) -> dict[int, float]:
    """ms to score k tokens (a tree's forward and its logits) after `context` cached ones, through the
    backend the decoding loop uses. Eager: timed on `grid` (interpolated between by CostModel). A static
    backend pads k tokens to its bucket, so every size up to the largest bucket costs what its bucket
    costs (a 5-token tree what the 8-token bucket does, which no interpolation between 4 and 8 gives):
    each bucket is timed, `reps` times in turns with the others so a drift in the machine's speed falls
    on all alike, and its median given to every size it holds (timed size by size, neighbours in one
    bucket came out far apart on a drifting machine). Each timed call follows an untimed one of
    the same bucket, as a decoding loop calls one package round after round."""
    backend = backend or EagerBackend(target)
    largest = largest_tree(backend, max(grid))
    buckets = sorted(getattr(backend, "buckets", None) or [])
    sizes = buckets if buckets else [k for k in grid if k <= largest]
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, target.vocab_size, (context,), generator=g).to(target.device)
    scorer = backend.open(context, 16)
    scorer.prefill(prefix)

    def scoring(k: int):
        tokens = torch.randint(0, target.vocab_size, (k,), generator=g).to(target.device)
        mask = causal_mask(k, target.device)
        depths = torch.arange(k, device=target.device)

        def score():
            scorer.score(tokens, depths, mask)
            scorer.rewind()
        return score

    calls = {k: scoring(k) for k in sizes}
    for call in calls.values():
        call()  # warm-up (and, for a compiled backend, the bucket's compile)
    if not buckets:
        return {k: timed(call) for k, call in calls.items()}
    times: dict[int, list[float]] = {k: [] for k in sizes}
    for _ in range(reps):
        for k, call in calls.items():
            call()  # each bucket is its own package: the first call after another one pays for the switch
            times[k].append(timed(call, reps=1))
    per_bucket = {k: statistics.median(v) for k, v in times.items()}
    return {k: per_bucket[min(b for b in buckets if b >= k)] for k in range(1, largest + 1)}


def largest_tree(backend: Backend | None, default: int) -> int:
    """The most nodes a tree may have on this backend: its largest bucket for a static one."""
    buckets = getattr(backend, "buckets", None)
    return max(buckets) if buckets else default


@torch.no_grad()
def measure_draft_costs(drafter: EagleDrafter, target: Target, topks, context: int) -> tuple[float, dict[int, float]]:
    """-> (ms of a depth-1 draft: feeding a round's accepted pairs and the root's top-k, the median over
    topks; per k, ms per further tree level). Only draft() is timed: the committed prefix it starts
    from is fed beforehand, so its cost (which varies more than a level costs) never enters."""
    g = torch.Generator().manual_seed(1)
    sequence = torch.randint(0, target.vocab_size, (context,), generator=g).to(target.device)
    out = target.forward(sequence[None], layer_ids=drafter.feature_layers)
    feats = (out.layer_features if out.layer_features is not None else out.features)[0]  # [T, F]

    def draft(depth: int, k: int, reps: int = 5) -> float:
        times = []
        with drafter.tree_as(TreeShape(depth, k, k * depth)):
            for _ in range(reps + 1):  # the first is a warm-up (and, compiled, the graphs' first call)
                drafter.reset()
                drafter.feed(sequence[:-3], feats[: context - 4])  # a committed prefix, as mid-generation
                _synchronize()
                start = time.perf_counter()
                drafter.draft(sequence, feats[context - 4: context - 1], max_depth=depth)
                _synchronize()
                times.append(1000 * (time.perf_counter() - start))
        return statistics.median(times[1:])

    first, levels = [], {}
    try:
        for k in topks:
            one, three = draft(1, k), draft(3, k)
            levels[k] = max((three - one) / 2, 0.0)
            first.append(one)
    finally:
        drafter.reset()
    return statistics.median(first), levels


def timed_rounds(target: Target, drafter: EagleDrafter, prompts: list[list[int]], new_tokens: int,
                 shape: TreeShape, backend: Backend | None = None) -> float:
    """Median ms per round of greedy runs with `shape` (depth 0: the no-draft path)."""
    round_ms: list[float] = []
    with drafter.tree_as(shape):
        for ids in prompts:
            decoder = speculative_decode(target, drafter, torch.tensor(ids, device=target.device), SamplingParams(),
                                         Stopper(target.tokenizer, new_tokens, set()), backend=backend)
            stamps = [time.perf_counter() for _ in decoder]  # the prefill, then one chunk per round
            round_ms += [1000 * (b - a) for a, b in zip(stamps, stamps[1:])]
    return statistics.median(round_ms) if round_ms else 0.0


def timed_ngram_rounds(target: Target, drafter: EagleDrafter, prompts: list[list[int]], new_tokens: int,
                       ngram: NgramProposer, costs: CostModel, backend: Backend | None = None) -> float | None:
    """Median ms an n-gram-only round (no head run, the root plus a chain) costs beyond its target
    forward, target(tree size): proposing, verification, compaction, bookkeeping. None when no
    round of the calibration prompts found a chain."""
    sizes = TreeSizes()
    beyond: list[float] = []
    with drafter.tree_as(TreeShape(0, 0, 0), ngram):
        for ids in prompts:
            sizes.clear()
            decoder = speculative_decode(target, drafter, torch.tensor(ids, device=target.device), SamplingParams(),
                                         Stopper(target.tokenizer, new_tokens, set()), backend=backend, observer=sizes)
            stamps = [time.perf_counter() for _ in decoder]  # the prefill, then one chunk per round
            for size, (a, b) in zip(sizes, zip(stamps, stamps[1:])):
                if size > 1:  # a chain was merged
                    beyond.append(1000 * (b - a) - costs.target(size))
    return max(statistics.median(beyond), 0.0) if beyond else None


class TreeSizes(list):
    """A round observer: the size of every round's tree, in order."""

    def phase(self, name: str, seconds: float, result) -> None:
        if result is not None:
            self.append(result.tree.size)
