"""N-gram proposer and chain merging against hand-written expected values."""

import pytest
import torch

from eagle_lab.decoding.tree import build_tree, root_only_tree
from eagle_lab.drafters.ngram import NgramDrafter, NgramProposer, copy_forward, merge_chain
from eagle_lab.errors import EagleLabError
from tests.test_tree import leaf_paths


def propose(seq, min_match, max_match, max_tokens):
    return NgramProposer(min_match, max_match, max_tokens).propose(torch.tensor(seq))


def test_continuation_of_an_earlier_match():
    assert propose([1, 2, 3, 9, 1, 2, 3], 2, 3, 4) == [9, 1, 2, 3]
    assert propose([1, 2, 3, 9, 1, 2, 3], 2, 3, 2) == [9, 1]  # max_tokens caps the chain


def test_longest_suffix_wins_then_the_most_recent_occurrence():
    seq = [1, 2, 3, 7, 4, 2, 3, 8, 1, 2, 3]
    assert propose(seq, 2, 3, 4) == [7, 4, 2, 3]  # "1 2 3" matched at 0 beats the later "2 3"
    assert propose(seq, 2, 2, 4) == [8, 1, 2, 3]  # only bigrams: the most recent "2 3" (at 5)
    assert propose([2, 3, 5, 2, 3, 6, 2, 3], 2, 2, 2) == [6, 2]  # most recent of two earlier matches


def test_match_shorter_than_min_match_proposes_nothing():
    assert propose([1, 2, 3, 4], 2, 3, 4) == []
    assert propose([4, 1, 2, 4], 2, 3, 4) == []  # only "4" recurs
    assert propose([4, 1, 2, 4], 1, 3, 2) == [1, 2]
    assert propose([7], 1, 3, 4) == []  # nothing before the root


def test_recent_match_repeats_with_its_period():
    assert propose([1, 2, 3, 1, 2, 3], 2, 2, 7) == [1, 2, 3, 1, 2, 3, 1]
    assert propose([7, 7], 1, 2, 3) == [7, 7, 7]
    assert copy_forward([4, 5], 5) == [4, 5, 4, 5, 4]
    assert copy_forward([4, 5, 6], 2) == [4, 5]


@pytest.mark.parametrize("args, message", [
    ((0, 2, 4), "min_match must be >= 1"),
    ((3, 2, 4), "max_match (2) must be >= ngram.min_match (3)"),
    ((1, 2, 0), "max_tokens must be >= 1"),
])
def test_bad_settings_are_user_errors(args, message):
    with pytest.raises(EagleLabError, match=message.replace("(", r"\(").replace(")", r"\)")):
        NgramProposer(*args)


# EAGLE-like tree: root(5) -> 1(tok 1), 2(tok 3); node 1 -> 3(tok 0), 4(tok 2)
TOKENS = torch.tensor([5, 1, 3, 0, 2])
PARENTS = torch.tensor([-1, 0, 0, 1, 1])


def test_chain_hangs_under_the_deepest_agreeing_node():
    merged = merge_chain(build_tree(TOKENS, PARENTS), [1, 2, 7, 8])  # agrees with 1 -> 4, then 7, 8 are new
    assert merged.tokens.tolist() == [5, 1, 3, 0, 2, 7, 8]
    assert merged.parents.tolist() == [-1, 0, 0, 1, 1, 4, 5]
    assert merged.depths.tolist() == [0, 1, 1, 2, 2, 3, 4]
    assert merged.from_ngram.tolist() == [False] * 5 + [True, True]
    expected_mask = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 1, 0],
        [1, 1, 0, 0, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(merged.mask, expected_mask)
    assert (10 + merged.depths).tolist() == [10, 11, 11, 12, 12, 13, 14]  # positions after 10 cached tokens
    assert leaf_paths(merged.parents).tolist() == [[0, 2, -1, -1, -1], [0, 1, 3, -1, -1],
                                                         [0, 1, 4, 5, 6]]


def test_chain_disagreeing_at_once_is_a_new_branch_under_the_root():
    merged = merge_chain(build_tree(TOKENS, PARENTS), [9, 1])
    assert merged.tokens.tolist() == [5, 1, 3, 0, 2, 9, 1]
    assert merged.parents.tolist() == [-1, 0, 0, 1, 1, 0, 5]
    assert merged.from_ngram.tolist() == [False] * 5 + [True, True]


def test_tokens_the_tree_holds_are_not_added_twice():
    tree = build_tree(TOKENS, PARENTS)
    assert merge_chain(tree, [1, 0]) is tree  # the whole chain is already a path
    assert merge_chain(tree, []) is tree
    twice = merge_chain(merge_chain(tree, [3, 4]), [3, 4, 6])  # second chain reuses the first's nodes
    assert twice.tokens.tolist() == [5, 1, 3, 0, 2, 4, 6]
    assert twice.parents.tolist() == [-1, 0, 0, 1, 1, 2, 5]
    assert twice.from_ngram.tolist() == [False] * 5 + [True, True]
    children_of = {}
    for child, parent in enumerate(twice.parents.tolist()[1:], start=1):
        children_of.setdefault(parent, []).append(int(twice.tokens[child]))
    assert all(len(set(toks)) == len(toks) for toks in children_of.values())  # sibling tokens stay distinct


def test_ngram_drafter_caps_the_chain_at_max_depth():
    drafter = NgramDrafter(NgramProposer(2, 2, 5))
    sequence = torch.tensor([1, 2, 3, 1, 2])  # "1 2" matched at 0: chain 3 1 2 3 1
    tree = drafter.draft(sequence, torch.zeros(0, 4), max_depth=8)
    assert tree.tokens.tolist() == [2, 3, 1, 2, 3, 1] and tree.parents.tolist() == [-1, 0, 1, 2, 3, 4]
    tree = drafter.draft(sequence, torch.zeros(0, 4), max_depth=2)
    assert tree.tokens.tolist() == [2, 3, 1]
    assert drafter.draft(sequence, torch.zeros(0, 4), max_depth=0).tokens.tolist() == [2]
    assert drafter.draft(torch.tensor([1, 2, 3]), torch.zeros(0, 4), max_depth=4).size == 1  # no match
    assert root_only_tree(2, torch.device("cpu")).from_ngram is None
