"""One request's decoding state, advanced one round at a time so that rounds can be batched.

The steps are those of eagle_lab.decoding.generate's loops (speculative_decode, vanilla_decode), split
at the target forward so that one forward can score the trees of many sequences:

  prefill()      the prompt alone (batch 1): the first token
  draft(shape)   this round's tree: the drafter's, or the root alone (method=vanilla, or
                 plain decoding chosen for this batch size); split in prepare_draft() and
                 set_tree() so that eagle_lab.serving.batch_draft can draft many sequences at once
  -- the scheduler scores the tree: score_alone() (batch 1: exactly generate.py's call) or
     eagle_lab.serving.batch.PaddedBatch.score() (one padded forward for all sequences); on the
     static path (compiled decoding) every batch size, 1 included, is one forward of
     eagle_lab.decoding.static_rows.StaticRows over the sequences' rows: score_rows() --
  accept(scored) verify with this sequence's own generator, compact its cache, emit tokens (at
                 batch > 1 the rows' verification walks run in lockstep first, one LM-head call
                 per step for all rows: verification() and eagle_lab.decoding.verify.verify_rows)

Everything a round reads is this sequence's own (cache, drafter, torch.Generator, stopper),
so its output does not depend on which other sequences share the forward; only the float
rounding of a padded batched forward could differ (tests/test_server_batching.py checks
token identity against batch 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from eagle_lab.decoding.cache import keep_accepted
from eagle_lab.decoding.static_rows import StaticRows
from eagle_lab.decoding.tree import Drafter
from eagle_lab.drafters.growth import BatchTree, TreeShape
from eagle_lab.errors import EagleLabError
from eagle_lab.decoding.generate import GenerationStats, Stopper, _check_prompt, _head_features, _ngram_counts, score_tree
from eagle_lab.decoding.sampling import SamplingParams, next_token
from eagle_lab.models.target import Target
from eagle_lab.decoding.tree import DraftTree, root_only_tree
from eagle_lab.decoding.verify import VerifySteps, run_steps, verify_steps


@dataclass
class Scored:
    """A tree scored by the target, for one sequence."""

    features: torch.Tensor  # (N, H) top features at the tree nodes
    head_features: torch.Tensor  # (N, F) what the drafter reads at those nodes
    keep: Callable[[torch.Tensor], None]  # accepted node indices (L,) -> the cache holds past + those
    logits: torch.Tensor | None = None  # (N, V) when the forward computed every node's logits (static path)


class Sequence:
    """plain=True is method=vanilla: no drafter, and at batch 1 the exact vanilla_decode forward.
    rows: the static path's shared cache (the sequence takes a row of it); None: its own DynamicCache."""

    def __init__(self, target: Target, drafter: Drafter | None, prompt_ids: torch.Tensor, params: SamplingParams,
                 stopper: Stopper, generator: torch.Generator | None, plain: bool = False,
                 rows: StaticRows | None = None):
        if plain and drafter is not None:
            raise EagleLabError("plain decoding takes no drafter")
        self.target, self.drafter, self.prompt_ids = target, drafter, prompt_ids  # prompt_ids: (T,)
        self.params, self.stopper, self.generator, self.plain = params, stopper, generator, plain
        self.layer_ids = tuple(getattr(drafter, "feature_layers", ()))  # EAGLE-3 heads read several layers
        self.own_shape: TreeShape | None = getattr(drafter, "shape", None)  # the drafter's tree at batch 1
        self.own_ngram = getattr(drafter, "ngram", None)  # and its n-gram proposer (hybrid drafting)
        self.rows = rows
        self.row = rows.attach() if rows is not None else None
        self.cache = target.new_cache() if rows is None else None
        self.stats = GenerationStats()
        self.reason = ""  # why it stopped ('' while running)
        self.sequence: torch.Tensor | None = None  # (T + emitted,) committed tokens; the last is the root
        self.unseen: torch.Tensor | None = None  # (P, F) features the drafter has not been fed yet
        self.tree: DraftTree | None = None  # this round's tree, between draft() and accept()
        self.start = time.perf_counter()

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
        _check_prompt(self.target, self.prompt_ids)
        if self.drafter is not None:
            self.drafter.reset()
        if self.rows is not None:
            features, layers = self.rows.prefill(self.row, self.prompt_ids, self.layer_ids)  # (T, H), (T, F) or None
            head = features if layers is None else layers
        else:
            out = self.target.forward(self.prompt_ids[None], self.cache, layer_ids=self.layer_ids)
            features, head = out.features[0], _head_features(out)[0]
        self.unseen = head if self.drafter is not None else None  # (T, F)
        self.stats.target_forwards += 1
        root = next_token(self.target.logits(features[-1]), self.params, self.generator)
        self.sequence = self.prompt_ids
        return self._emit([root])

    @torch.no_grad()
    def draft(self, shape: TreeShape | BatchTree | None = None) -> DraftTree:
        """shape: the tree for the current batch size (None: the drafter's own, as at batch 1).
        A shape of depth 0 is plain decoding: the head is not run, and the features it did not
        see are kept for the next round that drafts (its cache stays in step)."""
        max_depth = self.prepare_draft(shape)
        if max_depth is None:
            return self.tree
        return self.set_tree(self.drafter.draft(self.sequence, self.unseen, max_depth=max_depth))

    def prepare_draft(self, shape: TreeShape | BatchTree | None = None) -> int | None:
        """The first half of draft(): give the drafter this round's tree; -> the depth the drafter
        may reach (the context limit), or None when the tree is the root alone (then already set).
        A BatchTree also sets the n-gram chain length of a hybrid drafter (None: its own).
        eagle_lab.serving.batch_draft drafts several sequences between this and set_tree."""
        root = int(self.sequence[-1])
        device = self.sequence.device
        chain = shape.ngram_tokens if isinstance(shape, BatchTree) else None
        shape = shape.shape if isinstance(shape, BatchTree) else shape
        ngram = getattr(self.drafter, "ngram", None)
        if self.own_ngram is not None:  # hybrid drafting: this batch size's chain length, or the own one
            own = self.own_ngram
            ngram = own if chain is None else replace(own, max_tokens=chain) if chain else None
        effective = shape if shape is not None else self.own_shape
        if effective is not None and hasattr(self.drafter, "use_tree"):
            self.drafter.use_tree(effective, ngram)
        plain = effective is not None and effective.depth == 0 and ngram is None
        if self.drafter is None or plain:  # (with n-gram branches, depth 0 is n-gram drafting alone)
            self.tree = root_only_tree(root, device)
            return None
        return self.target.max_context - 1 - self.past

    def set_tree(self, tree: DraftTree) -> DraftTree:
        """The second half of draft(): this round's tree, drafted from every unseen feature."""
        self.tree = tree
        self.unseen = self.unseen[:0]  # fed to the drafter
        return tree

    @torch.no_grad()
    def score_alone(self) -> Scored:
        """Batch 1: the very forward generate.py runs (vanilla_decode's when plain)."""
        if self.rows is not None:
            return score_rows(self.rows, [self])[0]
        tree, past = self.tree, self.past
        if self.plain:
            out = self.target.forward(tree.tokens[None], self.cache)  # (1, 1) token
        else:
            out = score_tree(self.target, tree, self.cache, past, self.layer_ids)
        return Scored(out.features[0], _head_features(out)[0], lambda accepted: keep_accepted(self.cache, past, accepted))

    def verification(self) -> VerifySteps:
        """This round's verification walk, with this sequence's own rule and generator; the batched
        round drives every row's walk in lockstep (eagle_lab.decoding.verify.verify_rows) and hands the
        result to accept()."""
        return verify_steps(self.tree, self.params, self.generator)

    @torch.no_grad()
    def accept(self, scored: Scored, verdict: tuple[torch.Tensor, int] | None = None) -> list[int]:
        """verdict: (accepted nodes (L + 1,), bonus) from this round's verification() walk; None
        walks it here, one LM-head call per node, as generate.py does at batch 1."""
        tree, features = self.tree, scored.features  # features: (N, H)
        if verdict is None and scored.logits is not None:
            verdict = run_steps(self.verification(), lambda node: scored.logits[node])
        elif verdict is None:
            verdict = run_steps(self.verification(), lambda node: self.target.logits(features[node]))
        accepted, bonus = verdict  # (L + 1,), int
        scored.keep(accepted)
        if self.drafter is not None:
            self.unseen = torch.cat([self.unseen, scored.head_features[accepted]])  # (P + L + 1, F)
        self.stats.target_forwards += 1
        if not self.plain:
            self.stats.record_round(tree.max_depth, accepted.numel() - 1, tree.size - 1,
                                    *_ngram_counts(tree, accepted))
        self.tree = None
        return self._emit(tree.tokens[accepted[1:]].tolist() + [bonus])

    def _emit(self, tokens: list[int]) -> list[int]:
        emitted, reason = self.stopper.accept(tokens)
        self.stats.new_tokens += len(emitted)
        self.sequence = torch.cat([self.sequence, torch.tensor(tokens, device=self.sequence.device)])
        if not reason and self.past >= self.target.max_context:
            reason = "context"
        if reason:
            self.finish(reason)
        return emitted

    def finish(self, reason: str) -> None:
        self.reason = reason
        self.stats.stop_reason, self.stats.wall_s = reason, time.perf_counter() - self.start
        self.cache = None  # free the KV cache now (a cancelled or finished sequence)
        if self.row is not None:
            self.rows.detach(self.row)
        self.tree = self.unseen = None


def score_rows(rows: StaticRows, sequences: list[Sequence]) -> list[Scored]:
    """One static forward over every sequence's tree (each on its row of `rows`)."""
    scores = rows.score([s.row for s in sequences], [s.tree for s in sequences], sequences[0].layer_ids)
    return [Scored(score.features, score.head_features,
                   lambda accepted, row=s.row, score=score: rows.keep(row, score, accepted), score.logits)
            for s, score in zip(sequences, scores)]
