"""A tree per batch size for the server (tree=auto): the tree shrinks as the batch grows.

tree=auto (eagle_lab/tree_search/auto.py) prices each candidate shape at batch 1 from measured
costs and the accept length replayed on recorded drafts. At batch B one round scores the B
trees in one padded forward and drafts the B trees with one head forward per level
(eagle_lab/serving/batch_draft.py), so per round

    tree round   E[target_B(padded K)] + s_B x draft(shape) + B x (overhead(shape) + proposing)
    plain round  target_B(1) + B x (per-row cost of a no-draft round besides its forward)

where target_B(K) is the measured cost of one forward of B rows of K tokens each after a
realistic cached prefix (a cheap probe at a few batch sizes, interpolated between them; it
includes a gather of the padded cache, which a kept batch pays only when its members change,
so the price is a little high), s_B is what batched drafting of B rows costs in single-row
drafts (probed the same way), and the draft and overhead terms are tree=auto's batch-1
measurements. With hybrid drafting each row's tree also holds its n-gram chain, whose length
varies round by round; the padded forward is as wide as the widest row, so it is priced at the
expected maximum of B rows drawn from the replayed distribution of chain tokens added, and
n-gram-only rows by their own timed round cost. The batch emits B x tau tokens per round, so
the best shape (and chain length) at B maximises tau / round_ms(B). A forward's cost grows with
B x K once the device is busy (a CPU always is): trees shrink as B grows, down to plain
decoding (depth 0, no chain) where none pays. Accept lengths do not depend on B, so the
replayed tau of every shape is reused as is.

The model then ranks; the loop decides. At batch 2, 4, 8 (and max_batch) the model's best few
trees and plain decoding run the server's batched round on calibration prompts
(eagle_lab/serving/timed_batch.py) and the fastest measured is used; a batch size between two
timed ones takes the choice of the next one up. On a 2-core CPU the model priced a one-token
draft at batch 8 at 68 tok/s; the round ran at 42 against plain decoding's 63 (per-row
verification and compaction on the padded cache cost more than batch 1's bookkeeping says).
Timings are cached in tree=auto's calibration file.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.growth import BatchTree, TreeShape
from eagle_lab.decoding.graph_store import source_digest
from eagle_lab.models.embedded import cache_root
from eagle_lab.drafters.ngram import NgramProposer
from eagle_lab.serving.batch import gather_caches, padded_mask
from eagle_lab.serving.batch_draft_bench import time_drafting
from eagle_lab.serving.timed_batch import timed_batch_decoding
from eagle_lab.models.target import Target
from eagle_lab.decoding.tree import build_tree
from eagle_lab.tree_search.auto import calibration, calibration_prompts, choose
from eagle_lab.tree_search.costs import CostModel, timed
from eagle_lab.tree_search.space import TreeSearchConfig
from eagle_lab.tree_search.validate import VALIDATE_TOP, measured_best, with_plain

log = logging.getLogger(__name__)
PROBE_BATCHES = (2, 4, 8)
PROBE_TOKENS = (1, 4, 8, 16, 32)  # K per row; beyond, costs are extrapolated linearly
# The batched round's code: a digest of these files is in the key of its cached timings, so a change
# that may move the round's cost has them taken again instead of reused.
ROUND_SOURCES = ("serving/batching.py", "serving/sequence.py", "serving/batch_draft.py", "serving/batch.py",
                 "serving/timed_batch.py", "decoding/static_rows.py", "decoding/round.py", "decoding/verify.py")


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
    """tree=auto's costs at `batch` rows: the padded forward from batch_target_ms (K per row -> ms),
    drafting from draft_scale (batched drafting of all rows costs that many single-row drafts;
    None: rows draft one after another, `batch` of them)."""

    batch: int = 1
    batch_target_ms: dict[int, float] = field(default_factory=dict)
    draft_scale: float | None = None

    def round_ms(self, shape: TreeShape, extra: int = 0, ngram: bool = False) -> float:
        """A round in which every row's tree holds `extra` chain tokens."""
        forward = interpolate(self.batch_target_ms, shape.total_tokens + extra + 1)
        return forward + self.drafting_ms(shape) + self.batch * self.per_row_ms(shape, extra, ngram)

    def row_ms(self, row: dict) -> float:
        """A replayed row at this batch size: the forward at the expected widest row, every row's
        own costs at their mean over the replayed rounds."""
        shape = TreeShape(**row["shape"])
        ngram = bool(row.get("ngram_tokens"))
        extra = {int(k): v for k, v in row["extra"].items()} if ngram else {0: 1}
        rounds = sum(extra.values())
        forward = expected_widest(self.batch_target_ms, extra, shape.total_tokens + 1, self.batch)
        per_row = sum(v * self.per_row_ms(shape, k, ngram) for k, v in extra.items()) / rounds
        return forward + self.drafting_ms(shape) + self.batch * per_row

    def drafting_ms(self, shape: TreeShape) -> float:
        if shape.depth == 0:
            return 0.0  # plain or n-gram only: the head is not run
        level = self.level_ms.get(shape.topk) or max(self.level_ms.values())
        one = self.first_level_ms + (shape.depth - 1) * level
        return one * (self.draft_scale if self.draft_scale is not None else self.batch)

    def per_row_ms(self, shape: TreeShape, extra: int, ngram: bool) -> float:
        """One row's cost besides the shared forward and drafting (bookkeeping, verification, proposing)."""
        propose = self.ngram_ms if ngram else 0.0
        if shape.depth == 0 and extra == 0:  # root alone: the no-draft round less its own forward
            return max((self.plain_ms or self.target(1)) - self.target(1), 0.0) + propose
        if shape.depth == 0 and self.ngram_round_ms is not None:  # n-gram only: its timed cost (proposing in it)
            return self.ngram_round_ms
        return self.overhead_ms + self.overhead_per_token_ms * (shape.total_tokens + extra) + propose


def expected_widest(table: dict[int, float], extra: dict[int, int], base: int, batch: int) -> float:
    """E[table(base + max of `batch` draws of the added tokens)], the draws from the histogram `extra`."""
    rounds = sum(extra.values())
    expected, below, previous = 0.0, 0, 0.0
    for added in sorted(extra):
        below += extra[added]
        at_most = (below / rounds) ** batch  # P(the widest row adds <= `added`)
        expected += (at_most - previous) * interpolate(table, base + added)
        previous = at_most
    return expected


def batch_forward_costs(probe: dict[int, dict[int, float]], batch: int) -> dict[int, float]:
    """K per row -> ms at `batch` rows, interpolated in the batch size between probed ones."""
    sizes = sorted(probe)
    return {k: interpolate({b: probe[b][k] for b in sizes}, batch) for k in probe[sizes[0]]}


@torch.no_grad()
def measure_batched_forward(target: Target, context: int, batches=PROBE_BATCHES, tokens=PROBE_TOKENS,
                            reps: int = 2) -> dict[int, dict[int, float]]:
    """batch -> {K per row -> ms}: one padded forward of `batch` chains of K tokens (the round's path)."""
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
                target.logits(out.features)  # (B, K, V), as tree_search/costs.py charges batch 1

            score()  # warm-up
            costs[batch][k] = timed(score, reps)
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


def probe_drafting(target: Target, drafter: EagleDrafter, context: int, max_batch: int,
                   reps: int = 2) -> dict[int, float]:
    """batch -> what batched drafting of that many rows costs, in single-row drafts (1.0 at batch 1),
    timed on tree=cpu's shape (measured once per target, head architecture, device and thread
    count; cached)."""
    batches = sorted({b for b in PROBE_BATCHES if b <= max_batch} | {max_batch})
    blob = json.dumps({"target": target.name, "device": str(target.device), "dtype": str(target.dtype),
                       "head": asdict(drafter.head.arch), "context": context, "batches": batches,
                       "threads": torch.get_num_threads()}, sort_keys=True, default=str)
    path = cache_root() / "tree_auto" / f"{target.name}-drafting-{hashlib.sha1(blob.encode()).hexdigest()[:16]}.json"
    if path.is_file():
        return {int(b): v for b, v in json.loads(path.read_text()).items()}
    log.info("tree per batch size: timing batched drafting at batch %s (once; cached in %s)", batches, path)
    reference = EagleDrafter(drafter.head, target, TreeShape(4, 4, 12))
    timed = time_drafting(target, reference, [1] + batches, past=min(context, 128), reps=reps)
    single = timed[1]["alone_ms"]
    scales = {1: 1.0, **{b: max(timed[b]["batched_ms"] / single, 1.0) for b in batches}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(scales, indent=1))
    return scales


def ranked_per_batch(shapes: list[dict], costs: CostModel, probed: dict[int, dict[int, float]], max_batch: int,
                     fixed: TreeShape, draft_scales: dict[int, float] | None = None) -> dict[int, list[dict]]:
    """batch size (2..max_batch) -> the replayed rows ranked by predicted per-row tokens/s (a row's
    "ngram_tokens" is its chain length when the shapes were replayed with chains).
    probed: batch -> {K per row -> ms}; batch 1 comes from costs.target_ms. draft_scales: batch ->
    batched drafting's cost in single-row drafts (None: rows draft one after another)."""
    table = {1: {k: costs.target(k) for k in next(iter(probed.values()))}, **probed}
    ranked = {}
    for batch in range(2, max_batch + 1):
        model = BatchCostModel(costs.target_ms, costs.level_ms, costs.first_level_ms, costs.overhead_ms,
                               costs.overhead_per_token_ms, costs.plain_ms, costs.ngram_ms, costs.ngram_round_ms,
                               batch=batch, batch_target_ms=batch_forward_costs(table, batch),
                               draft_scale=interpolate(draft_scales, batch) if draft_scales else None)
        ranked[batch] = choose(shapes, model, fixed)[1]
    return ranked


def choose_per_batch(shapes: list[dict], costs: CostModel, probed: dict[int, dict[int, float]], max_batch: int,
                     fixed: TreeShape, draft_scales: dict[int, float] | None = None
                     ) -> dict[int, tuple[TreeShape, dict]]:
    """batch size (2..max_batch) -> (the model's fastest shape, its ranked row); see ranked_per_batch."""
    return {batch: (TreeShape(**rows[0]["shape"]), rows[0])
            for batch, rows in ranked_per_batch(shapes, costs, probed, max_batch, fixed, draft_scales).items()}


def batch_tree(row: dict, hybrid: bool) -> BatchTree:
    return BatchTree(TreeShape(**row["shape"]), int(row.get("ngram_tokens", 0)) if hybrid else None)


def validate_per_batch(target: Target, drafter: EagleDrafter, ranked: dict[int, list[dict]], fixed: TreeShape,
                       hybrid: bool, prompts: list[list[int]], new_tokens: int) -> dict[int, list[dict]]:
    """At each probed batch size B, the model's best VALIDATE_TOP rows and plain decoding (when
    the fixed fields allow it) decode B calibration prompts together in the scheduler's round
    (eagle_lab.serving.timed_batch), one after the other in an order rotated from one B to the
    next; -> B -> the rows sorted by measured tokens/s (all B rows together)."""
    sizes = sorted({b for b in PROBE_BATCHES if b < max(ranked)} | {max(ranked)})
    measured = {}
    for turn, batch in enumerate(sizes):
        rows = with_plain(ranked[batch][:VALIDATE_TOP], fixed)
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        for index in [(turn + i) % len(rows) for i in range(len(rows))]:
            timing = timed_batch_decoding(target, drafter, batch_prompts, batch_tree(rows[index], hybrid), new_tokens)
            seconds = max(timing["seconds"], 1e-9)
            rows[index].update(measured_tokens_per_s=timing["tokens"] / seconds,
                               measured_tau=timing["tokens"] / max(timing["rounds"] * batch, 1))
        measured[batch] = sorted(rows, key=lambda r: -r["measured_tokens_per_s"])
    return measured


def measured_choice(measured: dict[int, list[dict]], max_batch: int, min_gain: float = 1.0) -> dict[int, dict]:
    """batch size 2..max_batch -> the row to use: a timed size its fastest row (plain decoding
    unless a tree beats it by min_gain: validate.measured_best), any other size the choice of the
    next timed size up (the smaller tree: trees shrink as the batch grows)."""
    sizes = sorted(measured)
    return {batch: measured_best(measured[next(b for b in sizes if b >= batch)], min_gain)
            for batch in range(2, max_batch + 1)}


def trees_per_batch(target: Target, drafter: EagleDrafter, fixed: TreeShape, max_batch: int,
                    search: TreeSearchConfig | None = None, ngram: NgramProposer | None = None,
                    prompts: list[list[int]] | None = None, min_gain: float = 1.0) -> dict[int, BatchTree]:
    """After auto_tree: the tree for each batch size 2..max_batch (batch 1 keeps the drafter's).
    ngram: the proposer tree=auto calibrated with (hybrid drafting; auto_tree may have shortened
    the drafter's, or removed it). While the drafter keeps a proposer, each batch size also gets
    its chain length (0: none); without one, chains are not searched. prompts: what the trees are
    timed on (default: tree=auto's calibration prompts). min_gain: a tree must beat plain decoding's
    measured tokens/s by this factor at its batch size (validate.measured_best)."""
    if max_batch < 2:
        return {}
    search = search or TreeSearchConfig()
    chosen_ngram = drafter.ngram
    with drafter.tree_as(ngram=ngram):  # the calibration tree=auto made (and cached)
        summary, costs, path = calibration(target, drafter, fixed, prompts, search=search)
    with drafter.tree_as(ngram=None):  # drafting is timed without chains, as calibration times it
        scales = probe_drafting(target, drafter, search.context, max_batch)
    hybrid = chosen_ngram is not None
    shapes = [row for row in summary["shapes"] if hybrid or not row.get("ngram_tokens")]
    ranked = ranked_per_batch(shapes, costs, probe(target, search.context, max_batch), max_batch, fixed, scales)
    key = f"d{fixed.depth}-k{fixed.topk}-n{fixed.total_tokens}-b{max_batch}-{'hybrid' if hybrid else 'head'}" \
          f"-t{torch.get_num_threads()}-s{source_digest(ROUND_SOURCES)}"
    done = summary.setdefault("validated_batch", {})
    if key not in done:
        log.info("tree per batch size: timing the best trees and plain decoding in batched rounds (once; cached "
                 "in %s)", path)
        measured = validate_per_batch(target, drafter, ranked, fixed, hybrid, prompts or calibration_prompts(target),
                                      search.new_tokens)
        done[key] = {str(b): rows for b, rows in measured.items()}
        path.write_text(json.dumps(summary, indent=2))
    measured = {int(b): rows for b, rows in done[key].items()}
    for batch, rows in measured.items():
        log.info("tree per batch size: timed at batch %d: %s", batch, ", ".join(
            f"{describe(r, hybrid)} {r['measured_tokens_per_s']:.1f} tok/s (model {batch * r['tokens_per_s']:.1f})"
            if "tokens_per_s" in r else f"{describe(r, hybrid)} {r['measured_tokens_per_s']:.1f} tok/s" for r in rows))
    log.info("tree per batch size: 1: depth=%d topk=%d total_tokens=%d%s (tree=auto)", drafter.shape.depth,
             drafter.shape.topk, drafter.shape.total_tokens,
             f" + n-gram chains of {chosen_ngram.max_tokens}" if hybrid else "")
    trees = {}
    for batch, row in measured_choice(measured, max_batch, min_gain).items():
        log.info("tree per batch size: %d: %s, tau %.2f", batch, describe(row, hybrid),
                 row.get("measured_tau", row["tau"]))
        trees[batch] = batch_tree(row, hybrid)
    return trees


def describe(row: dict, hybrid: bool) -> str:
    shape, chain = TreeShape(**row["shape"]), int(row.get("ngram_tokens", 0)) if hybrid else 0
    if shape.depth == 0 and not chain:
        return "plain decoding (no draft)"
    head = "no head" if shape.depth == 0 else f"depth={shape.depth} topk={shape.topk} total_tokens={shape.total_tokens}"
    return head + (f" + n-gram chains of {chain}" if chain else "")
