"""Stop a training run cleanly on SIGTERM or SIGINT (Ctrl-C, a cluster's pre-emption, a job's time
limit): the step in progress finishes, a checkpoint is written, the head is exported, and the run
ends without its held-out evaluation (minutes on a large held-out set); `trainer.resume=true`
continues exactly where it stopped. A second signal stops at once.

With several ranks, one rank may get the signal a step before the others: every rank asks
`requested()` after each step, and a MAX all-reduce makes them stop at the same step, so their
collectives (the checkpoint's barrier) stay in step."""

from __future__ import annotations

import logging
import signal
import threading

import torch

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    def __init__(self, world: int = 1, device: torch.device | None = None):
        self.world, self.device = world, device or torch.device("cpu")
        self.received: str | None = None  # the signal's name, once one arrived on this rank
        self._previous: dict[int, object] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # Python delivers signals there only
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:  # the second one: stop now
            self._restore()
            raise KeyboardInterrupt(f"{name} received twice")
        self.received = name
        log.warning("%s: finishing this step, then a checkpoint and exit (send it again to stop at once)", name)

    def requested(self) -> bool:
        """Whether any rank received a signal (a collective when world > 1: every rank must call it)."""
        flag = self.received is not None
        if self.world > 1:
            value = torch.tensor([float(flag)], device=self.device)
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
            flag = bool(value.item())
        return flag
