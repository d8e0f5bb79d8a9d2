"""One request's decoding state, advanced one round at a time so that rounds can be batched.

The steps are those of eagle_lab.decoding.round's speculative round, split at the target forward
so that one forward scores the trees of many sequences. Every sequence decodes in a row of one
static cache (eagle_lab.decoding.static_rows.StaticRows, compiled or eager), and a round over B
sequences is one forward of B rows, B = 1 included:

  prefill()      the prompt alone, into the sequence's row: the first token
  draft(plain)   this round's tree: the drafter's, or the root alone (method=vanilla, or
                 plain decoding chosen for this batch size); split in prepare_draft() and
                 set_tree() so that eagle_lab.serving.batch_draft can draft many sequences at once
  -- score_rows(): one static forward over every sequence's tree, every node's logits from one
     LM-head matmul --
  accept(scored) verify with this sequence's own rule and generator, keep the accepted entries
                 in its row, emit tokens

Everything a round reads is this sequence's own (row, drafter, torch.Generator, stopper), and
every row's forward gives each token what a one-row forward gives, so its output does not depend
on which other sequences share the forward (tests/test_server_batching.py checks token identity
against batch 1).
"""

from __future__ import annotations

import time

import torch

from eagle_lab.decoding.generate import GenerationStats, Stopper, _ngram_counts, check_prompt
from eagle_lab.decoding.sampling import DraftSampling, SamplingParams, next_token
from eagle_lab.decoding.static_rows import RowScore, StaticRows
from eagle_lab.decoding.tree import Drafter, DraftTree, root_only_tree
from eagle_lab.decoding.verify import verify
from eagle_lab.errors import EagleLabError
from eagle_lab.models.target import Target


class Sequence:
    """plain=True is method=vanilla: no drafter, every round scores the root alone.
    rows: the static cache the sequence takes a row of (shared with the sequences it is batched with)."""

    def __init__(self, target: Target, drafter: Drafter | None, prompt_ids: torch.Tensor, params: SamplingParams,
                 stopper: Stopper, generator: torch.Generator | None, rows: StaticRows, plain: bool = False):
        if plain and drafter is not None:
            raise EagleLabError("plain decoding takes no drafter")
        self.target, self.drafter, self.prompt_ids = target, drafter, prompt_ids  # prompt_ids: (T,)
        self.params, self.stopper, self.generator, self.plain = params, stopper, generator, plain
        self.layer_ids = tuple(getattr(drafter, "feature_layers", ()))  # EAGLE-3 heads read several layers
        self.rows = rows
        self.row = rows.attach()
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
        check_prompt(self.target, self.prompt_ids)
        if self.drafter is not None:
            self.drafter.reset()
        features, layers = self.rows.prefill(self.row, self.prompt_ids, self.layer_ids)  # (T, H), (T, F) or None
        head = features if layers is None else layers
        self.unseen = head if self.drafter is not None else None  # (T, F)
        self.stats.target_forwards += 1
        root = next_token(self.target.logits(features[-1]), self.params, self.generator)
        self.sequence = self.prompt_ids
        return self._emit([root])

    @torch.no_grad()
    def draft(self, plain: bool = False) -> DraftTree:
        """This round's tree: the drafter's (under a controller, the chain it chooses), or with plain=True (plain
        decoding chosen for this batch size) the root alone. Then the head is not run, and the features it did not
        see are kept for the next round that drafts (its cache stays in step)."""
        max_depth = self.prepare_draft(plain)
        if max_depth is None:
            return self.tree
        return self.set_tree(self.drafter.draft(self.sequence, self.unseen, max_depth=max_depth,
                                                sampling=self.draft_sampling))

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
        for this batch size, or a controller's round that drafts nothing. eagle_lab.serving.batch_draft drafts
        several sequences between this and set_tree."""
        if not plain and getattr(self.drafter, "controller", None) is not None:  # the controller's round
            planned, chain = self.drafter.plan(self.sequence, self.draft_sampling)
            plain = planned.depth == 0 and not chain
            if plain:
                self.drafter.drop_plan()  # the features stay unseen here until a round drafts
        if self.drafter is None or plain:
            self.tree = root_only_tree(int(self.sequence[-1]), self.sequence.device)
            return None
        return self.target.max_context - 1 - self.past

    def set_tree(self, tree: DraftTree) -> DraftTree:
        """The second half of draft(): this round's tree, drafted from every unseen feature."""
        self.tree = tree
        self.unseen = self.unseen[:0]  # fed to the drafter
        return tree

    @torch.no_grad()
    def accept(self, scored: RowScore) -> list[int]:
        """Verify this round's tree on the logits its forward computed (this sequence's own rule and
        generator), keep the accepted entries in its row, emit the tokens."""
        tree = self.tree
        accepted, bonus = verify(tree, lambda node: scored.logits[node], self.params, self.generator)  # (L + 1,)
        self.rows.keep(self.row, scored, accepted)
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
        self.rows.detach(self.row)  # its row is free for the next sequence
        self.tree = self.unseen = None


def score_rows(rows: StaticRows, sequences: list[Sequence]) -> list[RowScore]:
    """One static forward over every sequence's tree (each on its row of `rows`), in order. The sequences read
    the same target features (one server's drafters do)."""
    if len({s.layer_ids for s in sequences}) > 1:
        raise EagleLabError("sequences whose drafters read different target layers cannot share a forward")
    return rows.score([s.row for s in sequences], [s.tree for s in sequences], sequences[0].layer_ids)
