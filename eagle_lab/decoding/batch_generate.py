"""Offline batched generation: many prompts decoded on the rows of one static cache.

Continuous batching: a prompt takes a row as soon as one is free, and a sequence leaves its row
the round it ends, so no row computes past its sequence's end (a batched Hugging Face `generate`
keeps finished rows in the batch until the longest one ends, and its DynamicCache copies the
whole cache every step). A round is the backend's step over one token per row; compiled, one graph
per (row count, attended length). `row_counts` fixes the row counts a round may run at: one
count means one graph per length, at the price of empty rows while the last prompts drain.

Each prompt samples with its own generator, seeded with its own seed, so a sampled reply does not
depend on which prompts shared its rounds.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from eagle_lab.decoding.sampling import SamplingParams, next_token
from eagle_lab.decoding.static_rows import Row, StaticRows
from eagle_lab.decoding.tree import root_only_tree
from eagle_lab.errors import EagleLabError


@contextlib.contextmanager
def grouped_query_sdpa() -> Iterator[None]:
    """Hugging Face's SDPA attention with grouped-query heads read in place (`enable_gqa`) even under a
    mask. By default it copies each key/value head to every query head it serves first, which on CPU
    makes attention over many rows and positions several times slower. Same result up to the kernels' rounding."""
    name = "TRANSFORMERS_SDPA_FORCE_GQA"
    before = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@dataclass
class Reply:
    token_ids: list[int]  # the generated tokens, without the eos that ended them
    finished: bool  # ended with an eos token (not at max_new_tokens or the context)
    # keep_features: [F, H] top features of every token the target read (the prompt, then each generated
    # token fed back; a reply cut at its limit never feeds its last token: F = prompt + tokens - 1)
    features: torch.Tensor | None = None


@dataclass
class _Active:
    index: int  # the prompt's position in the input
    row: Row
    limit: int  # most tokens it may generate
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)  # keep_features: [n, H] pieces


@torch.no_grad()
def generate_on_rows(rows: StaticRows, prompts: list[list[int]], params: SamplingParams, max_new_tokens: int,
                     eos_ids: set[int], seeds: list[int] | None = None,
                     on_reply: Callable[[int, Reply], None] | None = None, keep_features: bool = False) -> list[Reply]:
    """prompts: token ids, each decoded on its own (plain decoding, batched) -> one Reply per prompt, in order.

    A prompt with no room under `rows.context` gets an empty, unfinished reply. on_reply(index, reply)
    is called as each one ends (progress, partial saving). keep_features: each Reply also carries the
    top features its forwards computed (what a separate capture pass over the same tokens would)."""
    seeds = list(range(len(prompts))) if seeds is None else seeds
    if len(seeds) != len(prompts):
        raise EagleLabError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    target = rows.target
    device = target.device
    replies: list[Reply | None] = [None] * len(prompts)
    pending = deque(range(len(prompts)))
    active: list[_Active] = []

    def answer(index: int, reply: Reply) -> None:
        replies[index] = reply
        if on_reply is not None:
            on_reply(index, reply)

    def end(slot: _Active, finished: bool) -> None:
        rows.detach(slot.row)
        features = torch.cat(slot.features).cpu() if keep_features else None
        answer(slot.index, Reply(slot.tokens, finished, features))

    def push(slot: _Active, logits: torch.Tensor) -> bool:
        """Sample the next token from [V] logits; -> whether the sequence goes on."""
        token = next_token(logits, params, slot.generator)
        if token in eos_ids:
            end(slot, finished=True)
            return False
        slot.tokens.append(token)
        if len(slot.tokens) >= slot.limit:
            end(slot, finished=False)
            return False
        return True

    while pending or active:
        while pending and len(active) < len(rows.rows):
            index = pending.popleft()
            prompt = prompts[index]
            limit = min(max_new_tokens, rows.context - len(prompt))
            if not prompt or limit < 1:
                answer(index, Reply([], False))
                continue
            slot = _Active(index, rows.attach(), limit, torch.Generator(device=device).manual_seed(seeds[index]))
            hidden, _ = rows.prefill(slot.row, torch.tensor(prompt, device=device))  # [T, H]
            if keep_features:
                slot.features.append(hidden)
            if push(slot, target.logits(hidden[-1])):
                active.append(slot)
        if not active:
            continue
        trees = [root_only_tree(slot.tokens[-1], device) for slot in active]
        scores = rows.score([slot.row for slot in active], trees)
        rows.keep_roots([slot.row for slot in active], scores[0].scored_at)
        still = []
        for slot, score in zip(active, scores):
            if keep_features:
                slot.features.append(score.features[:1])  # [1, H]: the token fed this round
            if push(slot, score.logits[0]):
                still.append(slot)
        active = still
    return replies  # every prompt was answered above
