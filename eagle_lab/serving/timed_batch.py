"""Time the server's batched round in place: B sequences decoding together, no HTTP, no threads.

eagle_lab.serving.tree_per_batch prices each tree at batch B from parts measured one by one (a padded
forward, batched drafting, batch-1 bookkeeping per row). The round the scheduler really runs
has costs those parts miss (per-row verification and compaction on the padded cache, Python
per row), so the model's choice at B is checked here: the B sequences run the scheduler's
steps (eagle_lab.serving.batching) for each candidate tree and the measured tokens/s decide.
"""

from __future__ import annotations

import time

import torch

from eagle_lab.decoding.static_rows import StaticRows
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.growth import BatchTree
from eagle_lab.decoding.generate import Stopper
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.serving.batch import PaddedBatch
from eagle_lab.serving.batch_draft import BatchDrafter
from eagle_lab.serving.drafters import fork_eagle
from eagle_lab.serving.sequence import Sequence, score_rows
from eagle_lab.models.target import Target
from eagle_lab.decoding.verify import verify_rows


@torch.no_grad()
def timed_batch_decoding(target: Target, prototype: EagleDrafter | None, prompts: list[list[int]], tree: BatchTree,
                         new_tokens: int, rows: StaticRows | None = None) -> dict:
    """Greedy decoding of len(prompts) sequences in one batch, every round with `tree`, until the
    first sequence has `new_tokens` (so the batch size never changes; eos is ignored). Prefills
    are not timed. -> {"tokens", "rounds", "seconds"} summed over the batch's rounds, and "outputs": each
    sequence's tokens (greedy, so a tree changes how fast they come, never which).
    rows: the static path's shared cache (compiled decoding), as the scheduler would use it.
    prototype None: plain decoding (`tree` is then PLAIN)."""
    sequences = [Sequence(target, fork_eagle(prototype) if prototype is not None else None, torch.tensor(ids, device=target.device), SamplingParams(),
                          Stopper(target.tokenizer, new_tokens, set()), None, rows=rows) for ids in prompts]
    for sequence in sequences:
        sequence.prefill()
    drafting, batch = BatchDrafter(), PaddedBatch(target)
    tokens = rounds = 0
    start = time.perf_counter()
    try:
        while not any(s.done for s in sequences):
            errors = drafting.draft(sequences, tree)
            failed = next((exc for exc in errors if exc is not None), None)
            if failed is not None:
                raise failed
            if rows is not None:  # every node's logits come with the forward
                scored = score_rows(rows, sequences)
                verdicts = verify_rows([(s.verification(), row.logits) for s, row in zip(sequences, scored)],
                                       lambda logits: logits)
            else:
                scored = batch.score(sequences)
                verdicts = verify_rows([(s.verification(), row.features) for s, row in zip(sequences, scored)],
                                       target.logits)
            for sequence, row, verdict in zip(sequences, scored, verdicts):
                if isinstance(verdict, Exception):
                    raise verdict
                tokens += len(sequence.accept(row, verdict))
            rounds += 1
    finally:
        drafting.release()
        batch.drop()
        for sequence in sequences:
            if not sequence.done:
                sequence.finish("timed")  # gives its static row back
    return {"tokens": tokens, "rounds": rounds, "seconds": time.perf_counter() - start,
            "outputs": [list(s.stopper.generated) for s in sequences]}
