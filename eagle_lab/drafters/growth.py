"""What every tree drafter shares: tree shapes (and tree=auto's choices of them), the candidates a draft
considered, and EAGLE-2's dynamic tree growth, which the EAGLE, Medusa and draft-model drafters all use."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from eagle_lab.decoding.tree import DraftTree, build_tree, select_best
from eagle_lab.drafters.ngram import NgramProposer
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


UNTUNED_SHAPE = TreeShape(depth=3, topk=1, total_tokens=3)  # a chain: 4 tokens score at one token's cost


def untuned_shape(method: str, auto: bool, depth: int, topk: int, total_tokens: int) -> TreeShape:
    """The tree of a drafter that tree=auto does not calibrate (it times EAGLE heads):
    tree.depth/topk/total_tokens when set, else under tree=auto a chain of 3."""
    if depth and topk and total_tokens:
        return TreeShape(depth, topk, total_tokens)
    if not auto:
        raise EagleLabError("tree.auto=false needs tree.depth, tree.topk and tree.total_tokens > 0")
    log.info("method=%s: tree=auto calibrates EAGLE heads only; drafting a chain of %d "
             "(set tree=cpu or tree.depth/topk/total_tokens for a tree)", method, UNTUNED_SHAPE.depth)
    return UNTUNED_SHAPE


@dataclass(frozen=True)
class TreeChoice:
    """tree=auto's tree for one sampling temperature (0: greedy): the head's shape and, with hybrid
    drafting, the n-gram proposer merged into it (None: no chains). Sampling accepts fewer draft
    tokens than greedy decoding, so a smaller tree, or none, can be faster there."""

    temperature: float
    shape: TreeShape
    ngram: NgramProposer | None = None


@dataclass(frozen=True)
class BatchTree:
    """The tree for one batch size (eagle_lab/serving/tree_per_batch.py): the head's shape and, with hybrid
    drafting, the n-gram chain length merged into it (0: none; None: the drafter's own)."""

    shape: TreeShape
    ngram_tokens: int | None = None


@dataclass
class Candidates:
    """Every node the last draft considered, before the final top-`total_tokens` cut.

    Level by level: the root's top-k children, then each frontier node's top-k children
    (consecutive, best first). tree_search/replay.py replays these to price smaller trees.
    """

    scores: torch.Tensor  # [M] cumulative draft log-probability
    parents: torch.Tensor  # [M] candidate index of the parent, -1 for the root
    tokens: torch.Tensor  # [M] target token ids



Expand = Callable[[int, torch.Tensor, "torch.Tensor | None", torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def grow_dynamic_tree(root: int, scores: torch.Tensor, tokens: torch.Tensor, depth: int, total_tokens: int,
                      expand: Expand) -> tuple[DraftTree, Candidates]:
    """EAGLE-2's dynamic tree, for any drafter that scores a frontier of k nodes in one step.

    scores, tokens: [k] the root's children (log-probabilities, target token ids).
    expand(level, frontier_tokens [k], rows, visible [k, E + k]) -> (child log-probs [k, k], child
    tokens [k, k]) drafts the children of the frontier at `level` (1 = the root's children): rows
    [k] says which row of the previous expand call each frontier node came from (None at level 1),
    and visible which of the E draft entries fed so far, plus the k new ones, each node may attend
    to (its ancestors and itself). Keeps the best k of the k*k children as the next frontier, then
    the best `total_tokens` of all candidates as the tree.
    """
    device = scores.device
    k = scores.numel()
    all_scores, all_tokens = [scores], [tokens]
    all_parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
    frontier = torch.arange(k, device=device)  # candidate ids of the frontier
    frontier_scores, frontier_tokens = scores, tokens  # [k]
    ancestry = torch.zeros(k, 0, dtype=torch.bool, device=device)  # [k, draft entries so far]
    rows, n_candidates = None, k
    for level in range(1, depth):
        visible = torch.cat([ancestry, torch.eye(k, dtype=torch.bool, device=device)], dim=1)  # [k, E + k]
        child_logp, child_tokens = expand(level, frontier_tokens, rows, visible)  # [k, k] each
        child_scores = frontier_scores[:, None] + child_logp  # [k, k]
        all_scores.append(child_scores.flatten())
        all_tokens.append(child_tokens.flatten())
        all_parents.append(frontier.repeat_interleave(k))
        best = child_scores.flatten().topk(k).indices  # [k] flat indices into [k, k]
        rows = best // k
        frontier = n_candidates + best
        n_candidates += k * k
        frontier_scores, frontier_tokens = child_scores.flatten()[best], child_tokens.flatten()[best]
        ancestry = visible[rows]
    candidates = Candidates(torch.cat(all_scores), torch.cat(all_parents), torch.cat(all_tokens))
    kept, parents = select_best(candidates.scores, candidates.parents, total_tokens)
    tokens = torch.cat([torch.tensor([root], device=device), candidates.tokens[kept]])
    parents = torch.cat([torch.tensor([-1], device=device), parents])
    return build_tree(tokens, parents), candidates


