"""A tree per batch size for the server (tree=auto): the tree shrinks as the batch grows.

tree=auto (eagle_lab/tree_auto.py) prices each candidate shape at batch 1 from measured
costs and the accept length replayed on recorded drafts. At batch B one round scores the B
trees in one padded forward and runs B drafters one after another (each sequence's head has
its own cache), so per round

    tree round   target_B(total_tokens + 1) + B x (draft(shape) + overhead(shape))
    plain round  target_B(1) + B x (per-row cost of a no-draft round besides its forward)

where target_B(K) is the measured cost of one forward of B rows of K tokens each after a
realistic cached prefix (a cheap probe at a few batch sizes, interpolated between them; it
includes a gather of the padded cache, which a kept batch pays only when its members change,
so the price is a little high), and the draft and overhead terms are tree=auto's
batch-1 measurements. The batch emits B x tau tokens per round, so the best shape at B
maximises tau / round_ms(B). A forward's cost grows with B x K once the device is busy (a
CPU always is), while the B drafters and overheads add up: trees shrink as B grows, down to
plain decoding (depth 0) where no tree pays. Accept lengths do not depend on B, so the
replayed tau of every shape is reused as is. Shapes are searched without n-gram branches:
with hybrid drafting on, every batch size keeps the batch-1 choice.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle_lab.draft import EagleDrafter, TreeShape
from eagle_lab.embedded import cache_root
from eagle_lab.target import Target
from eagle_lab.tree import build_tree
from eagle_lab.tree_auto import CostModel, TreeSearchConfig, _timed, calibration, choose

log = logging.getLogger(__name__)
PROBE_BATCHES = (2, 4, 8)
PROBE_TOKENS = (1, 4, 8, 16, 32)  # K per row; beyond, costs are extrapolated linearly


def interpolate(table: dict[int, float], x: float) -> float:
    """Piecewise-linear in x through the table's points, extrapolated linearly past its ends."""
    keys = sorted(table)
    if len(keys) == 1:
        return table[keys[0]]
    if x <= keys[0]:
        lo, hi = keys[0], keys[1]
    elif x >= keys[-1]:
        lo, hi = keys[-2], keys[-1]
    else:
        lo, hi = next((a, b) for a, b in zip(keys, keys[1:]) if a <= x <= b)
    value = table[lo] + (x - lo) * (table[hi] - table[lo]) / (hi - lo)
    return max(value, 0.0)


@dataclass(kw_only=True)  # batch fields by name: CostModel may grow fields
class BatchCostModel(CostModel):
    """tree=auto's costs, with the forward priced for `batch` rows (batch_target_ms: K per row -> ms)."""

    batch: int = 1
    batch_target_ms: dict[int, float] = field(default_factory=dict)

    def round_ms(self, shape: TreeShape, extra: int = 0, ngram: bool = False) -> float:
        if extra or ngram:
            raise ValueError("trees per batch size are searched without n-gram branches")
        if shape.depth == 0:  # plain decoding: the measured no-draft round less its own forward, per row
            per_row = max((self.plain_ms or self.target(1)) - self.target(1), 0.0)
            return interpolate(self.batch_target_ms, 1) + self.batch * per_row
        level = self.level_ms.get(shape.topk) or max(self.level_ms.values())
        draft = self.first_level_ms + (shape.depth - 1) * level
        per_row = draft + self.overhead_ms + self.overhead_per_token_ms * shape.total_tokens
        return interpolate(self.batch_target_ms, shape.total_tokens + 1) + self.batch * per_row


def batch_forward_costs(probe: dict[int, dict[int, float]], batch: int) -> dict[int, float]:
    """K per row -> ms at `batch` rows, interpolated in the batch size between probed ones."""
    sizes = sorted(probe)
    return {k: interpolate({b: probe[b][k] for b in sizes}, batch) for k in probe[sizes[0]]}


@torch.no_grad()
def measure_batched_forward(target: Target, context: int, batches=PROBE_BATCHES, tokens=PROBE_TOKENS,
                            reps: int = 2) -> dict[int, dict[int, float]]:
    """batch -> {K per row -> ms}: one padded forward of `batch` chains of K tokens (the round's path)."""
    from eagle_lab.serving.batch import gather_caches, padded_mask

    g = torch.Generator().manual_seed(0)
    cache = target.new_cache()
    target.forward(torch.randint(0, target.vocab_size, (1, context), generator=g).to(target.device), cache)
    costs: dict[int, dict[int, float]] = {}
    for batch in batches:
        costs[batch] = {}
        for k in tokens:
            ids = torch.randint(0, target.vocab_size, (batch, k), generator=g).to(target.device)  # (B, K)
            chain = build_tree(ids[0], torch.arange(-1, k - 1, device=target.device))
            mask = padded_mask([context] * batch, [chain] * batch, target.dtype, target.device)  # (B, 1, K, C + K)
            positions = (context + chain.depths).expand(batch, k)  # (B, K)

            def score():
                batched = gather_caches(target, [cache] * batch, context)
                out = target.forward(ids, batched, positions, attention_mask=mask)
                target.logits(out.features)  # (B, K, V), as tree_auto charges batch 1

            score()  # warm-up
            costs[batch][k] = _timed(score, reps)
    return costs


def _probe_path(target: Target, context: int, batches, tokens) -> Path:
    blob = json.dumps({"target": target.name, "device": str(target.device), "dtype": str(target.dtype),
                       "context": context, "batches": list(batches), "tokens": list(tokens),
                       "threads": torch.get_num_threads()}, sort_keys=True)
    return cache_root() / "tree_auto" / f"{target.name}-batch-{hashlib.sha1(blob.encode()).hexdigest()[:16]}.json"


def probe(target: Target, context: int, max_batch: int) -> dict[int, dict[int, float]]:
    """The batched forward costs (measured once per target, device and thread count; cached)."""
    batches = sorted({b for b in PROBE_BATCHES if b <= max_batch} | {max_batch})
    path = _probe_path(target, context, batches, PROBE_TOKENS)
    if path.is_file():
        return {int(b): {int(k): v for k, v in row.items()} for b, row in json.loads(path.read_text()).items()}
    log.info("tree per batch size: timing batched forwards at batch %s on %s (once; cached in %s)", batches,
             target.device, path)
    costs = measure_batched_forward(target, context, batches)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(costs, indent=1))
    return costs


def choose_per_batch(shapes: list[dict], costs: CostModel, probed: dict[int, dict[int, float]], max_batch: int,
                     fixed: TreeShape) -> dict[int, tuple[TreeShape, dict]]:
    """batch size (2..max_batch) -> (fastest shape, its ranked row with predicted per-row tokens/s).
    probed: batch -> {K per row -> ms}; batch 1 comes from costs.target_ms."""
    table = {1: {k: costs.target(k) for k in next(iter(probed.values()))}, **probed}
    rows = [row for row in shapes if not row.get("ngram_tokens")]
    chosen = {}
    for batch in range(2, max_batch + 1):
        model = BatchCostModel(costs.target_ms, costs.level_ms, costs.first_level_ms, costs.overhead_ms,
                               costs.overhead_per_token_ms, costs.plain_ms, batch=batch,
                               batch_target_ms=batch_forward_costs(table, batch))
        shape, ranked = choose(rows, model, fixed)
        chosen[batch] = (shape, ranked[0])
    return chosen


def trees_per_batch(target: Target, drafter: EagleDrafter, fixed: TreeShape, max_batch: int,
                    search: TreeSearchConfig | None = None) -> dict[int, TreeShape]:
    """After auto_tree: the tree for each batch size 2..max_batch (batch 1 keeps the drafter's)."""
    if max_batch < 2:
        return {}
    if drafter.ngram is not None:
        log.info("tree per batch size: hybrid drafting is on; every batch size keeps %s", drafter.shape)
        return {}
    search = search or TreeSearchConfig()
    summary, costs, _ = calibration(target, drafter, fixed, search=search)
    chosen = choose_per_batch(summary["shapes"], costs, probe(target, search.context, max_batch), max_batch, fixed)
    log.info("tree per batch size: 1: depth=%d topk=%d total_tokens=%d (tree=auto)", drafter.shape.depth,
             drafter.shape.topk, drafter.shape.total_tokens)
    for batch, (shape, row) in chosen.items():
        log.info("tree per batch size: %d: %s, predicted tau %.2f, %.1f tok/s in all", batch,
                 "plain decoding (no draft)" if shape.depth == 0 else
                 f"depth={shape.depth} topk={shape.topk} total_tokens={shape.total_tokens}",
                 row["tau"], batch * row["tokens_per_s"])
    return {batch: shape for batch, (shape, _) in chosen.items()}
