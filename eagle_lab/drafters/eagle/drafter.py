"""Drafters propose a token tree after the committed sequence; the target verifies it.

`EagleDrafter` grows an EAGLE-2 dynamic tree with the head:
  1. feed the head the pairs it has not seen, (feature_t, token_{t+1}), using its KV cache;
  2. the root's children are the top-k draft tokens; for each further level, feed the
     current frontier (k nodes) to the head in one batch, give every frontier node its
     top-k children (k*k candidates, scored by cumulative draft log-probability), and keep
     the best k as the next frontier;
  3. rerank all candidates and keep the best `total_tokens` as the tree (a child never
     scores above its parent, so kept nodes always have their ancestors).
Frontier entries in the head's cache are dropped at the start of the next round; only
committed pairs persist. With `ngram` set (hybrid drafting), the n-gram chain proposed from
the context is merged into the tree afterwards (eagle_lab/drafters/ngram.py); with drafting off
(depth 0) the tree is the root plus that chain, and the head is not run. At T > 0 (a `DraftSampling`
passed to draft) the tree's tokens are drawn from the head's distribution instead of taken as its
top-k, on a spine (eagle_lab/drafters/sampled.py). With a chain controller (tree.online=true,
eagle_lab/tree_search/online.py) each round drafts the chain length it chooses, and tells it what the
previous round accepted and cost; a round that drafts nothing keeps its features for the next one that does.
"""


from __future__ import annotations

import copy
import logging
import time

import torch

from eagle_lab.decoding.sampling import DraftSampling
from eagle_lab.decoding.tree import DraftTree, chain_tree, root_only_tree
from eagle_lab.drafters.eagle.head import EagleHead, HeadKVCache, draft_lm_head_weight
from eagle_lab.drafters.eagle.head_runner import HeadStepRunner
from eagle_lab.drafters.growth import Candidates, ChainControl, TreeGrowth, TreeShape, grow_dynamic_tree
from eagle_lab.drafters.ngram import NgramProposer, common_prefix, merge_chain
from eagle_lab.drafters.sampled import SUPPORT, grow_sampled_tree
from eagle_lab.models.masks import visibility
from eagle_lab.models.target import Target

log = logging.getLogger(__name__)


class EagleDrafter:
    def __init__(self, head: EagleHead, target: Target, shape: TreeShape, ngram: NgramProposer | None = None,
                 compiled: bool = False, cache_capacity: int = 0, build: bool = True, sampled_drafts: bool = True,
                 controller: ChainControl | None = None):
        """build: whether compiled head steps missing on this machine are compiled here (else run eagerly);
        sampled_drafts: whether a draft() given a DraftSampling draws its tokens (else its top-k, as at T = 0);
        controller: chooses each round's chain length (None: every round drafts `shape`)."""
        self.head, self.target, self.shape = head.eval(), target, shape
        self.sampled_drafts = sampled_drafts
        self.controller = controller
        # the controller's round in flight, read when the next is planned: (the head's drafted chain, the n-gram
        # tokens merged, the sequence's length when it was drafted, its start; None: not to be timed)
        self._round: tuple[list[int], list[int], int, float | None] | None = None
        self._unseen: list[torch.Tensor] = []  # [P_i, F] each: features of rounds that drafted nothing, fed next time
        self.ngram = ngram  # hybrid drafting: an n-gram chain merged into every tree (None: off)
        self.rotary = target.rotary
        rows = draft_lm_head_weight(head, target)  # [Vd, H]
        # in the head's dtype when it reads them (a bf16 copy beside an fp32 target: head.draft_dtype)
        self.lm_weight = rows.to(head.dtype) if head.reads_target_lm_rows else rows
        # the head step over the head's cache, compiled per row bucket when compiled=True (shared by forks)
        self.runner = HeadStepRunner(self.head, target.backbone.embed_tokens, self.rotary, self.lm_weight, compiled,
                                     build=build)
        self.cache_capacity = cache_capacity  # head cache slots preallocated per sequence (a static backend's reserve)
        self.cache = self.new_cache()
        self.committed = 0  # pairs in the head cache that belong to the committed sequence
        self.last_candidates: Candidates | None = None
        self.feature_layers = tuple(head.arch.feature_layers)  # target layers the head reads
        self.max_tree_tokens = 0  # > 0: n-gram chains are cut so a tree never has more nodes (static buckets)

    def new_cache(self) -> HeadKVCache:
        return HeadKVCache(min_capacity=self.cache_capacity)

    def fork(self) -> EagleDrafter:
        """A drafter for another sequence: the head, target, tree and n-gram proposer shared, fresh sequence
        state (head cache, committed pairs, last candidates)."""
        fork = copy.copy(self)  # shallow: module, target, shape, lm_weight, ngram shared
        fork.cache, fork.committed, fork.last_candidates = self.new_cache(), 0, None
        fork.controller = None if self.controller is None else self.controller.fork()
        fork._round = None
        fork._unseen = []
        return fork

    def stop_building(self) -> None:
        """Head steps whose graphs are missing run eagerly from now on (forks share the runner)."""
        self.runner.build = False

    def adopt_cache(self, cache: HeadKVCache, committed: int) -> None:
        """Continue from `cache`, whose first `committed` pairs are the committed sequence's (batched drafting
        hands each row's cache back this way)."""
        self.cache, self.committed = cache, committed

    def count_committed(self, pairs: int) -> None:
        """The committed sequence's pairs, while a batch holds them in its own cache (batched drafting)."""
        self.committed = pairs

    def control(self, controller: ChainControl | None) -> None:
        """Let `controller` choose each round's chain length from the next sequence on (None: draft `shape`)."""
        self.controller = controller
        self.reset()

    def reset(self) -> None:
        self.cache = self.new_cache()
        self.committed = 0
        self._round = None
        self._unseen = []
        if self.controller is not None:
            self.controller.reset()

    def _children(self, top_logp: torch.Tensor, top_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's top-k over the draft vocabulary [R, k] -> (log-probs [R, k], target token ids [R, k])."""
        return top_logp, self.head.draft_to_target[top_ids]

    def draft(self, sequence: torch.Tensor, new_features: torch.Tensor, max_depth: int,
              sampling: DraftSampling | None = None, plan: tuple[TreeShape, list[int]] | None = None) -> DraftTree:
        """plan: the controller's choice for this round, from plan() (None: planned here)."""
        if not self.sampled_drafts:
            sampling = None
        if self.controller is None:
            shape, chain = self.shape, None
        else:
            shape, chain = plan if plan is not None else self.plan(sequence, sampling)
        if self.controller is not None and shape.depth == 0:
            self._unseen.append(new_features)  # kept in pieces: one copy when a round drafts again
            tree = root_only_tree(int(sequence[-1]), sequence.device)
        else:
            if self._unseen:  # the rounds that drafted nothing left these to feed
                new_features = torch.cat([*self._unseen, new_features])  # [P, F]
                self._unseen = []
                if self._round is not None:  # this round's time holds their catching up: untimed
                    self._round = (*self._round[:3], None)
            tree = self._draft_eagle(sequence, new_features, max_depth, sampling, shape)
        if self.controller is not None:  # what the next round's acceptance is read against
            self._round = (tree.tokens[1:].tolist(), chain, *self._round[2:])
        return self.merge_ngram_chain(tree, sequence, max_depth, chain)

    @property
    def has_backlog(self) -> bool:
        """Whether rounds that drafted nothing left features the head has not been fed (draft() feeds them)."""
        return bool(self._unseen)

    def plan(self, sequence: torch.Tensor, sampling: DraftSampling | None = None) -> tuple[TreeShape, list[int]]:
        """The controller's (chain, n-gram tokens) for the round about to be drafted from `sequence`, after telling
        it how the last one went: the tokens that round accepted follow the sequence it was drafted from, up to
        the bonus token (so rounds in between that drafted nothing do not blur it), and its time runs from its draft
        to this plan (unless that draft also fed the head what rounds without drafts left: a cost of those rounds,
        not of its length). The draft (single or batched) that follows is given it."""
        now = time.perf_counter()
        if self._round is not None:
            drafted, merged, length, start = self._round
            accepted = sequence[length:-1].tolist()
            self.controller.observe(len(drafted), common_prefix(drafted, accepted),
                                    None if start is None else 1000 * (now - start), len(merged),
                                    common_prefix(merged, accepted))
        if not self.sampled_drafts:
            sampling = None
        proposal = self.ngram.propose(sequence) if self.ngram is not None else []
        length, keep = self.controller.choose(0.0 if sampling is None else sampling.params.temperature,
                                              len(proposal))
        self._round = ([], [], sequence.numel(), now)
        return TreeShape(length, 1, length), proposal[:keep]

    def planned_shape(self, plan: tuple[TreeShape, list[int]] | None) -> TreeShape:
        """The shape a round drafts: the controller's plan's (plan() gave it), else `shape`."""
        return plan[0] if plan is not None else self.shape

    def merge_ngram_chain(self, tree: DraftTree, sequence: torch.Tensor, max_depth: int,
                          chain: list[int] | None = None) -> DraftTree:
        """The head's tree with the n-gram chain merged in (hybrid drafting; unchanged without it). The chain's
        depth is its length, capped like the tree's, and by the room left under max_tree_tokens (the largest
        static bucket): single and batched drafting both merge here. chain: the chain to merge (None: the
        proposer's for `sequence`)."""
        if self.ngram is None or max_depth < 1:
            return tree
        room = self.max_tree_tokens - tree.size if self.max_tree_tokens else max_depth
        chain = self.ngram.propose(sequence) if chain is None else chain
        return merge_chain(tree, chain[:max(min(max_depth, room), 0)])

    @torch.no_grad()
    def _draft_eagle(self, sequence: torch.Tensor, new_features: torch.Tensor, max_depth: int,
                     sampling: DraftSampling | None, shape: TreeShape) -> DraftTree:
        device = sequence.device
        root = int(sequence[-1])
        if shape.depth < 1 or shape.total_tokens < 1 or shape.topk < 1:
            return root_only_tree(root, device)  # drafting is off (the controller chose no chain): skip the head
        depth = min(shape.depth, max_depth)
        if depth < 1:
            self.feed(sequence, new_features)  # near the context limit: keep the head cache in step
            return root_only_tree(root, device)
        if sampling is not None:
            return self._draft_sampled(sequence, new_features, depth, sampling, shape)
        if shape.topk == 1 and shape.total_tokens >= depth:
            return self._draft_chain(sequence, new_features, depth)
        return self._draft_tree(sequence, new_features, depth, shape)

    def _draft_tree(self, sequence: torch.Tensor, new_features: torch.Tensor, depth: int,
                    shape: TreeShape) -> DraftTree:
        """EAGLE-2's dynamic tree (grow_dynamic_tree), the head stepping the frontier's k rows at each level."""
        device = sequence.device
        root = int(sequence[-1])
        k = min(shape.topk, self.head.arch.draft_vocab_size)
        hidden, top_logp, top_ids = self._commit(sequence, new_features, k)
        scores, tokens = self._children(top_logp[-1:], top_ids[-1:])  # [1, k] each: the root's children
        predicted = hidden[-1:].expand(k, -1)  # [k, H] the last step's predicted features (the root's at first)

        def expand(level: int, frontier_tokens: torch.Tensor, rows: torch.Tensor | None, visible: torch.Tensor):
            nonlocal predicted
            parent_hidden = predicted if rows is None else predicted[rows]  # [k, H] each node's parent feature
            full = visibility([self.committed], [visible], k, self.committed + visible.shape[1], self.committed)[0]
            positions = torch.full((k,), self.committed + level - 1, device=device)
            predicted, top_logp, top_ids = self.runner(self.cache, frontier_tokens, parent_hidden, positions, full, k,
                                                       from_draft=True)  # [k, H], [k, k], [k, k]
            return self._children(top_logp, top_ids)

        tree, self.last_candidates = grow_dynamic_tree(root, scores.flatten(), tokens.flatten(), depth,
                                                       shape.total_tokens, expand)
        return tree

    def _draft_chain(self, sequence: torch.Tensor, new_features: torch.Tensor, depth: int) -> DraftTree:
        """The tree grow_dynamic_tree grows at top-1 (a chain, every level kept), without its ranking: one
        one-row head step per level, each seeing every committed pair and the levels above it."""
        device = sequence.device
        hidden, top_logp, top_ids = self._commit(sequence, new_features, 1)
        logps, ids = [top_logp[-1]], [top_ids[-1]]  # [1] each: the root's child
        predicted = hidden[-1:]  # [1, H] its parent feature
        for level in range(1, depth):
            visible = torch.ones(1, self.committed + level, dtype=torch.bool, device=device)
            positions = torch.full((1,), self.committed + level - 1, device=device)
            predicted, top_logp, top_ids = self.runner(self.cache, self.head.draft_to_target[ids[-1]], predicted,
                                                       positions, visible, 1, from_draft=True)  # [1, H], [1, 1] x2
            logps.append(top_logp[0])
            ids.append(top_ids[0])
        tokens = self.head.draft_to_target[torch.cat(ids)]  # [depth] target token ids
        self.last_candidates = Candidates(torch.cat(logps).cumsum(0), torch.arange(-1, depth - 1, device=device),
                                          tokens)
        return chain_tree(int(sequence[-1]), tokens.tolist(), device)

    def _draft_sampled(self, sequence: torch.Tensor, new_features: torch.Tensor, depth: int,
                       sampling: DraftSampling, shape: TreeShape) -> DraftTree:
        """The spine tree drawn from the head's distribution: one head step (one row) per level."""
        device = sequence.device
        support = min(SUPPORT, self.head.arch.draft_vocab_size)
        hidden, top_logp, top_ids = self._commit(sequence, new_features, support)
        predicted = hidden[-1:]  # [1, H] the spine node's parent feature

        def expand(level: int, token: int) -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal predicted
            visible = torch.ones(1, self.committed + level, dtype=torch.bool, device=device)  # its ancestors, itself
            positions = torch.full((1,), self.committed + level - 1, device=device)
            predicted, logp, ids = self.runner(self.cache, torch.tensor([token], device=device), predicted, positions,
                                               visible, support, from_draft=True)  # [1, H], [1, S], [1, S]
            return logp[0], self.head.draft_to_target[ids[0]]

        self.last_candidates = None
        return grow_sampled_tree(int(sequence[-1]), top_logp[-1], self.head.draft_to_target[top_ids[-1]], depth,
                                 shape.topk, shape.total_tokens, sampling, expand)

    def tree_from(self, growth: TreeGrowth, sequence: torch.Tensor, max_depth: int,
                  plan: tuple[TreeShape, list[int]] | None = None) -> DraftTree:
        """The tree a batched round grew for this drafter (eagle_lab/drafters/eagle/batch.py), kept as draft()
        keeps its own: the candidates remembered, the n-gram chain merged. plan: the controller's for this round."""
        chain = plan[1] if plan is not None else None
        tree, self.last_candidates = growth.tree(int(sequence[-1]), self.planned_shape(plan).total_tokens)
        if plan is not None:  # the controller's round: remember what it drafted
            self._round = (tree.tokens[1:].tolist(), chain, *self._round[2:])
        return self.merge_ngram_chain(tree, sequence, max_depth, chain)

    def feed(self, sequence: torch.Tensor, new_features: torch.Tensor) -> None:
        """Bring the head cache up to the committed sequence without drafting (arguments as draft's)."""
        self._commit(sequence, new_features, 1)

    def _commit(self, sequence: torch.Tensor, new_features: torch.Tensor, k: int):
        """Feed the unseen pairs (feature_t, token_{t+1}) -> hidden [P, H] and the top-k draft log-probs
        and draft ids of at least the last pair, which comes last ([<= P, k])."""
        self.cache.crop(self.committed)  # forget last round's frontier entries
        count = new_features.shape[0]
        # positions committed .. committed + count - 1, each pair seeing the committed ones and itself causally
        out = self.runner(self.cache, sequence[-count:], new_features, None, None, k, from_draft=False,
                          last_only=True)
        self.committed += count
        return out

