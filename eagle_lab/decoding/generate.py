"""The decoding loops: plain autoregressive (the baseline) and speculative (draft + verify).

Both are generators that yield each chunk of accepted tokens as soon as it is known, and
return a `GenerationStats`; `generate()` drains one into a `GenerationResult`. Stopping
(eos, stop strings, max_new_tokens, context limit) lives in `Stopper`, shared by both.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

import torch

from eagle_lab.decoding.backend import Backend, EagerBackend
from eagle_lab.decoding.round import RoundObserver, speculative_round
from eagle_lab.decoding.sampling import SamplingParams, next_token
from eagle_lab.decoding.scoring import Scorer
from eagle_lab.decoding.tree import Drafter, DraftTree
from eagle_lab.errors import EagleLabError
from eagle_lab.models.target import Target


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_forwards: int = 0  # prefill included, so plain decoding has tau = 1
    rounds: int = 0  # verification rounds
    accepted_draft_tokens: int = 0
    tree_tokens: int = 0  # draft tokens scored by the target
    accepted_ngram_tokens: int = 0  # accepted draft tokens that only an n-gram chain proposed
    ngram_tree_tokens: int = 0  # draft tokens an n-gram chain added to the trees (scored too)
    reached_depth: list[int] = field(default_factory=list)  # rounds whose tree reached depth d (index d-1)
    accepted_depth: list[int] = field(default_factory=list)  # rounds that accepted >= d drafts
    stop_reason: str = ""
    wall_s: float = 0.0

    @property
    def accept_length(self) -> float:
        """tau: tokens emitted per target forward, bonus token included."""
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def ngram_share(self) -> float:
        """Share of accepted draft tokens (bonus tokens excluded) that came from n-gram branches."""
        return self.accepted_ngram_tokens / self.accepted_draft_tokens if self.accepted_draft_tokens else 0.0

    def record_round(self, tree_depth: int, accepted: int, tree_tokens: int, accepted_ngram: int = 0,
                     ngram_tokens: int = 0) -> None:
        for counts, upto in ((self.reached_depth, tree_depth), (self.accepted_depth, accepted)):
            counts.extend([0] * (upto - len(counts)))
            for d in range(upto):
                counts[d] += 1
        self.rounds += 1
        self.accepted_draft_tokens += accepted
        self.tree_tokens += tree_tokens
        self.accepted_ngram_tokens += accepted_ngram
        self.ngram_tree_tokens += ngram_tokens


@dataclass
class GenerationResult:
    token_ids: list[int]
    stats: GenerationStats


class Stopper:
    """Decides where generation ends: eos, a stop string, max_new_tokens (>= 1: the configs check it)."""

    def __init__(self, tokenizer, max_new_tokens: int, eos_ids: set[int], stop: Sequence[str] = ()):
        self.tokenizer, self.max_new_tokens, self.eos_ids = tokenizer, max_new_tokens, set(eos_ids)
        self.stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self.stop), default=0)
        self.generated: list[int] = []

    def accept(self, tokens: list[int]) -> tuple[list[int], str]:
        """Cut `tokens` where generation must end; returns (tokens to emit, reason or '')."""
        emitted: list[int] = []
        for token in tokens:
            emitted.append(token)
            self.generated.append(token)
            if token in self.eos_ids:
                return emitted, "eos"
            if self.stop and self._hit_stop_string():
                return emitted, "stop"
            if len(self.generated) >= self.max_new_tokens:
                return emitted, "length"
        return emitted, ""

    def _hit_stop_string(self) -> bool:
        # decode everything: a tail window can split a multi-byte character differently
        text = self.tokenizer.decode(self.generated, skip_special_tokens=True)
        return any(s in text[-(self._longest + 16):] for s in self.stop)


def check_prompt(target: Target, prompt_ids: torch.Tensor, max_context: int | None = None) -> None:
    """Refuse an empty prompt, or one longer than the target's context (or max_context)."""
    limit = target.max_context if max_context is None else max_context
    if prompt_ids.numel() == 0:
        raise EagleLabError("the prompt is empty")
    if prompt_ids.numel() > limit:
        raise EagleLabError(f"the prompt has {prompt_ids.numel()} tokens, more than the target's context of {limit}")


def _open(target: Target, backend: Backend | None, prompt_ids: torch.Tensor, stopper: Stopper,
          layer_ids: tuple[int, ...] = ()) -> Scorer:
    check_prompt(target, prompt_ids)
    scorer = (backend or EagerBackend(target)).open(prompt_ids.numel(), stopper.max_new_tokens, layer_ids)
    check_prompt(target, prompt_ids, scorer.max_context)
    return scorer


def vanilla_decode(
    target: Target, prompt_ids: torch.Tensor, params: SamplingParams, stopper: Stopper,
    generator: torch.Generator | None = None, backend: Backend | None = None,
) -> Generator[list[int], None, GenerationStats]:
    """Plain decoding: one target forward per token. prompt_ids: [T]. backend: eager when None."""
    stats, start = GenerationStats(), time.perf_counter()
    scorer = _open(target, backend, prompt_ids, stopper)
    logits = scorer.prefill(prompt_ids).logits[-1]  # [V]
    first = torch.zeros(1, dtype=torch.long, device=target.device)  # the one scored token is kept
    while True:
        stats.target_forwards += 1
        token = next_token(logits, params, generator)
        emitted, reason = stopper.accept([token])
        stats.new_tokens += len(emitted)
        yield emitted
        if not reason and scorer.past >= scorer.max_context:
            reason = "context"
        if reason:
            break
        logits = scorer.score(torch.tensor([token], device=target.device)).logits[0]  # [V]
        scorer.commit(first)
    stats.stop_reason, stats.wall_s = reason, time.perf_counter() - start
    return stats


def speculative_decode(
    target: Target, drafter: Drafter, prompt_ids: torch.Tensor, params: SamplingParams, stopper: Stopper,
    generator: torch.Generator | None = None, backend: Backend | None = None,
    observer: RoundObserver | None = None,
) -> Generator[list[int], None, GenerationStats]:
    """Draft a tree, score it in one target forward, keep the accepted path. prompt_ids: [T]."""
    stats, start = GenerationStats(), time.perf_counter()
    layer_ids = tuple(getattr(drafter, "feature_layers", ()))  # EAGLE-3 heads read several layers
    scorer = _open(target, backend, prompt_ids, stopper, layer_ids)
    drafter.reset()
    scored = scorer.prefill(prompt_ids)
    new_features = scored.head_features  # [T, F]
    stats.target_forwards += 1
    root = next_token(scored.logits[-1], params, generator)
    emitted, reason = stopper.accept([root])
    stats.new_tokens += len(emitted)
    yield emitted
    sequence = torch.cat([prompt_ids, torch.tensor([root], device=prompt_ids.device)])  # [T + 1]
    while not reason:
        if scorer.past >= scorer.max_context:  # the root is not in the target cache yet
            reason = "context"
            break
        step = speculative_round(scorer, drafter, sequence, new_features, params, generator, observer)
        stats.target_forwards += 1
        new_features = step.new_features  # [L + 1, F]
        stats.record_round(step.tree.max_depth, step.accepted.numel() - 1, step.tree.size - 1,
                           *_ngram_counts(step.tree, step.accepted))
        emitted, reason = stopper.accept(step.new_tokens)
        stats.new_tokens += len(emitted)
        yield emitted
        sequence = torch.cat([sequence, torch.tensor(step.new_tokens, device=sequence.device)])
    stats.stop_reason, stats.wall_s = reason, time.perf_counter() - start
    return stats


def _ngram_counts(tree: DraftTree, accepted: torch.Tensor) -> tuple[int, int]:
    """(accepted nodes an n-gram chain added, nodes it added) in this round's tree."""
    if tree.from_ngram is None:
        return 0, 0
    return int(tree.from_ngram[accepted[1:]].sum()), int(tree.from_ngram.sum())


def generate(decoder: Generator[list[int], None, GenerationStats]) -> GenerationResult:
    """Drain a decoding generator (non-streaming use)."""
    tokens: list[int] = []
    while True:
        try:
            tokens.extend(next(decoder))
        except StopIteration as done:
            return GenerationResult(token_ids=tokens, stats=done.value)
