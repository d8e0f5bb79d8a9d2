"""Time the server's batched round in place: B sequences decoding together, no HTTP, no threads.

The tree policy (eagle_lab.serving.batch_trees) decides between drafting and plain decoding at each
batch size by running the scheduler's own steps (eagle_lab.serving.batching) on calibration prompts:
batched drafting, one forward of the static rows, each row's verification and commit.
"""

from __future__ import annotations

import logging
import time

import torch

from eagle_lab.builders import make_generator
from eagle_lab.decoding.generate import Stopper
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.decoding.static_rows import StaticRows
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.models.target import Target
from eagle_lab.serving.batch_draft import BatchDrafter
from eagle_lab.serving.sequence import Sequence, score_rows

log = logging.getLogger(__name__)


@torch.no_grad()
def timed_batch_decoding(target: Target, prototype: EagleDrafter | None, prompts: list[list[int]],
                         plain: bool, new_tokens: int, rows: StaticRows,
                         params: SamplingParams = SamplingParams(), seed: int = 0) -> dict:
    """Decoding of len(prompts) sequences in one batch on `rows`, every round plainly (plain=True) or with each
    drafter's own tree (under a controller, its chain), until the first sequence has `new_tokens` (so the batch
    size never changes; eos is ignored). Prefills are not timed. -> {"tokens", "rounds", "seconds"} summed
    over the batch's rounds, and "outputs": each sequence's tokens (sampled rows draw from generators seeded
    seed, seed + 1, ...). prototype None: plain decoding."""
    sequences = []
    for index, ids in enumerate(prompts):
        drafter = prototype.fork() if prototype is not None else None
        generator = None if params.greedy else make_generator(seed + index, target.device)
        sequences.append(Sequence(target, drafter, torch.tensor(ids, device=target.device), params,
                                  Stopper(target.tokenizer, new_tokens, set()), generator, rows))
    for sequence in sequences:
        sequence.prefill()
    drafting = BatchDrafter()
    tokens = rounds = 0
    start = time.perf_counter()
    try:
        while not any(s.done for s in sequences):
            errors = drafting.draft(sequences, [plain] * len(sequences))
            failed = next((exc for exc in errors if exc is not None), None)
            if failed is not None:
                raise failed
            for sequence, row in zip(sequences, score_rows(rows, sequences)):
                tokens += len(sequence.accept(row))
            rounds += 1
    finally:
        drafting.release()
        for sequence in sequences:
            if not sequence.done:
                sequence.finish("timed")  # gives its row back
    return {"tokens": tokens, "rounds": rounds, "seconds": time.perf_counter() - start,
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
