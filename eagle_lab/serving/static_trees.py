"""tree=auto's tree per batch size when the server decodes compiled (static rows).

Compiled, a forward of B rows costs about what one row costs up to a few tokens per row, then
grows with B x K, so the batch-1 tree (tree=auto's choice, priced with compiled costs) may stop
paying as the batch grows. At batch 2, 4, 8 (and max_batch) the batch-1 tree and plain decoding
each decode B calibration prompts together in the scheduler's own round on the static rows
(eagle_lab.serving.timed_batch); the faster wins, a tree only when it beats plain decoding by
`min_gain`. A batch size between two timed ones takes the choice of the next one up. The first
timing at each B compiles its graphs (minutes the first time; kept on disk), so the server says so.
"""

from __future__ import annotations

import logging

from eagle_lab.decoding.static_rows import StaticRows
from eagle_lab.draft import BatchTree, EagleDrafter, TreeShape
from eagle_lab.serving.timed_batch import timed_batch_decoding
from eagle_lab.serving.tree_per_batch import PROBE_BATCHES
from eagle_lab.target import Target

log = logging.getLogger(__name__)
PLAIN = BatchTree(TreeShape(0, 0, 0), 0)


def trees_on_rows(target: Target, drafter: EagleDrafter, rows: StaticRows, max_batch: int, prompts: list[list[int]],
                  new_tokens: int, min_gain: float = 1.0) -> dict[int, BatchTree]:
    """batch size 2..max_batch -> the batch-1 tree or plain decoding, whichever decoded faster."""
    if max_batch < 2:
        return {}
    own = BatchTree(drafter.shape, drafter.ngram.max_tokens if drafter.ngram is not None else None)
    sizes = sorted({b for b in PROBE_BATCHES if b < max_batch} | {max_batch})
    chosen = {}
    for batch in sizes:
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
        chosen[batch] = own if best == "tree" else PLAIN
    return {batch: chosen[next(b for b in sizes if b >= batch)] for batch in range(2, max_batch + 1)}
