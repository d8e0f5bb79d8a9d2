"""Decoding prompts, every way through one loop (eagle_lab.decoding.sequence.Sequence).

vanilla_decode and speculative_decode decode one prompt: generators that yield each chunk of accepted tokens as
soon as it is known and return the sequence's GenerationStats; generate() drains one into a GenerationResult.
decode_prompts decodes many prompts plainly on the rows of one static cache (regeneration). Stopping (eos, stop
strings, max_new_tokens, context limit) lives in the sequence's Stopper.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from eagle_lab.decoding.backend import Backend, EagerBackend
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.decoding.sequence import (
    GenerationStats,
    RoundObserver,
    Sequence,
    Stopper,
    check_prompt,
    feature_layers,
    score_rows,
)
from eagle_lab.decoding.static_rows import StaticRows
from eagle_lab.decoding.tree import Drafter
from eagle_lab.errors import EagleLabError
from eagle_lab.models.target import Target


@dataclass
class GenerationResult:
    token_ids: list[int]
    stats: GenerationStats


def _decode(target: Target, drafter: Drafter | None, prompt_ids: torch.Tensor, params: SamplingParams,
            stopper: Stopper, generator: torch.Generator | None, backend: Backend | None,
            observer: RoundObserver | None = None) -> Generator[list[int], None, GenerationStats]:
    check_prompt(target, prompt_ids)
    scorer = (backend or EagerBackend(target)).open(prompt_ids.numel(), stopper.max_new_tokens,
                                                    feature_layers(drafter))
    sequence = Sequence(target, drafter, prompt_ids, params, stopper, generator, plain=drafter is None,
                        scorer=scorer)
    yield sequence.prefill()
    while not sequence.done:
        yield sequence.step(observer)
    return sequence.stats


def vanilla_decode(
    target: Target, prompt_ids: torch.Tensor, params: SamplingParams, stopper: Stopper,
    generator: torch.Generator | None = None, backend: Backend | None = None,
) -> Generator[list[int], None, GenerationStats]:
    """Plain decoding: one target forward per token. prompt_ids: [T]. backend: eager when None."""
    return (yield from _decode(target, None, prompt_ids, params, stopper, generator, backend))


def speculative_decode(
    target: Target, drafter: Drafter, prompt_ids: torch.Tensor, params: SamplingParams, stopper: Stopper,
    generator: torch.Generator | None = None, backend: Backend | None = None,
    observer: RoundObserver | None = None,
) -> Generator[list[int], None, GenerationStats]:
    """Draft a tree, score it in one target forward, keep the accepted path. prompt_ids: [T]."""
    return (yield from _decode(target, drafter, prompt_ids, params, stopper, generator, backend, observer))


def generate(decoder: Generator[list[int], None, GenerationStats]) -> GenerationResult:
    """Drain a decoding generator (non-streaming use)."""
    tokens: list[int] = []
    while True:
        try:
            tokens.extend(next(decoder))
        except StopIteration as done:
            return GenerationResult(token_ids=tokens, stats=done.value)


@dataclass
class Reply:
    token_ids: list[int]  # the generated tokens, without the eos that ended them
    finished: bool  # ended with an eos token (not at max_new_tokens or the context)
    # keep_features: [F, H] top features of every token the target read (the prompt, then each generated
    # token fed back; a reply cut at its limit never feeds its last token: F = prompt + tokens - 1)
    features: torch.Tensor | None = None


@torch.no_grad()
def decode_prompts(rows: StaticRows, prompts: list[list[int]], params: SamplingParams, max_new_tokens: int,
                   eos_ids: set[int], seeds: list[int] | None = None,
                   on_reply: Callable[[int, Reply], None] | None = None, keep_features: bool = False) -> list[Reply]:
    """prompts: token ids, each decoded on its own (plain decoding, batched) -> one Reply per prompt, in order.

    Continuous batching: a prompt takes a row as soon as one is free and leaves it the round it ends, so no row
    computes past its sequence's end. Each prompt samples with its own generator, seeded with its own seed, so
    a sampled reply does not depend on which prompts shared its rounds. A prompt with no room under
    `rows.context` gets an empty, unfinished reply. on_reply(index, reply) is called as each one ends (progress,
    partial saving). keep_features: each Reply also carries the top features its forwards computed (what a
    separate capture pass over the same tokens would)."""
    seeds = list(range(len(prompts))) if seeds is None else seeds
    if len(seeds) != len(prompts):
        raise EagleLabError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    target, device = rows.target, rows.target.device
    replies: list[Reply | None] = [None] * len(prompts)
    pending = deque(range(len(prompts)))
    active: list[tuple[int, Sequence]] = []

    def answer(index: int, reply: Reply) -> None:
        replies[index] = reply
        if on_reply is not None:
            on_reply(index, reply)

    def end(index: int, sequence: Sequence) -> None:
        finished = sequence.reason == "eos"
        tokens = sequence.stopper.generated[:-1] if finished else sequence.stopper.generated
        features = torch.cat(sequence.features).cpu() if keep_features else None
        answer(index, Reply(list(tokens), finished, features))

    while pending or active:
        while pending and len(active) < len(rows.rows):
            index = pending.popleft()
            prompt = prompts[index]
            limit = min(max_new_tokens, rows.context - len(prompt))
            if not prompt or limit < 1:
                answer(index, Reply([], False))
                continue
            sequence = Sequence(target, None, torch.tensor(prompt, device=device), params,
                                Stopper(target.tokenizer, limit, eos_ids),
                                torch.Generator(device=device).manual_seed(seeds[index]), rows=rows, plain=True,
                                keep_features=keep_features)
            sequence.prefill()
            active.append((index, sequence))
        live = [sequence for _, sequence in active if not sequence.done]
        if live:
            for sequence in live:
                sequence.draft(plain=True)
            scores = score_rows(rows, live)
            rows.keep_roots([sequence.row for sequence in live], scores[0].scored_at)  # one copy for all rows
            for sequence, scored in zip(live, scores):
                sequence.accept(scored, kept=True)
        for index, sequence in active:
            if sequence.done:
                end(index, sequence)
        active = [(index, sequence) for index, sequence in active if not sequence.done]
    return replies  # every prompt was answered above
