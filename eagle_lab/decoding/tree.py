"""Draft-tree bookkeeping as pure tensor functions.

A tree of N nodes is given by `parents` [N] (node 0 is the root, parents[0] = -1, every
parent index is smaller than its child's). From it follow:
  depths            [N]        root 0
  ancestor mask     [N, N]     mask[i, j] = j is i or an ancestor of i (tree attention)
  retrieve_indices  [L, D + 1] one row per leaf: node indices from the root down, -1 padded
`Drafter` is what the decoding loop asks of any drafter: a tree after the committed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] token ids, node 0 = root (already chosen by the target)
    parents: torch.Tensor  # [N] parent node index, -1 for the root
    depths: torch.Tensor  # [N]
    mask: torch.Tensor  # [N, N] bool ancestor-or-self
    from_ngram: torch.Tensor | None = None  # [N] bool: nodes only an n-gram chain proposed (None: none)

    @property
    def size(self) -> int:
        return self.tokens.numel()

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())


def build_tree(tokens: torch.Tensor, parents: torch.Tensor) -> DraftTree:
    depths = node_depths(parents)
    return DraftTree(tokens=tokens, parents=parents, depths=depths, mask=ancestor_mask(parents))


def root_only_tree(root_token: int, device: torch.device) -> DraftTree:
    return build_tree(torch.tensor([root_token], device=device), torch.tensor([-1], device=device))


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    parent_list = parents.tolist()  # a round's tree is small: lists beat a tensor op per node
    depths = [0] * len(parent_list)
    for i in range(1, len(parent_list)):  # parents precede children, so one pass suffices
        depths[i] = depths[parent_list[i]] + 1
    return torch.tensor(depths, dtype=parents.dtype, device=parents.device)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    parent_list = parents.tolist()
    n = len(parent_list)
    rows: list[list[bool]] = []
    for i in range(n):  # a node sees what its parent sees, and itself
        row = list(rows[parent_list[i]]) if i > 0 and parent_list[i] >= 0 else [False] * n
        row[i] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool, device=parents.device).reshape(n, n)


def retrieve_indices(parents: torch.Tensor, depths: torch.Tensor | None = None) -> torch.Tensor:
    """[L, D + 1]: the root-to-leaf path of every leaf, leaves in node order, -1 padded."""
    n = parents.numel()
    depths = node_depths(parents) if depths is None else depths
    is_parent = torch.zeros(n, dtype=torch.bool, device=parents.device)
    is_parent[parents[parents >= 0]] = True
    leaves = torch.nonzero(~is_parent).flatten()  # [L]
    max_depth = int(depths.max())
    paths = torch.full((leaves.numel(), max_depth + 1), -1, dtype=torch.long, device=parents.device)
    node = leaves.clone()
    for step in range(max_depth + 1):
        column = depths[leaves] - step  # where `node` sits on each path
        valid = column >= 0
        paths[valid.nonzero().flatten(), column[valid]] = node[valid]
        node = torch.where(valid, parents[node.clamp(min=0)], node)
    return paths


def select_best(scores: torch.Tensor, parents: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the `count` highest-scoring candidates as a tree under a new root.

    scores: [M] cumulative draft log-probabilities (a child never beats its parent);
    parents: [M] candidate index of each candidate's parent, -1 for the root's children,
    parents listed before children. Ties keep the earlier candidate, so an ancestor is
    never dropped while its descendant is kept.
    Returns (kept candidate indices [n] in candidate order, their parents as node indices
    of the new tree [n], where the root is node 0 and kept[i] becomes node i + 1).
    """
    count = min(count, scores.numel())
    order = torch.sort(scores, descending=True, stable=True).indices[:count]
    kept = order.sort().values  # [n] candidate order keeps parents first
    node_of = torch.full((scores.numel() + 1,), -1, dtype=torch.long, device=scores.device)
    node_of[kept] = torch.arange(1, count + 1, device=scores.device)
    node_of[-1] = 0  # parents == -1 (the root) indexes the last slot
    new_parents = node_of[parents[kept]]
    if bool((new_parents < 0).any()):
        raise RuntimeError("tree selection dropped an ancestor; scores must not increase with depth")
    return kept, new_parents


class Drafter(Protocol):
    def reset(self) -> None: ...

    def draft(self, sequence: torch.Tensor, new_features: torch.Tensor, max_depth: int) -> DraftTree:
        """sequence: [T] committed tokens, the last one the root; new_features: [P, F]
        target features at positions T-1-P .. T-2 (those the drafter has not seen): the top
        feature, or the layers named by the drafter's `feature_layers` concatenated."""
        ...
