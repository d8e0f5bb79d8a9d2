"""The scheduler thread: the only thread that runs the model (torch modules and caches are
not safe to drive from several threads at once).

HTTP handlers `submit` jobs into a bounded waiting list (full: `QueueFull`, the caller answers
429, so memory stays bounded) and receive events through the job's `deliver` callback, which
hands them to the handler's event loop (loop.call_soon_threadsafe). Continuous scheduling:
up to `max_batch` jobs are active; between rounds finished or cancelled jobs leave and
waiting jobs join, first come first served. A subclass writes the round: the server runs
BatchScheduler (batching.py), whose round scores all jobs' draft trees in one target forward.
Each job keeps its own cache row, drafter and torch.Generator, so its output does not depend on
who else is active.
`deliver` must not block or raise: the app's callback swallows a closed event loop.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle_lab.errors import EagleLabError

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More jobs are waiting than the scheduler may hold."""


class SchedulerStopped(Exception):
    """The scheduler no longer takes jobs (shutting down, or its thread died)."""


@dataclass
class Failed:
    """The job's last event when its stream raised: `status` 400 for a user error, else 500."""

    message: str
    status: int = 500


@dataclass(eq=False)
class Job:
    """One request. `start` runs on the scheduler thread and returns the job's event stream:
    one `next()` per round; the stream's end is the job's end."""

    start: Callable[[], Any]  # a Decoding for BatchScheduler
    deliver: Callable[[object], None]
    name: str = ""
    cancelled: threading.Event = field(default_factory=threading.Event)
    stream: Any = None  # set by the scheduler thread at admission: the event stream (BatchScheduler: a Decoding)
    done: bool = False  # finished, cancelled or failed: its slot is free


class ModelThread:
    """One daemon thread that runs every call given to it, in order: the thread that loads the model and then
    runs the scheduler's loop. Torch's CPU kernels run their parallel regions on an OpenMP team owned by the
    calling thread; a second thread running the model gets a second team, and with more OpenMP threads than
    cores the runtime stops spin-waiting between regions, so every operator pays a wake-up (a decoding
    step on a fresh thread takes far longer than on the loading thread)."""

    def __init__(self, name: str = "eagle-model"):
        self._calls: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on this thread; blocks until it returns, and returns its result (or raises its exception)."""
        return self.submit(fn, *args).result()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args))
        return future

    def _serve(self) -> None:
        while True:
            future, fn, args = self._calls.get()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who re-raises it
                future.set_exception(exc)


class Scheduler:
    def __init__(self, max_batch: int, max_queue: int, model_thread: ModelThread | None = None):
        """model_thread: the thread that loaded the model, where the loop is to run (None: a thread of its own)."""
        if max_batch < 1 or max_queue < 1:
            raise EagleLabError(f"the scheduler needs max_batch >= 1 and max_queue >= 1, got {max_batch}, {max_queue}")
        self.max_batch, self.max_queue = max_batch, max_queue
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()  # guarded by _cond
        self._active: list[Job] = []  # touched only by the scheduler thread
        self._active_count = 0  # a copy of len(_active) others may read
        self._stopping = False
        self.model_thread = model_thread
        self._started = False
        self._finished = threading.Event()  # set when the loop has ended
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0}

    # ---- called from HTTP handlers (any thread) ----

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping or (self._started and self._finished.is_set()):
                raise SchedulerStopped("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                self.counts["rejected"] += 1
                raise QueueFull(f"{len(self._waiting)} requests are already waiting (server.max_queue)")
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job if it still waits, else free its slot before the next round."""
        job.cancelled.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self.counts["cancelled"] += 1

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return self._active_count

    @property
    def alive(self) -> bool:
        return self._started and not self._finished.is_set()

    def start(self) -> None:
        """Run the loop in the background: on the model thread when given, else on a thread of its own."""
        self._started = True
        if self.model_thread is not None:
            self.model_thread.submit(self._run)
        else:
            threading.Thread(target=self._run, name="eagle-scheduler", daemon=True).start()

    def run(self) -> None:
        """Run the loop on the calling thread until stop() (called from another thread) and the work is done."""
        self._started = True
        self._run()

    def stop(self, timeout: float | None = None) -> None:
        """Finish the active and waiting jobs, then end the thread (the server stopped taking requests)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._started:
            self._finished.wait(timeout)

    # ---- the scheduler thread ----

    def _run(self) -> None:
        try:
            with torch.no_grad():  # grad mode is per thread
                while self._admit():
                    self._round(list(self._active))
                    self._active = [job for job in self._active if not job.done]
                    self._active_count = len(self._active)
        except Exception:
            log.exception("the scheduler thread died")  # a bug: /health turns 503, new requests get 503
            raise
        finally:
            self._abandon("the scheduler stopped")  # nobody may wait forever on a dead thread
            self._finished.set()

    def _abandon(self, message: str) -> None:
        with self._cond:
            left = [job for job in self._active + list(self._waiting) if not job.done]
            self._waiting.clear()
        for job in left:
            job.done = True
            try:
                job.deliver(Failed(message, 503))
            except Exception:  # noqa: BLE001 - one broken callback must not keep the others waiting
                log.exception("request %s: could not be told that the scheduler stopped", job.name)
        self._active, self._active_count = [], 0

    def _admit(self) -> bool:
        """Fill free slots from the waiting list; sleeps while there is nothing to do. False: stop."""
        with self._cond:
            while not self._active and not self._waiting:
                if self._stopping:
                    return False
                self._cond.wait()
            while self._waiting and len(self._active) < self.max_batch:
                self._active.append(self._waiting.popleft())
            self._active_count = len(self._active)
        return True

    def _round(self, jobs: list[Job]) -> None:
        """One round over the active jobs: each advances by one step, and finished ones are retired
        (BatchScheduler scores all their trees in one forward)."""
        raise NotImplementedError

    def _fail(self, job: Job, exc: Exception) -> None:
        """The job's stream raised: a user error found late (400), else a bug in this request (500)."""
        if isinstance(exc, EagleLabError):  # most user errors are checked before submit
            job.deliver(Failed(str(exc), 400))
        else:
            log.error("request %s failed", job.name, exc_info=exc)
            job.deliver(Failed(f"internal error: {type(exc).__name__}: {exc}", 500))
        self._retire(job, "failed")

    def _retire(self, job: Job, outcome: str) -> None:
        if job.stream is not None and hasattr(job.stream, "close"):
            job.stream.close()  # frees the generator's caches now, not at garbage collection
        job.stream, job.done = None, True
        with self._cond:
            self.counts[outcome] += 1
