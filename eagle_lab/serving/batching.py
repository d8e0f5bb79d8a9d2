"""The batched round: one target forward scores the draft trees of every active sequence.

A round, on the scheduler thread, over the active jobs (continuous batching: jobs join and
leave between rounds, Scheduler._admit):
  1. cancelled jobs leave (their rows are freed);
  2. jobs admitted since the last round run their prefill alone (prompts differ in length, and
     a prefill is already a wide forward) and send their first token;
  3. every other job drafts its tree: at batch 1 the drafter's own (under tree=online the chain its
     controller chooses), at batch B >= 2 what the tree policy says for B and the request's temperature
     (eagle_lab.serving.batch_trees: the own tree or plain decoding). Jobs sharing a head draft
     together, one head forward per tree level (eagle_lab.drafters.eagle.batch);
  4. one forward of the static rows scores all trees (eagle_lab.decoding.sequence.batch_round: every
     sequence decodes in a row of one static cache, compiled or eager), every node's logits from
     one LM-head matmul;
  5. each job verifies its tree with its own rule and generator, keeps its accepted entries and
     sends its tokens; finished jobs leave.
A failure in one job's own steps fails that job alone; a failing batched forward (or batched
draft) fails the jobs in it (500) and the others go on.
"""

from __future__ import annotations

import logging

from eagle_lab.decoding.sequence import batch_round
from eagle_lab.decoding.static_rows import StaticRows
from eagle_lab.drafters.eagle.batch import BatchDrafter
from eagle_lab.models.target import Target
from eagle_lab.serving.batch_trees import BatchTrees
from eagle_lab.serving.scheduler import Job, ModelThread, Scheduler

log = logging.getLogger(__name__)


class BatchScheduler(Scheduler):
    """Jobs' `start` must return an eagle_lab.serving.engine.Decoding whose sequence lives in `rows`."""

    def __init__(self, max_batch: int, max_queue: int, target: Target, rows: StaticRows,
                 trees: BatchTrees | None = None, batched_drafting: bool = True,
                 model_thread: ModelThread | None = None):
        """trees: the tree policy at batch >= 2 (None: every sequence drafts its own tree at every batch size).
        model_thread: the thread that loaded the target, where the loop runs (scheduler.ModelThread)."""
        super().__init__(max_batch, max_queue, model_thread)
        self.rows, self.target = rows, target
        self.trees = trees or BatchTrees.own()
        self.batch_sizes: dict[int, int] = {}  # batch size -> rounds scored at that size (for /health, bench)
        self.drafting = BatchDrafter() if batched_drafting else None  # the padded head caches, kept between rounds

    def _round(self, jobs: list[Job]) -> None:
        ready = []
        for job in jobs:
            if job.cancelled.is_set():
                self._retire(job, "cancelled")
            elif job.stream is None:
                self._step(job, lambda job=job: self._prefill(job))
            else:
                ready.append(job)
        if not ready:
            return
        plain = [self.trees.plain(len(ready), job.stream.sequence.params) for job in ready]
        results = batch_round(self.rows, [job.stream.sequence for job in ready], plain, self.drafting)
        scored = sum(not isinstance(result, Exception) for result in results)
        if scored:
            self.batch_sizes[scored] = self.batch_sizes.get(scored, 0) + 1
        for job, result in zip(ready, results):
            if isinstance(result, Exception):
                self._fail(job, result)
            else:
                self._step(job, lambda job=job, tokens=result: self._send(job, job.stream.emitted(tokens)))

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
