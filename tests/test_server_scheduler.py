"""The scheduler (no HTTP, no model: fake event streams) and per-sequence drafters (tiny target,
random head): interleaving rounds of several sequences leaves each exactly as it is alone."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from eagle_lab.decoding.generate import Stopper, speculative_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.drafters.ngram import NgramDrafter, NgramProposer
from eagle_lab.errors import EagleLabError
from eagle_lab.models.prompts import as_tensor, encode_prompt
from eagle_lab.serving.engine import drafter_factory
from eagle_lab.serving.scheduler import Failed, Job, QueueFull, Scheduler

# ---------------------------------------------------------------- scheduler, fake streams

class StreamScheduler(Scheduler):
    """The scheduler's queueing and admission, its round advancing each job's plain iterator by one event."""

    def _round(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.cancelled.is_set():
                self._retire(job, "cancelled")
                continue
            try:
                if job.stream is None:
                    job.stream = job.start()
                job.deliver(next(job.stream))
            except StopIteration:
                self._retire(job, "completed")
            except Exception as exc:  # noqa: BLE001 - the scheduler's own rule: one job's failure is its own
                self._fail(job, exc)


class Recorder:
    """Collects a job's events (deliver runs on the scheduler thread)."""

    def __init__(self):
        self.events: list = []
        self.ended = threading.Event()

    def deliver(self, event) -> None:
        self.events.append(event)


def counting_stream(name: str, rounds: int, log: list, gate: threading.Event | None = None, fail_at: int = -1):
    def start():
        for step in range(rounds):
            if gate is not None:
                gate.wait(10)
            if step == fail_at:
                raise ValueError("boom")
            log.append((name, step))
            yield (name, step)
    return start


def make_job(name: str, rounds: int, log: list, **kwargs) -> tuple[Job, Recorder]:
    recorder = Recorder()
    return Job(start=counting_stream(name, rounds, log, **kwargs), deliver=recorder.deliver, name=name), recorder


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_rounds_interleave_and_jobs_join_between_rounds():
    scheduler, log = StreamScheduler(max_batch=2, max_queue=8), []
    jobs = [make_job(name, rounds, log) for name, rounds in (("a", 3), ("b", 5), ("c", 2))]
    for job, _ in jobs:
        scheduler.submit(job)
    scheduler.start()
    scheduler.stop(timeout=10)  # drains: every job ends
    assert [r.events for _, r in jobs] == [[("a", i) for i in range(3)], [("b", i) for i in range(5)],
                                           [("c", i) for i in range(2)]]
    # a and b alternate; c takes a's slot once a is done, and never runs while both others are active
    assert log[:6] == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert log.index(("c", 0)) > log.index(("a", 2))
    assert scheduler.counts["completed"] == 3 and scheduler.active == 0


def test_waiting_list_is_bounded_and_cancel_frees_slots():
    gate, log = threading.Event(), []
    scheduler = StreamScheduler(max_batch=1, max_queue=2)
    scheduler.start()
    running, _ = make_job("running", 1000, log, gate=gate)
    scheduler.submit(running)
    wait_for(lambda: scheduler.active == 1)
    waiting = [make_job(f"w{i}", 1, log)[0] for i in range(2)]
    for job in waiting:
        scheduler.submit(job)
    with pytest.raises(QueueFull):
        scheduler.submit(make_job("over", 1, log)[0])
    assert scheduler.counts["rejected"] == 1 and scheduler.waiting == 2
    scheduler.cancel(waiting[0])  # leaves the waiting list at once
    assert scheduler.waiting == 1
    scheduler.cancel(running)  # its slot is freed before its next round
    gate.set()
    wait_for(lambda: waiting[1].done)
    assert ("w0", 0) not in log and ("w1", 0) in log
    assert sum(1 for name, _ in log if name == "running") <= 1  # at most the round already under way
    assert scheduler.counts["cancelled"] == 2
    scheduler.stop(timeout=10)
    assert not scheduler.alive


def test_a_failing_job_fails_alone():
    scheduler, log = StreamScheduler(max_batch=4, max_queue=4), []
    bad, bad_events = make_job("bad", 5, log, fail_at=2)
    good, good_events = make_job("good", 5, log)
    scheduler.submit(bad)
    scheduler.submit(good)
    scheduler.start()
    scheduler.stop(timeout=10)
    assert isinstance(bad_events.events[-1], Failed) and bad_events.events[-1].status == 500
    assert "boom" in bad_events.events[-1].message
    assert good_events.events == [("good", i) for i in range(5)]
    assert scheduler.counts == {"completed": 1, "cancelled": 0, "failed": 1, "rejected": 0}


def test_scheduler_refuses_bad_limits():
    with pytest.raises(EagleLabError):
        StreamScheduler(max_batch=0, max_queue=1)
    with pytest.raises(EagleLabError):
        StreamScheduler(max_batch=1, max_queue=0)


# ---------------------------------------------------------------- one drafter per sequence

class RecordingDrafter:
    """Wraps a drafter and records every tree it drafts (tokens, parents)."""

    def __init__(self, inner):
        self.inner, self.trees = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reset(self) -> None:
        self.inner.reset()

    def draft(self, sequence, new_features, max_depth, sampling=None):
        tree = self.inner.draft(sequence, new_features, max_depth)
        self.trees.append((tree.tokens.tolist(), tree.parents.tolist()))
        return tree


PROMPTS = ["Hello there", "Tell me a story about a dragon.", "1 2 3 4"]
MAX_TOKENS = (40, 25, 33)


def decoders(target, drafters, params, seed: int = 7):
    out = []
    for prompt, max_tokens, drafter in zip(PROMPTS, MAX_TOKENS, drafters):
        ids = as_tensor(encode_prompt(target.tokenizer, prompt, chat=True), target.device)
        stopper = Stopper(target.tokenizer, max_tokens, set())  # no eos: full length, more rounds
        out.append(speculative_decode(target, drafter, ids, params, stopper, torch.Generator().manual_seed(seed)))
    return out


def run_interleaved(gens) -> list[list[int]]:
    """Round robin, one round of one sequence at a time, as the scheduler does."""
    tokens, live = [[] for _ in gens], set(range(len(gens)))
    while live:
        for i in sorted(live):
            try:
                tokens[i].extend(next(gens[i]))
            except StopIteration:
                live.discard(i)
    return tokens


def run_alone(gen) -> list[int]:
    return run_interleaved([gen])[0]


@pytest.fixture(scope="module")
def prototype(tiny_llama) -> EagleDrafter:
    # a random head and a fixed tree of depth 3: every round drafts multi-token trees
    return EagleDrafter(new_head(tiny_llama, seed=0), tiny_llama, TreeShape(depth=3, topk=2, total_tokens=6))


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0)], ids=["greedy", "sampled"])
def test_forked_drafters_keep_interleaved_sequences_as_alone(tiny_llama, prototype, params):
    solo_drafters = [RecordingDrafter(prototype.fork()) for _ in PROMPTS]
    solo = [run_alone(gen) for gen in decoders(tiny_llama, solo_drafters, params)]
    mixed_drafters = [RecordingDrafter(prototype.fork()) for _ in PROMPTS]
    mixed = run_interleaved(decoders(tiny_llama, mixed_drafters, params))
    assert mixed == solo
    assert [len(t) for t in solo] == list(MAX_TOKENS)
    for alone, together in zip(solo_drafters, mixed_drafters):
        assert together.trees == alone.trees  # the same drafts round by round: no state leaked across
    assert max(len(tokens) for trees in (d.trees for d in solo_drafters) for tokens, _ in trees) == 7  # root + 6


def test_one_shared_drafter_would_corrupt_interleaved_sequences(tiny_llama, prototype):
    """The hazard the forks remove (and proof the test above can fail): one drafter whose head
    cache is fed by several interleaved sequences drafts differently than it does alone (or breaks)."""
    params = SamplingParams(temperature=1.0)
    solo_drafters = [RecordingDrafter(prototype.fork()) for _ in PROMPTS]
    for gen in decoders(tiny_llama, solo_drafters, params):
        run_alone(gen)
    shared = RecordingDrafter(prototype.fork())
    run_interleaved(decoders(tiny_llama, [shared] * len(PROMPTS), params))
    solo_trees = [tree for d in solo_drafters for tree in d.trees]
    assert sorted(shared.trees) != sorted(solo_trees)


def test_forks_share_weights_not_state(prototype):
    a, b = prototype.fork(), prototype.fork()
    assert a.head is b.head is prototype.head and a.lm_weight is prototype.lm_weight and a.shape is prototype.shape
    assert a.cache is not b.cache and a.cache is not prototype.cache


def test_drafter_factory_per_method(prototype):
    assert drafter_factory(None)() is None
    eagle = drafter_factory(prototype)
    assert eagle() is not eagle() and isinstance(eagle(), EagleDrafter)
    ngram = drafter_factory(NgramDrafter(NgramProposer()))
    assert isinstance(ngram(), NgramDrafter) and ngram() is not ngram()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_scheduler_thread_fails_every_waiting_job():
    """A bug that kills the thread (here: a deliver that raises) must not leave requests waiting forever."""
    from eagle_lab.serving.scheduler import SchedulerStopped

    scheduler, log = StreamScheduler(max_batch=1, max_queue=4), []

    def broken_deliver(event):
        raise ValueError("a broken callback")

    broken = Job(start=counting_stream("broken", 3, log), deliver=broken_deliver, name="broken")
    waiting, waiting_events = make_job("waiting", 3, log)
    scheduler.submit(broken)
    scheduler.submit(waiting)
    scheduler.start()
    wait_for(lambda: not scheduler.alive)
    assert len(waiting_events.events) == 1 and waiting_events.events[0].status == 503
    with pytest.raises(SchedulerStopped):
        scheduler.submit(make_job("late", 1, log)[0])
