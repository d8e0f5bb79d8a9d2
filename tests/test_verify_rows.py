"""verify_rows: several sequences' verification walks in lockstep, one LM-head call per step.

The logits here are exact (integer-valued float64 features and head), so a batched call and a
per-row call give bit-identical logits and the lockstep results must equal verify()'s exactly,
greedy and sampled (each row with its own generator)."""

import pytest
import torch

from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.decoding.tree import build_tree
from eagle_lab.decoding.verify import verify, verify_rows, verify_steps

VOCAB, HIDDEN, NODES = 7, 5, 6


def head_and_rows(rows: int, seed: int = 0):
    """An integer LM head [H, V] and, per row, node features (N, H) and a chain tree whose first
    `k` children are the head's greedy choices (so greedy walks accept k tokens, k varying by row)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(-3, 4, (HIDDEN, VOCAB), generator=g).double()  # (H, V)
    cases = []
    for row in range(rows):
        features = torch.randint(-3, 4, (NODES, HIDDEN), generator=g).double()  # (N, H)
        greedy = (features @ head).argmax(-1)  # (N,) the target's choice after each node
        accept = row % NODES
        tokens = [int(torch.randint(0, VOCAB, (), generator=g))]  # the root
        for node in range(1, NODES):
            right = int(greedy[node - 1])
            tokens.append(right if node <= accept else (right + 1) % VOCAB)
        tree = build_tree(torch.tensor(tokens), torch.arange(-1, NODES - 1))
        cases.append((tree, features))
    return head, cases


@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.7, top_k=4)],
                         ids=["greedy", "T=1", "T=0.7,top-k"])
def test_lockstep_equals_each_walk_alone(params):
    head, cases = head_and_rows(6)
    calls = []

    def logits(rows):  # (R, H) -> (R, V)
        calls.append(rows.shape[0])
        return rows @ head

    walks = [(verify_steps(tree, params, torch.Generator().manual_seed(10 + i)), features)
             for i, (tree, features) in enumerate(cases)]
    together = verify_rows(walks, logits)
    alone = [verify(tree, lambda node, f=features: f[node] @ head, params, torch.Generator().manual_seed(10 + i))
             for i, (tree, features) in enumerate(cases)]
    for (path, bonus), (path_alone, bonus_alone) in zip(together, alone):
        assert path.tolist() == path_alone.tolist() and bonus == bonus_alone
    # one call per step: as many as the longest walk asks nodes, each for the rows still walking
    lengths = [path.numel() for path, _ in together]
    assert len(calls) == max(lengths)
    assert calls == [sum(n > step for n in lengths) for step in range(max(lengths))]
    if params.greedy:
        assert lengths == [i % NODES + 1 for i in range(6)]  # the chains were built to accept this much


def test_a_failing_walk_fails_alone():
    head, cases = head_and_rows(3)
    params = SamplingParams(0.0)

    def failing():
        yield 0
        raise ValueError("this walk breaks")

    walks = [(verify_steps(cases[0][0], params), cases[0][1]), (failing(), cases[1][1]),
             (verify_steps(cases[2][0], params), cases[2][1])]
    results = verify_rows(walks, lambda rows: rows @ head)
    assert isinstance(results[1], ValueError)
    for index in (0, 2):
        tree, features = cases[index]
        expected = verify(tree, lambda node, f=features: f[node] @ head, params)
        assert results[index][0].tolist() == expected[0].tolist() and results[index][1] == expected[1]
