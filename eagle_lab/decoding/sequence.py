"""The decoding loop, written once: a `Sequence` advanced one round at a time.

Every caller drives it: the command line, the bench and every timing (one sequence:
eagle_lab/decoding/generate.py), the server (many sequences scored by one forward:
eagle_lab/serving/batching.py) and regeneration (plain decoding of many prompts: generate.decode_prompts).
A round:

  prefill()        the prompt alone: the first token
  draft(plain)     this round's tree: the drafter's (under a controller, the chain it chooses), or the root
                   alone (method=vanilla, or plain decoding chosen for this batch size); split in
                   prepare_draft() and set_tree() so that a batched drafter (eagle_lab/drafters/eagle/batch.py)
                   drafts many sequences at once
  score()          one target forward over the tree on the sequence's own scorer, or score_rows(): one static
                   forward over every sequence's tree, each on its row
  accept(scored)   verify with this sequence's own rule and generator, keep the accepted entries, emit tokens

A sequence's target state is a Scorer (eagle_lab/decoding/scoring.py): a row of static rows (shared with the
sequences it is batched with, a batch of one at batch 1) or an eager DynamicCache. Everything a round reads is
the sequence's own (row, drafter, torch.Generator, stopper), and a row's forward gives each token what a one-row
forward gives, so its output does not depend on which other sequences share the forward
(tests/test_server_batching.py checks token identity against batch 1).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Strings
from dataclasses import dataclass, field
from typing import Protocol

import torch

from eagle_lab.decoding.sampling import DraftSampling, SamplingParams, next_token
from eagle_lab.decoding.scoring import Scored, Scorer
from eagle_lab.decoding.static_rows import RowScore, RowScorer, StaticRows
from eagle_lab.decoding.tree import Drafter, DraftTree, root_only_tree
from eagle_lab.decoding.verify import verify
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

    def record_round(self, tree: DraftTree, accepted: torch.Tensor) -> None:
        """A verified round: its tree and the accepted node indices [L + 1], the root first."""
        drafts = accepted.numel() - 1
        for counts, upto in ((self.reached_depth, tree.max_depth), (self.accepted_depth, drafts)):
            counts.extend([0] * (upto - len(counts)))
            for d in range(upto):
                counts[d] += 1
        self.rounds += 1
        self.accepted_draft_tokens += drafts
        self.tree_tokens += tree.size - 1
        if tree.from_ngram is not None:
            self.accepted_ngram_tokens += int(tree.from_ngram[accepted[1:]].sum())
            self.ngram_tree_tokens += int(tree.from_ngram.sum())


class Stopper:
    """Decides where generation ends: eos, a stop string, max_new_tokens (>= 1: the configs check it)."""

    def __init__(self, tokenizer, max_new_tokens: int, eos_ids: set[int], stop: Strings[str] = ()):
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


def feature_layers(drafter: Drafter | None) -> tuple[int, ...]:
    """The target layers a drafter reads (EAGLE-3 heads read several; () for the top feature)."""
    return tuple(getattr(drafter, "feature_layers", ()))


class RoundObserver(Protocol):
    def phase(self, name: str, seconds: float, tree: DraftTree | None) -> None:
        """name: drafted | scored | verified | committed; tree (the round's) is set on committed."""
        ...


class Sequence:
    """One request's decoding state. plain=True is method=vanilla: no drafter, every round scores the root alone.
    rows: the static rows it takes a row of (shared with the sequences it is batched with); or scorer: its own
    target state instead (eagle_lab.decoding.backend's open). keep_features: keep the top feature of every token
    the target read, in `features` (regeneration's capture)."""

    def __init__(self, target: Target, drafter: Drafter | None, prompt_ids: torch.Tensor, params: SamplingParams,
                 stopper: Stopper, generator: torch.Generator | None = None, rows: StaticRows | None = None,
                 plain: bool = False, scorer: Scorer | None = None, keep_features: bool = False):
        if plain and drafter is not None:
            raise EagleLabError("plain decoding takes no drafter")
        if (rows is None) == (scorer is None):
            raise EagleLabError("a sequence decodes on a row of static rows or on its own scorer: give one")
        self.target, self.drafter, self.prompt_ids = target, drafter, prompt_ids  # prompt_ids: (T,)
        self.params, self.stopper, self.generator, self.plain = params, stopper, generator, plain
        self.scorer: Scorer = RowScorer(rows, feature_layers(drafter)) if scorer is None else scorer
        self.stats = GenerationStats()
        self.reason = ""  # why it stopped ('' while running)
        self.sequence: torch.Tensor | None = None  # (T + emitted,) committed tokens; the last is the root
        # (P_i, F) pieces of the features the drafter has not been fed yet (joined when read: a round that
        # drafts nothing adds a piece without copying the rest)
        self._unseen: list[torch.Tensor] | None = None
        self.tree: DraftTree | None = None  # this round's tree, between draft() and accept()
        self.plan = None  # a controlled drafter's plan for this round (drafter.plan: its shape, n-gram tokens)
        self.features: list[torch.Tensor] | None = [] if keep_features else None  # (n, H) pieces
        self.start = time.perf_counter()

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.scorer.layer_ids

    @property
    def row(self):
        """Its row of the static rows (a RowScorer's)."""
        return self.scorer.row

    @property
    def unseen(self) -> torch.Tensor | None:
        """(P, F) the features the drafter has not been fed yet (None without a drafter, or once done)."""
        if self._unseen is None:
            return None
        if len(self._unseen) > 1:
            self._unseen = [torch.cat(self._unseen)]
        return self._unseen[0]

    @property
    def done(self) -> bool:
        return bool(self.reason)

    @property
    def started(self) -> bool:
        return self.sequence is not None

    @property
    def past(self) -> int:
        """Entries in the target cache: every committed token but the root."""
        return self.sequence.numel() - 1

    @torch.no_grad()
    def prefill(self) -> list[int]:
        check_prompt(self.target, self.prompt_ids)
        check_prompt(self.target, self.prompt_ids, self.scorer.max_context)
        if self.drafter is not None:
            self.drafter.reset()
        scored = self.scorer.prefill(self.prompt_ids)  # features (T, H), head_features (T, F), logits (1, V)
        self._unseen = [scored.head_features] if self.drafter is not None else None
        if self.features is not None:
            self.features.append(scored.features)
        self.stats.target_forwards += 1
        root = next_token(scored.logits[-1], self.params, self.generator)
        self.sequence = self.prompt_ids
        return self._emit([root])

    @torch.no_grad()
    def step(self, observer: RoundObserver | None = None) -> list[int]:
        """One round alone: draft, score on this sequence's own scorer, accept; -> the emitted tokens."""
        clock = time.perf_counter()

        def lap(name: str, tree: DraftTree | None = None) -> None:
            nonlocal clock
            if observer is not None:
                now = time.perf_counter()
                observer.phase(name, now - clock, tree)
                clock = now

        tree = self.draft()
        lap("drafted")
        scored = self.scorer.score(tree.tokens, tree.depths, tree.mask if tree.size > 1 else None)
        lap("scored")
        emitted = self.accept(scored, lap=lap)
        lap("committed", tree)
        return emitted

    @torch.no_grad()
    def draft(self, plain: bool = False) -> DraftTree:
        """This round's tree: the drafter's (under a controller, the chain it chooses), or with plain=True (plain
        decoding chosen for this batch size) the root alone. Then the head is not run, and the features it did not
        see are kept for the next round that drafts (its cache stays in step)."""
        max_depth = self.prepare_draft(plain)
        if max_depth is None:
            return self.tree
        return self.set_tree(self.drafter.draft(self.sequence, self.unseen, max_depth, **self.draft_arguments))

    @property
    def draft_arguments(self) -> dict:
        """What a drafter's draft() is told besides the sequence: the sampling, and a controlled drafter's plan."""
        arguments = {"sampling": self.draft_sampling}
        if self.plan is not None:
            arguments["plan"] = self.plan
        return arguments

    @property
    def draft_sampling(self) -> DraftSampling | None:
        """What draft() asks of the drafter at this sequence's temperature (None: greedy, point masses)."""
        return None if self.params.greedy else DraftSampling(self.params, self.generator)

    @property
    def samples_drafts(self) -> bool:
        """Whether this sequence's drafter draws its tree from its own distribution (drafted on its own, not
        in a batched head step: a sampled tree's spine is drafted one row a level)."""
        return self.draft_sampling is not None and getattr(self.drafter, "sampled_drafts", False)

    def prepare_draft(self, plain: bool = False) -> int | None:
        """The first half of draft(): settle this round's tree; -> the depth the drafter may reach (the context
        limit), or None when the tree is the root alone (then already set): method=vanilla, plain decoding chosen
        for this batch size, or a controller's round that drafts nothing. A batched drafter drafts several
        sequences between this and set_tree."""
        self.plan = None
        if not plain and getattr(self.drafter, "controller", None) is not None:  # the controller's round
            self.plan = self.drafter.plan(self.sequence, self.draft_sampling)
            planned, chain = self.plan
            plain = planned.depth == 0 and not chain  # the features stay unseen here until a round drafts
        if self.drafter is None or plain:
            self.tree = root_only_tree(int(self.sequence[-1]), self.sequence.device)
            return None
        return self.scorer.max_context - 1 - self.past

    def set_tree(self, tree: DraftTree) -> DraftTree:
        """The second half of draft(): this round's tree, drafted from every unseen feature."""
        self.tree = tree
        self._unseen = [self.unseen[:0]]  # fed to the drafter
        return tree

    @torch.no_grad()
    def accept(self, scored: Scored | RowScore, kept: bool = False, lap=None) -> list[int]:
        """Verify this round's tree on the logits its forward computed (this sequence's own rule and generator),
        keep the accepted entries in its cache (kept=True: the caller already did, StaticRows.keep_roots), emit
        the tokens. scored: what this sequence's scorer (or score_rows) scored last."""
        tree = self.tree
        accepted, bonus = verify(tree, lambda node: scored.logits[node], self.params, self.generator)  # (L + 1,)
        if lap is not None:
            lap("verified")
        if not kept:
            self.scorer.commit(accepted)
        if self.drafter is not None:
            self._unseen.append(scored.head_features[accepted])  # (L + 1, F)
        if self.features is not None:
            self.features.append(scored.features[accepted])
        self.stats.target_forwards += 1
        if not self.plain:
            self.stats.record_round(tree, accepted)
        self.tree = None
        return self._emit(tree.tokens[accepted[1:]].tolist() + [bonus])

    def _emit(self, tokens: list[int]) -> list[int]:
        emitted, reason = self.stopper.accept(tokens)
        self.stats.new_tokens += len(emitted)
        self.sequence = torch.cat([self.sequence, torch.tensor(tokens, device=self.sequence.device)])
        if not reason and self.past >= self.scorer.max_context:
            reason = "context"
        if reason:
            self.finish(reason)
        return emitted

    def finish(self, reason: str) -> None:
        self.reason = reason
        self.stats.stop_reason, self.stats.wall_s = reason, time.perf_counter() - self.start
        self.scorer.release()  # a row is free for the next sequence
        self.tree = self._unseen = None


def score_rows(rows: StaticRows, sequences: list[Sequence]) -> list[RowScore]:
    """One static forward over every sequence's tree (each on its row of `rows`), in order. The sequences read
    the same target features (one server's drafters do)."""
    if len({s.layer_ids for s in sequences}) > 1:
        raise EagleLabError("sequences whose drafters read different target layers cannot share a forward")
    scores = rows.score([s.row for s in sequences], [s.tree for s in sequences], sequences[0].layer_ids)
    for sequence, scored in zip(sequences, scores):
        sequence.scorer.scored = scored  # what its commit keeps from
    return scores


class BatchDrafting(Protocol):
    def draft(self, sequences: list[Sequence], plain: list[bool]) -> list[Exception | None]:
        """Set every sequence's tree for this round (drafting several at once); -> per sequence None, or the
        exception that failed it."""
        ...


def batch_round(rows: StaticRows, sequences: list[Sequence], plain: list[bool],
                drafting: BatchDrafting | None = None) -> list[list[int] | Exception]:
    """One round of several sequences on `rows`: each drafts its tree (plain: per sequence, the root alone; with
    `drafting`, those sharing a head together), one forward scores every tree, each verifies and keeps its
    accepted entries. -> per sequence the tokens it emitted, or the exception that failed it: a sequence's own
    step fails it alone, a failed forward every sequence in it."""
    if drafting is not None:
        errors = drafting.draft(sequences, plain)
    else:
        errors = [_attempt(lambda s=sequence, p=plain_row: s.draft(p))[1]
                  for sequence, plain_row in zip(sequences, plain)]
    drafted = [sequence for sequence, error in zip(sequences, errors) if error is None]
    results: dict[int, list[int] | Exception] = {id(s): error for s, error in zip(sequences, errors) if error}
    if drafted:
        try:
            scores = score_rows(rows, drafted)
        except Exception as exc:  # noqa: BLE001 - a failed forward fails its sequences, not the caller
            scores = [exc] * len(drafted)
        for sequence, scored in zip(drafted, scores):
            if isinstance(scored, Exception):
                results[id(sequence)] = scored
            else:
                tokens, failure = _attempt(lambda s=sequence, row=scored: s.accept(row))
                results[id(sequence)] = failure or tokens
    return [results[id(sequence)] for sequence in sequences]


def _attempt(step) -> tuple[object, Exception | None]:
    """(step()'s result, None), or (None, the exception it raised): one sequence's failure is that sequence's."""
    try:
        return step(), None
    except Exception as exc:  # noqa: BLE001
        return None, exc
