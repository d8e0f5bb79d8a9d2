"""tree=auto's tree per batch size when the server decodes compiled (static rows).

Compiled, a forward of B rows costs about what one row costs up to a few tokens per row, then
grows with B x K, so the batch-1 tree (tree=auto's choice, priced with compiled costs) may stop
paying as the batch grows. At batch 2, 4, 8 (and max_batch) the batch-1 tree and plain decoding
each decode B calibration prompts together in the scheduler's own round on the static rows
(eagle_lab.serving.timed_batch); the faster wins, a tree only when it beats plain decoding by
`min_gain`. A batch size between two timed ones takes the choice of the next one up. The first
timing at each B compiles its graphs (minutes the first time; kept on disk), so the server says so.
The choices are cached beside tree=auto's calibration, keyed by what the timings depend on (tree=auto's
fingerprint, the tree, the batch sizes, the batched round's code), so a restart reuses them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from eagle_lab.decoding.graph_store import source_digest
from eagle_lab.decoding.static_rows import StaticRows
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.growth import BatchTree, TreeShape
from eagle_lab.models.embedded import cache_root
from eagle_lab.serving.timed_batch import timed_batch_decoding
from eagle_lab.serving.tree_per_batch import PROBE_BATCHES, ROUND_SOURCES
from eagle_lab.models.target import Target
from eagle_lab.tree_search.auto import calibration_fingerprint
from eagle_lab.tree_search.space import TreeSearchConfig

log = logging.getLogger(__name__)
PLAIN = BatchTree(TreeShape(0, 0, 0), 0)


def trees_on_rows(target: Target, drafter: EagleDrafter, rows: StaticRows, max_batch: int, prompts: list[list[int]],
                  new_tokens: int, min_gain: float = 1.0) -> dict[int, BatchTree]:
    """batch size 2..max_batch -> the batch-1 tree or plain decoding, whichever decoded faster."""
    if max_batch < 2:
        return {}
    own = _drafter_tree(drafter)
    sizes = sorted({b for b in PROBE_BATCHES if b < max_batch} | {max_batch})
    path = _choice_path(target, drafter, rows, own, sizes, new_tokens, min_gain)
    if path.is_file():
        names = {int(b): name for b, name in json.loads(path.read_text()).items()}
        log.info("tree per batch size (compiled, cached in %s): %s", path,
                 ", ".join(f"batch {b}: {name}" for b, name in sorted(names.items())))
    else:
        names = {batch: _timed_choice(target, drafter, rows, own, batch, prompts, new_tokens, min_gain)
                 for batch in sizes}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(names, indent=1))
    return {batch: own if names[next(b for b in sizes if b >= batch)] == "tree" else PLAIN
            for batch in range(2, max_batch + 1)}


def _timed_choice(target: Target, drafter: EagleDrafter, rows: StaticRows, own: BatchTree, batch: int,
                  prompts: list[list[int]], new_tokens: int, min_gain: float) -> str:
    """'tree' or 'plain': which decoded `batch` calibration prompts together faster on `rows`."""
    batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
    speed, tau = {}, {}
    for name, tree in (("tree", own), ("plain", PLAIN)):
        timed_batch_decoding(target, drafter, batch_prompts, tree, 4, rows)  # warm-up: compiles its graphs
        timing = timed_batch_decoding(target, drafter, batch_prompts, tree, new_tokens, rows)
        speed[name] = timing["tokens"] / max(timing["seconds"], 1e-9)
        tau[name] = timing["tokens"] / max(timing["rounds"] * batch, 1)
    best = "tree" if speed["tree"] >= min_gain * speed["plain"] else "plain"
    log.info("tree per batch size (compiled): batch %d: tree %.1f tok/s (tau %.2f), plain %.1f tok/s; chose %s",
             batch, speed["tree"], tau["tree"], speed["plain"], best)
    return best


def _drafter_tree(drafter: EagleDrafter) -> BatchTree:
    """The drafter's own tree (its shape and n-gram chain) as a batch's tree."""
    return BatchTree(drafter.shape, drafter.ngram.max_tokens if drafter.ngram is not None else None)


def build_row_graphs(target: Target, drafter: EagleDrafter | None, rows: StaticRows, prompt: list[int]) -> None:
    """Before a server listens: run every row count's plain step and its tree's step once on `rows`, so that
    each compiles (or loads) for every attended length now (the backend's compile_ahead) and no request
    waits for a compile. Graphs already on disk load in milliseconds. drafter None: a plain-decoding server."""
    trees = [PLAIN] if drafter is None else [PLAIN, _drafter_tree(drafter)]
    counts = rows.buckets
    prompt = prompt[:max(1, rows.context // 2)]  # room for the steps' tokens
    for index, count in enumerate(counts, 1):
        log.info("server graphs [%d/%d]: %d row(s), plain%s step at every attended length", index, len(counts),
                 count, "" if drafter is None else " and tree")
        for tree in trees:
            timed_batch_decoding(target, drafter, [prompt] * count, tree, 2, rows)


def _choice_path(target: Target, drafter: EagleDrafter, rows: StaticRows, own: BatchTree, sizes: list[int],
                 new_tokens: int, min_gain: float) -> Path:
    fields = {"calibration": calibration_fingerprint(target, drafter, TreeSearchConfig(), drafter.ngram, rows.backend),
              "tree": [own.shape.depth, own.shape.topk, own.shape.total_tokens, own.ngram_tokens], "sizes": sizes,
              "rows": [len(rows.rows), rows.capacity], "new_tokens": new_tokens, "min_gain": min_gain,
              "round": source_digest(ROUND_SOURCES)}
    blob = json.dumps(fields, sort_keys=True, default=str)
    return cache_root() / "tree_auto" / f"{target.name}-rows-{hashlib.sha1(blob.encode()).hexdigest()[:16]}.json"
