"""What every tree drafter shares: tree shapes (and the controller that chooses a chain's length), the
candidates a draft considered, and EAGLE-2's dynamic tree growth, which the EAGLE, Medusa and draft-model
drafters all use."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from eagle_lab.decoding.tree import DraftTree, best_nodes, tree_from_lists
from eagle_lab.errors import EagleLabError

log = logging.getLogger(__name__)


@dataclass
class TreeShape:
    depth: int = 4  # levels of draft tokens below the root
    topk: int = 4  # children per expanded node, and frontier width
    total_tokens: int = 12  # draft tokens kept (root excluded)

    def __post_init__(self):
        if self.depth < 0 or self.topk < 0 or self.total_tokens < 0:
            raise EagleLabError(f"tree needs depth, topk and total_tokens >= 0; got {self}")


def untuned_shape(method: str, online: bool, depth: int, topk: int, total_tokens: int) -> TreeShape:
    """The tree of a drafter the online controller does not drive (it drives EAGLE heads): under tree=online a
    chain of tree.depth tokens, else the fixed shape tree.depth / topk / total_tokens."""
    if not online:
        return TreeShape(depth, topk, total_tokens)
    log.info("method=%s: tree=online chooses chain lengths for EAGLE heads only; drafting a chain of %d "
             "(tree=cpu or tree.depth/topk/total_tokens for a fixed tree)", method, depth)
    return TreeShape(depth, 1, depth)


class ChainControl(Protocol):
    """Chooses each round's chain length online (eagle_lab/tree_search/online.py, tree.online=true)."""

    def choose(self, temperature: float = 0.0, proposed: int = 0) -> tuple[int, int]:
        """The next round's (chain length, 0: no draft; how many of the `proposed` n-gram tokens to merge) for a
        sequence sampling at `temperature` (0: greedy)."""
        ...

    def observe(self, length: int, accepted: int, ms: float | None, chain: int = 0, chain_accepted: int = 0) -> None:
        """The last round drafted `length` and accepted the first `accepted`, merged `chain` n-gram tokens and
        accepted their first `chain_accepted`, and took `ms` (None: not to be timed)."""
        ...

    def reset(self) -> None:
        """A new sequence."""
        ...

    def fork(self) -> ChainControl:
        """A controller for another sequence (what it learnt of the machine shared)."""
        ...


@dataclass
class Candidates:
    """Every node the last draft considered, before the final top-`total_tokens` cut.

    Level by level: the root's top-k children, then each frontier node's top-k children
    (consecutive, best first). tree_search/replay.py replays these to price smaller trees.
    """

    scores: torch.Tensor  # [M] cumulative draft log-probability
    parents: torch.Tensor  # [M] candidate index of the parent, -1 for the root
    tokens: torch.Tensor  # [M] target token ids



class TreeGrowth:
    """EAGLE-2's dynamic tree grown one level at a time, for one sequence: each level the frontier's k nodes
    get k children each, the best k of those k*k become the next frontier, and at the end the best
    `total_tokens` of all candidates become the tree. The single-sequence loop (grow_dynamic_tree) and
    batched drafting (eagle_lab/drafters/eagle/batch.py) both grow trees with it."""

    def __init__(self, scores: torch.Tensor, tokens: torch.Tensor):
        """scores, tokens: [k] the root's children (log-probabilities, target token ids)."""
        k, device = scores.numel(), scores.device
        self.k = k
        self.scores, self.tokens = [scores], [tokens]
        self.parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
        self.frontier = torch.arange(k, device=device)  # candidate ids of the frontier
        self.frontier_scores, self.frontier_tokens = scores, tokens  # [k]
        self.ancestry = torch.zeros(k, 0, dtype=torch.bool, device=device)  # [k, E] draft entries fed so far
        self.count = k

    def visible(self, width: int | None = None) -> torch.Tensor:
        """[k, E + width]: the draft entries each frontier node may attend to (its ancestors, then itself among
        the `width` new slots; width defaults to k)."""
        own = torch.eye(self.k, width or self.k, dtype=torch.bool, device=self.ancestry.device)
        return torch.cat([self.ancestry, own], dim=1)

    def grow(self, child_logp: torch.Tensor, child_tokens: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """child_logp, child_tokens: [k, k] the frontier's children; width: as visible's, the slots the level fed
        -> rows [k]: which frontier node each new frontier node descends from."""
        k = self.k
        child_scores = self.frontier_scores[:, None] + child_logp  # [k, k]
        self.scores.append(child_scores.flatten())
        self.tokens.append(child_tokens.flatten())
        self.parents.append(self.frontier.repeat_interleave(k))
        best = child_scores.flatten().topk(k).indices  # [k] flat indices into [k, k]
        rows = best // k
        self.frontier = self.count + best
        self.count += k * k
        self.frontier_scores, self.frontier_tokens = child_scores.flatten()[best], child_tokens.flatten()[best]
        self.ancestry = self.visible(width)[rows]
        return rows

    def tree(self, root: int, total_tokens: int) -> tuple[DraftTree, Candidates]:
        """The best `total_tokens` candidates under `root`, and every candidate considered."""
        candidates = Candidates(_joined(self.scores), _joined(self.parents), _joined(self.tokens))
        kept, parents = best_nodes(candidates.scores.tolist(), candidates.parents.tolist(), total_tokens)
        token_ids = candidates.tokens.tolist()
        tree = tree_from_lists([root] + [token_ids[c] for c in kept], [-1] + parents, self.frontier.device)
        return tree, candidates


def _joined(levels: list[torch.Tensor]) -> torch.Tensor:
    """The levels' candidates in one tensor (a one-level tree's own tensor: no copy)."""
    return levels[0] if len(levels) == 1 else torch.cat(levels)


Expand = Callable[[int, torch.Tensor, "torch.Tensor | None", torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def grow_dynamic_tree(root: int, scores: torch.Tensor, tokens: torch.Tensor, depth: int, total_tokens: int,
                      expand: Expand) -> tuple[DraftTree, Candidates]:
    """EAGLE-2's dynamic tree (TreeGrowth), for any drafter that scores a frontier of k nodes in one step.

    scores, tokens: [k] the root's children (log-probabilities, target token ids).
    expand(level, frontier_tokens [k], rows, visible [k, E + k]) -> (child log-probs [k, k], child
    tokens [k, k]) drafts the children of the frontier at `level` (1 = the root's children): rows
    [k] says which row of the previous expand call each frontier node came from (None at level 1),
    and visible which of the E draft entries fed so far, plus the k new ones, each node may attend
    to (its ancestors and itself).
    """
    growth, rows = TreeGrowth(scores, tokens), None
    for level in range(1, depth):
        child_logp, child_tokens = expand(level, growth.frontier_tokens, rows, growth.visible())  # [k, k] each
        rows = growth.grow(child_logp, child_tokens)
    return growth.tree(root, total_tokens)
