"""The server's tree policy: (batch size, temperature) -> drafting or plain decoding for a row.

At batch 1 a row drafts its drafter's own tree (under tree=online, the chain its controller chooses each round). A
forward of B rows costs about what one row costs up to a few tokens per row, then grows with B x K, so drafting may
stop paying as the batch grows. At batch 2, 4, 8 (and max_batch) and at each temperature requests are expected at,
drafting (each row its own tree or controller) and plain decoding each decode B calibration prompts together in the
scheduler's own round on the static rows (eagle_lab.decoding.sequence.batch_round), sampled rows with seeded generators,
twice, the second run timed; drafting is kept only where it beats plain decoding by `min_gain`. A batch size
between two timed ones takes the choice of the next one up; a request's temperature takes the nearest one timed.
Compiled, the first timing at each B compiles its graphs (minutes the first time; kept on disk). The choices are
cached, keyed by what the timings depend on (the round's timing fingerprint, the tree, the batch sizes, the static
rows, the batched round's code), so a restart reuses them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle_lab.builders import make_generator
from eagle_lab.decoding.graph_store import code_digest
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.decoding.sequence import Sequence, Stopper, batch_round
from eagle_lab.decoding.static_rows import StaticRows
from eagle_lab.drafters.eagle.batch import BatchDrafter
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.models.device import timed_call
from eagle_lab.models.embedded import cache_root
from eagle_lab.models.target import Target
from eagle_lab.tree_search.costs import timing_fingerprint

log = logging.getLogger(__name__)
PROBE_BATCHES = (2, 4, 8)
# The batched round's code: a digest of these files is in the key of the cached choices, so a change
# that may move the round's cost has them timed again instead of reused.
ROUND_SOURCES = ("serving/batching.py", "decoding/sequence.py", "drafters/eagle/batch.py", "serving/batch_trees.py",
                 "decoding/static_rows.py", "decoding/verify.py", "decoding/compiled.py",
                 "decoding/graph_store.py", "drafters/eagle/head_runner.py", "models/kernels/stable_linear.cpp",
                 "models/kernels/stable_attention.cpp")


@dataclass(frozen=True)
class BatchTrees:
    """The choices: for each timed temperature, the batch sizes >= 2 at which rows decode without drafts.
    No temperatures: every row drafts its own tree at every batch size."""

    plain_at: dict[float, frozenset[int]] = field(default_factory=dict)

    @classmethod
    def own(cls) -> BatchTrees:
        return cls()

    def plain(self, batch: int, params: SamplingParams) -> bool:
        """Whether a row with these sampling parameters decodes plainly in a round of `batch` rows (else it drafts
        its own tree)."""
        if batch < 2 or not self.plain_at:
            return False
        temperature = 0.0 if params.greedy else params.temperature
        nearest = min(self.plain_at, key=lambda t: abs(t - temperature))
        return batch in self.plain_at[nearest]


def choose_batch_trees(target: Target, drafter: EagleDrafter, rows: StaticRows, max_batch: int,
                       prompts: list[list[int]], new_tokens: int, min_gain: float = 1.0,
                       temperatures: tuple[float, ...] = (0.0,)) -> BatchTrees:
    """Time drafting against plain decoding at each probed batch size and temperature (see the module doc)."""
    if max_batch < 2:
        return BatchTrees.own()
    sizes = sorted({b for b in PROBE_BATCHES if b < max_batch} | {max_batch})
    temperatures = sorted(set(temperatures))
    path = _choice_path(target, drafter, rows, sizes, new_tokens, min_gain)
    if path.is_file():
        names = {float(t): {int(b): name for b, name in by_batch.items()}
                 for t, by_batch in json.loads(path.read_text()).items()}
        log.info("tree per batch size (cached in %s): %s", path, _summary(names))
    else:
        names = {t: _timed_choices(target, drafter, rows, sizes, t, prompts, new_tokens, min_gain)
                 for t in temperatures}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({str(t): by_batch for t, by_batch in names.items()}, indent=1))
    return BatchTrees({t: frozenset(batch for batch in range(2, max_batch + 1)
                                    if by_batch[next(b for b in sizes if b >= batch)] == "plain")
                       for t, by_batch in names.items()})


def _timed_choices(target: Target, drafter: EagleDrafter, rows: StaticRows, sizes: list[int], temperature: float,
                   prompts: list[list[int]], new_tokens: int, min_gain: float) -> dict[int, str]:
    """batch size -> 'tree' or 'plain' at this temperature."""
    params = SamplingParams(temperature)
    choices = {}
    for batch in sizes:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        speed, tau = {}, {}
        for name, plain in (("tree", False), ("plain", True)):
            # the same run twice, timing the second: the first meets every shape the second will (the same
            # prompts, seeds and trees), so a graph built or loaded on first use is never inside the timing
            timed_batch_decoding(target, drafter, batch_prompts, plain, new_tokens, rows, params)
            timing = timed_batch_decoding(target, drafter, batch_prompts, plain, new_tokens, rows, params)
            speed[name] = timing["tokens"] / max(timing["seconds"], 1e-9)
            tau[name] = timing["tokens"] / max(timing["rounds"] * batch, 1)
        choices[batch] = "tree" if speed["tree"] >= min_gain * speed["plain"] else "plain"
        log.info("tree per batch size: T=%g, batch %d: own tree %.1f tok/s (tau %.2f), plain %.1f tok/s; chose %s",
                 temperature, batch, speed["tree"], tau["tree"], speed["plain"], choices[batch])
    return choices


def _summary(names: dict[float, dict[int, str]]) -> str:
    return "; ".join(f"T={t:g}: " + ", ".join(f"batch {b} {name}" for b, name in sorted(by_batch.items()))
                     for t, by_batch in sorted(names.items()))


def _choice_path(target: Target, drafter: EagleDrafter, rows: StaticRows, sizes: list[int], new_tokens: int,
                 min_gain: float) -> Path:
    own = [drafter.shape.depth, drafter.shape.topk, drafter.shape.total_tokens,
           drafter.ngram.max_tokens if drafter.ngram is not None else None, drafter.controller is not None]
    fields = {"timing": timing_fingerprint(target, drafter, drafter.ngram, rows.backend), "tree": own, "sizes": sizes,
              "rows": [len(rows.rows), rows.capacity, rows.backend.name],
              "new_tokens": new_tokens, "min_gain": min_gain, "round": code_digest(ROUND_SOURCES)}
    blob = json.dumps(fields, sort_keys=True, default=str)
    return cache_root() / "tree_online" / f"{target.name}-rows-{hashlib.sha1(blob.encode()).hexdigest()[:16]}.json"


@torch.no_grad()
def timed_batch_decoding(target: Target, prototype: EagleDrafter | None, prompts: list[list[int]],
                         plain: bool, new_tokens: int, rows: StaticRows,
                         params: SamplingParams = SamplingParams(), seed: int = 0) -> dict:
    """Decoding of len(prompts) sequences in one batch on `rows`, in the server's round (batch_round, batched
    drafting), every round plainly (plain=True) or with each drafter's own tree (under a controller, its chain),
    until the first sequence has `new_tokens` (so the batch size never changes; eos is ignored). Prefills are not
    timed. -> {"tokens", "rounds", "seconds"} summed over the batch's rounds, and "outputs": each sequence's
    tokens (sampled rows draw from generators seeded seed, seed + 1, ...). prototype None: plain decoding."""
    sequences = [Sequence(target, prototype.fork() if prototype is not None else None,
                          torch.tensor(ids, device=target.device), params, Stopper(target.tokenizer, new_tokens, set()),
                          None if params.greedy else make_generator(seed + index, target.device), rows=rows,
                          plain=prototype is None)
                 for index, ids in enumerate(prompts)]
    for sequence in sequences:
        sequence.prefill()
    drafting = BatchDrafter()

    def decode() -> tuple[int, int]:
        tokens = rounds = 0
        while not any(s.done for s in sequences):
            for result in batch_round(rows, sequences, [plain] * len(sequences), drafting):
                if isinstance(result, Exception):
                    raise result
                tokens += len(result)
            rounds += 1
        return tokens, rounds

    try:
        (tokens, rounds), seconds = timed_call(decode, target.device)
    finally:
        drafting.release()
        for sequence in sequences:
            if not sequence.done:
                sequence.finish("timed")  # gives its row back
    return {"tokens": tokens, "rounds": rounds, "seconds": seconds,
            "outputs": [list(s.stopper.generated) for s in sequences]}


def build_row_graphs(target: Target, drafter: EagleDrafter | None, rows: StaticRows, prompt: list[int],
                     temperatures: tuple[float, ...] = (0.0,)) -> None:
    """Before a server listens: run every row count's plain step, and the step of each temperature's tree, once
    on `rows`, so that each compiles (or loads) for every attended length now (the backend's compile_ahead)
    and no request waits for a compile. Graphs already on disk load in milliseconds. drafter None: a
    plain-decoding server. temperatures: those requests may ask."""
    temperatures = [] if drafter is None else sorted(temperatures)
    counts = rows.buckets
    prompt = prompt[:max(1, rows.context // 2)]  # room for the steps' tokens
    for index, count in enumerate(counts, 1):
        log.info("server graphs [%d/%d]: %d row(s), plain%s step", index, len(counts),
                 count, "" if drafter is None else " and tree")
        timed_batch_decoding(target, drafter, [prompt] * count, True, 2, rows)  # the drafter's feature layers
        for temperature in temperatures:
            timed_batch_decoding(target, drafter, [prompt] * count, False, 2, rows, SamplingParams(temperature))
