"""The batched round: one target forward scores the draft trees of every active sequence.

A round, on the scheduler thread, over the active jobs (continuous batching: jobs join and
leave between rounds, Scheduler._admit):
  1. cancelled jobs leave (their caches are freed);
  2. jobs admitted since the last round run their prefill alone (prompts differ in length, and
     a prefill is already a wide forward) and send their first token;
  3. every other job drafts its tree, using the tree chosen for this round's batch size
     (`trees`, from eagle_lab.serving.tree_per_batch; none: the drafter's own tree): at batch >= 2 the jobs
     sharing a head draft together, one head forward per tree level (eagle_lab.serving.batch_draft,
     its padded head cache kept while the same sequences share it); at batch 1, or with
     batched_drafting=False, each job with its own drafter, exactly as generate.py;
  4. one forward scores all trees: compiled decoding (`rows`), one fixed-shape step over the
     sequences' rows of a shared static cache (eagle_lab.decoding.static_rows), at batch 1 too;
     eager, a padded forward over gathered dynamic caches (eagle_lab.serving.batch; the padded
     cache is kept while the same sequences share the forward), or at batch 1 the sequence's
     own forward, exactly as generate.py runs it;
  5. each job verifies its tree with its own rule and generator, the jobs' walks in lockstep so
     that one LM-head call per step serves them all (eagle_lab.decoding.verify.verify_rows; batch 1
     walks alone, as generate.py; the static step has already computed every node's logits, so
     the walks only read them), compacts its cache, and sends its tokens; finished jobs leave.
A failure in one job's own steps fails that job alone; a failing batched forward (or batched
draft) fails the jobs in it (500) and the others go on.
"""

from __future__ import annotations

import logging

from eagle_lab.drafters.growth import TreeShape
from eagle_lab.serving.batch import PaddedBatch
from eagle_lab.serving.batch_draft import BatchDrafter
from eagle_lab.decoding.static_rows import StaticRows
from eagle_lab.serving.scheduler import Job, Scheduler
from eagle_lab.serving.sequence import score_rows
from eagle_lab.models.target import Target
from eagle_lab.decoding.verify import verify_rows

log = logging.getLogger(__name__)


class BatchScheduler(Scheduler):
    """Jobs' `start` must return an eagle_lab.serving.engine.Decoding."""

    def __init__(self, max_batch: int, max_queue: int, target: Target, trees: dict[int, TreeShape] | None = None,
                 batched_drafting: bool = True, rows: StaticRows | None = None):
        """rows: the static path's shared cache (the engine's sequences live in it); None: padded dynamic caches."""
        super().__init__(max_batch, max_queue)
        self.rows = rows
        self.target = target
        self.trees = trees or {}  # batch size -> tree (empty: every drafter keeps its own tree)
        self.batch_sizes: dict[int, int] = {}  # batch size -> rounds scored at that size (for /health, bench)
        self.batch = PaddedBatch(target)  # the padded cache, kept while the same sequences share the forward
        self.drafting = BatchDrafter() if batched_drafting else None  # the padded head caches, likewise

    def _round(self, jobs: list[Job]) -> None:
        ready = []
        for job in jobs:
            if job.cancelled.is_set():
                self._retire(job, "cancelled")
            elif job.stream is None:
                self._step(job, lambda job=job: self._prefill(job))
            else:
                ready.append(job)
        shape = self.trees.get(len(ready)) if len(ready) > 1 else None
        if self.drafting is not None and len(ready) > 1:
            errors = self.drafting.draft([job.stream.sequence for job in ready], shape)
            for job, exc in zip(ready, errors):
                if exc is not None:
                    self._fail(job, exc)
            drafted = [job for job, exc in zip(ready, errors) if exc is None]
        else:
            if self.drafting is not None:
                self.drafting.release()  # a lone sequence drafts on its own head cache
            drafted = [job for job in ready if self._step(job, lambda job=job: job.stream.sequence.draft(shape))]
        if len(drafted) < 2 and self.rows is None:
            self.batch.release()  # a lone sequence (or none) runs on its own cache
        if not drafted:
            return
        sequences = [job.stream.sequence for job in drafted]
        try:
            if self.rows is not None:
                scored = score_rows(self.rows, sequences)
            else:
                scored = [sequences[0].score_alone()] if len(drafted) == 1 else self.batch.score(sequences)
        except Exception as exc:  # noqa: BLE001 - a failed forward fails its jobs, not the server
            self.batch.drop()  # its cache may be half-updated; every member is in this forward
            for job in drafted:
                self._fail(job, exc)
            return
        self.batch_sizes[len(drafted)] = self.batch_sizes.get(len(drafted), 0) + 1
        if len(drafted) == 1:
            verdicts: list = [None]  # batch 1: accept() walks its tree itself, exactly as generate.py
        elif self.rows is not None:  # the forward computed every node's logits: the walks only read them
            verdicts = verify_rows([(job.stream.sequence.verification(), row.logits)
                                    for job, row in zip(drafted, scored)], lambda rows: rows)
        else:  # every row's verification in lockstep: one LM-head call per step for all rows
            verdicts = verify_rows([(job.stream.sequence.verification(), row.features)
                                    for job, row in zip(drafted, scored)], self.target.logits)
        for job, row, verdict in zip(drafted, scored, verdicts):
            if isinstance(verdict, Exception):
                self._fail(job, verdict)
            else:
                self._step(job, lambda job=job, row=row, verdict=verdict:
                           self._send(job, job.stream.accept(row, verdict)))

    def _prefill(self, job: Job) -> None:
        job.stream = job.start()
        self._send(job, job.stream.prefill())

    def _send(self, job: Job, events: list) -> None:
        for event in events:
            job.deliver(event)
        if job.stream.sequence.done:
            self._retire(job, "completed")

    def _step(self, job: Job, fn) -> bool:
        """Run one of the job's own steps; False (and the job failed) when it raised."""
        try:
            fn()
            return True
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
            self._fail(job, exc)
            return False
