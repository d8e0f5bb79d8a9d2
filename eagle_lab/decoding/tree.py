"""Draft-tree bookkeeping as pure tensor functions.

A tree of N nodes is given by `parents` [N] (node 0 is the root, parents[0] = -1, every
parent index is smaller than its child's). From it follow:
  depths            [N]        root 0
  ancestor mask     [N, N]     mask[i, j] = j is i or an ancestor of i (tree attention)
`Drafter` is what the decoding loop asks of any drafter: a tree after the committed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Proposals:
    """The distributions a sampled tree's tokens were drawn from (q in verify.py)."""

    ids: torch.Tensor  # [N, S] target token ids: the support of the proposal node i's children were drawn from
    probs: torch.Tensor  # [N, S] q over that support (zeros for nodes without sampled children)
    sampled: torch.Tensor  # [N] bool: node drawn from its parent's proposal (else a point mass: q = delta)

    def extended(self, count: int) -> Proposals:
        """The same with `count` point-mass nodes appended (an n-gram chain merged after drafting)."""
        ids, probs = self.ids, self.probs
        return Proposals(ids=torch.cat([ids, ids.new_zeros((count, ids.shape[1]))]),
                         probs=torch.cat([probs, probs.new_zeros((count, probs.shape[1]))]),
                         sampled=torch.cat([self.sampled, self.sampled.new_zeros(count)]))


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] token ids, node 0 = root (already chosen by the target)
    parents: torch.Tensor  # [N] parent node index, -1 for the root
    depths: torch.Tensor  # [N]
    mask: torch.Tensor  # [N, N] bool ancestor-or-self
    from_ngram: torch.Tensor | None = None  # [N] bool: nodes only an n-gram chain proposed (None: none)
    proposals: Proposals | None = None  # sampled drafts' q (None: every node a point mass, as top-k drafts are)

    @property
    def size(self) -> int:
        return self.tokens.numel()

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())


def build_tree(tokens: torch.Tensor, parents: torch.Tensor) -> DraftTree:
    return tree_from_lists(tokens.tolist(), parents.tolist(), tokens.device)


def tree_from_lists(tokens: list[int], parents: list[int], device: torch.device) -> DraftTree:
    """A round's tree is small, and each small tensor op costs more than a Python loop over it: the depths
    and the mask are worked out on lists, and four tensors are made at the end."""
    return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long, device=device),
                     parents=torch.tensor(parents, dtype=torch.long, device=device),
                     depths=torch.tensor(_depths(parents), dtype=torch.long, device=device),
                     mask=torch.tensor(_ancestor_rows(parents), dtype=torch.bool, device=device).reshape(len(parents),
                                                                                                      len(parents)))


def chain_tree(root_token: int, tokens: list[int], device: torch.device) -> DraftTree:
    """The root followed by `tokens`, each the child of the one before."""
    return tree_from_lists([root_token, *tokens], list(range(-1, len(tokens))), device)


def root_only_tree(root_token: int, device: torch.device) -> DraftTree:
    return tree_from_lists([root_token], [-1], device)


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    return torch.tensor(_depths(parents.tolist()), dtype=parents.dtype, device=parents.device)


def _depths(parents: list[int]) -> list[int]:
    depths = [0] * len(parents)
    for i in range(1, len(parents)):  # parents precede children, so one pass suffices
        depths[i] = depths[parents[i]] + 1
    return depths


def _ancestor_rows(parents: list[int]) -> list[list[bool]]:
    n = len(parents)
    rows: list[list[bool]] = []
    for i in range(n):  # a node sees what its parent sees, and itself
        row = list(rows[parents[i]]) if i > 0 and parents[i] >= 0 else [False] * n
        row[i] = True
        rows.append(row)
    return rows


def best_nodes(scores: list[float], parents: list[int], count: int) -> tuple[list[int], list[int]]:
    """Keep the `count` highest-scoring candidates as a tree under a new root.

    scores: [M] cumulative draft log-probabilities (a child never scores above its parent);
    parents: [M] candidate index of each candidate's parent, -1 for the root's children,
    parents listed before children. Ties keep the earlier candidate (the sort is stable), so an
    ancestor is never dropped while its descendant is kept.

    Returns (kept candidate indices in candidate order, their parents as node indices of the new
    tree, where the root is node 0 and kept[i] becomes node i + 1).
    """
    count = min(count, len(scores))
    kept = sorted(sorted(range(len(scores)), key=lambda i: -scores[i])[:count])  # candidate order keeps parents first
    node_of = {candidate: node for node, candidate in enumerate(kept, start=1)}
    node_of[-1] = 0
    missing = [c for c in kept if parents[c] not in node_of]
    if missing:
        raise RuntimeError("tree selection dropped an ancestor; scores must not increase with depth")
    return kept, [node_of[parents[c]] for c in kept]


class Drafter(Protocol):
    def reset(self) -> None: ...

    def fork(self) -> Drafter:
        """A drafter for another sequence: what is read-only (weights, tree, costs) shared, the per-sequence state
        (caches, the last candidates) fresh. Two sequences whose rounds interleave need a drafter each."""
        ...

    def draft(self, sequence: torch.Tensor, new_features: torch.Tensor, max_depth: int,
              sampling=None) -> DraftTree:
        """sequence: [T] committed tokens, the last one the root; new_features: [P, F]
        target features at positions T-1-P .. T-2 (those the drafter has not seen): the top
        feature, or the layers named by the drafter's `feature_layers` concatenated.
        sampling: a DraftSampling at T > 0 (None at T = 0): a drafter that can draws its tokens
        from its own distribution and records it in the tree's `proposals`; others ignore it."""
        ...
