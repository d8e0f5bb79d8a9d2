"""Tree bookkeeping against hand-written expected tensors."""

import torch

from eagle_lab.decoding.tree import ancestor_mask, build_tree, node_depths, retrieve_indices, select_best

# root 0 with children 1, 2; 1 has children 3, 4; 3 has child 5
#        0
#      /   \
#     1     2
#    / \
#   3   4
#   |
#   5
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 3])


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
    assert torch.equal(ancestor_mask(PARENTS), expected)


def test_retrieve_indices():
    expected = torch.tensor([
        [0, 2, -1, -1],
        [0, 1, 4, -1],
        [0, 1, 3, 5],
    ])
    assert torch.equal(retrieve_indices(PARENTS), expected)


def test_positions_follow_depth():
    tree = build_tree(torch.tensor([7, 8, 9, 10, 11, 12]), PARENTS)
    past = 20
    assert (past + tree.depths).tolist() == [20, 21, 21, 22, 22, 23]
    assert tree.max_depth == 3 and tree.size == 6


def test_single_root():
    tree = build_tree(torch.tensor([5]), torch.tensor([-1]))
    assert tree.mask.tolist() == [[True]]
    assert retrieve_indices(tree.parents).tolist() == [[0]]


def test_select_best_keeps_ancestors_and_order():
    # candidates: 0,1 children of root; 2,3 children of 0; 4,5 children of 1
    scores = torch.tensor([-0.1, -1.0, -0.3, -2.0, -1.2, -1.5])
    parents = torch.tensor([-1, -1, 0, 0, 1, 1])
    kept, new_parents = select_best(scores, parents, 4)
    assert kept.tolist() == [0, 1, 2, 4]
    assert new_parents.tolist() == [0, 0, 1, 2]  # node 3 (cand 2) under node 1, node 4 (cand 4) under node 2


def test_select_best_ties_keep_parent():
    scores = torch.tensor([0.0, 0.0, 0.0])  # a chain of certain tokens
    parents = torch.tensor([-1, 0, 1])
    kept, new_parents = select_best(scores, parents, 2)
    assert kept.tolist() == [0, 1] and new_parents.tolist() == [0, 1]
