"""Tree bookkeeping against hand-written expected tensors."""

import torch

from eagle_lab.decoding.tree import best_nodes, build_tree, node_depths

# root 0 with children 1, 2; 1 has children 3, 4; 3 has child 5
#        0
#      /   \
#     1     2
#    / \
#   3   4
#   |
#   5
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 3])


def leaf_paths(parents: torch.Tensor, depths: torch.Tensor | None = None) -> torch.Tensor:
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


def test_depths():
    assert node_depths(PARENTS).tolist() == [0, 1, 1, 2, 2, 3]


def test_ancestor_mask():
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(build_tree(torch.arange(6), PARENTS).mask, expected)


def test_leaf_paths():
    expected = torch.tensor([
        [0, 2, -1, -1],
        [0, 1, 4, -1],
        [0, 1, 3, 5],
    ])
    assert torch.equal(leaf_paths(PARENTS), expected)


def test_positions_follow_depth():
    tree = build_tree(torch.tensor([7, 8, 9, 10, 11, 12]), PARENTS)
    past = 20
    assert (past + tree.depths).tolist() == [20, 21, 21, 22, 22, 23]
    assert tree.max_depth == 3 and tree.size == 6


def test_single_root():
    tree = build_tree(torch.tensor([5]), torch.tensor([-1]))
    assert tree.mask.tolist() == [[True]]
    assert leaf_paths(tree.parents).tolist() == [[0]]


def test_best_nodes_keep_ancestors_and_order():
    # candidates: 0,1 children of root; 2,3 children of 0; 4,5 children of 1
    scores = [-0.1, -1.0, -0.3, -2.0, -1.2, -1.5]
    parents = [-1, -1, 0, 0, 1, 1]
    kept, new_parents = best_nodes(scores, parents, 4)
    assert kept == [0, 1, 2, 4]
    assert new_parents == [0, 0, 1, 2]  # node 3 (cand 2) under node 1, node 4 (cand 4) under node 2


def test_best_nodes_ties_keep_parent():
    scores = [0.0, 0.0, 0.0]  # a chain of certain tokens
    parents = [-1, 0, 1]
    kept, new_parents = best_nodes(scores, parents, 2)
    assert kept == [0, 1] and new_parents == [0, 1]
