"""Scheduler-level helpers shared by the batching tests: a client that collects one job's
events, request plans, a request's output run alone, and running a batch of requests to the end."""

from __future__ import annotations

import threading

import torch

from eagle_lab.decoding.backend import StaticBackend
from eagle_lab.decoding.generate import Stopper, generate, speculative_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.decoding.static_rows import StaticRows
from eagle_lab.models.prompts import as_tensor, encode_prompt
from eagle_lab.serving.engine import Engine, Finished, Plan
from eagle_lab.serving.scheduler import Job, Scheduler


def static_rows(target, rows=4, context=256, compiled=False) -> StaticRows:
    """The rows a server's sequences decode in (eager unless compiled), small enough for tiny targets."""
    return StaticRows(StaticBackend(target, [4, 8, 16], cache_block=64, compiled=compiled), rows, context)


class Client:
    """One job's events, collected on the scheduler thread."""

    def __init__(self, engine: Engine, plan: Plan, name: str, cancel_after: int = 0):
        self.events, self.finished, self.decoding = [], threading.Event(), None
        self.cancel_after = cancel_after

        def start():
            self.decoding = engine.start(plan, name)
            return self.decoding

        self.job = Job(start=start, deliver=self.deliver, name=name)

    def deliver(self, event) -> None:
        self.events.append(event)
        if self.cancel_after and len(self.events) == self.cancel_after:
            self.job.cancelled.set()  # what the app does when the client goes away
        if isinstance(event, Finished) or not hasattr(event, "token_ids"):
            self.finished.set()

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events if not isinstance(e, Finished) for t in e.token_ids]


def plan(engine: Engine, prompt: str, max_tokens: int, temperature: float = 0.0, seed: int = 0) -> Plan:
    return Plan(encode_prompt(engine.target.tokenizer, prompt, chat=False), SamplingParams(temperature), max_tokens,
                [], True, seed)


def expected_alone(engine: Engine, p: Plan) -> list[int]:
    stopper = Stopper(engine.target.tokenizer, p.max_tokens, set())
    decoder = speculative_decode(engine.target, engine.new_drafter(), as_tensor(p.prompt_ids, engine.target.device),
                                 p.params, stopper, torch.Generator().manual_seed(p.seed))
    return generate(decoder).token_ids


def run_all(scheduler: Scheduler, clients: list[Client], timeout: float = 120) -> list[Client]:
    """Submit every client's job, run the scheduler until all are done, stop it."""
    for client in clients:
        scheduler.submit(client.job)
    scheduler.start()
    scheduler.stop(timeout=timeout)
    return clients


def run_plans(scheduler: Scheduler, engine: Engine, plans: list[Plan]) -> list[Client]:
    """One client per plan (named r0, r1, ...), run to the end."""
    return run_all(scheduler, [Client(engine, p, f"r{i}") for i, p in enumerate(plans)])
