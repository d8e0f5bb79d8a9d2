"""Accept a prefix of the draft tree so that the output is exactly the target's.

Notation: p = target probability (after temperature / top-k / top-p, `target_probs`),
q = draft probability. Tree nodes are draft tokens; node 0 is the root, a token the
target already chose.

Greedy rule. Walk from the root; at each accepted node, accept the child whose token is
argmax p at that node, if there is one. The accepted path is exactly the prefix plain
greedy decoding would produce, and the bonus token is argmax p at the last accepted
node, so output equals greedy decoding token for token.

Sampling rule (multi-candidate rejection over siblings). At an accepted node with target
distribution p and children c_1..c_m (distinct tokens chosen by the draft, e.g. its top-k):
    r = p
    for i = 1..m:  accept c_i with probability r(c_i) / sum(r);
                   on rejection set r(c_i) = 0          (residual after removing c_i)
    if all are rejected: emit a bonus token drawn from r / sum(r), stop.
If c_i is accepted, descend to it and repeat with p at c_i; at a leaf, draw the bonus
from p there.

Why it is lossless. The tree's children are picked deterministically from the draft, so
each candidate is a point-mass proposal q = delta(c_i); the classic acceptance
min(1, p(x)/q(x)) and residual norm(max(p - q, 0)) then reduce to the two steps above.
By induction on i: P(emit c_1) = p(c_1); given c_1 was rejected, r is p conditioned on
x != c_1, so the loop is just sampling x ~ p by asking "is it c_1? c_2? ... else draw
from the rest". Every token therefore has probability exactly p(x), whatever the draft
proposed; the draft only decides how often the answer comes from a candidate (cheap) rather
than the final draw. Because the target's logits at a child are computed with the
child's token in context (tree attention), descending repeats the argument one position
later, so whole sequences follow the target's distribution.
"""

from __future__ import annotations

import torch

from eagle_lab.sampling import SamplingParams, target_probs
from eagle_lab.tree import DraftTree


def verify(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, int]:
    """logits: [N, V] target logits at every tree node.

    Returns (accepted node indices [L + 1] from the root down, bonus token id).
    """
    if params.greedy:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, target_probs(logits, params), generator)


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    best = logits.argmax(dim=-1)  # [N] the target's choice after each node
    # a child is accepted when its token is the target's choice at its parent
    good = torch.zeros_like(tree.tokens, dtype=torch.bool)
    good[1:] = tree.tokens[1:] == best[tree.parents[1:]]
    path = [0]
    children = _children(tree)
    node = 0
    while True:
        nxt = [c for c in children[node] if good[c]]
        if not nxt:
            break
        node = nxt[0]  # sibling tokens are distinct, so at most one matches
        path.append(node)
    accepted = torch.tensor(path, device=tree.tokens.device)
    return accepted, int(best[node])


def verify_sampling(
    tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, int]:
    """probs: [N, V] target probabilities p at every node."""
    children = _children(tree)
    tokens = tree.tokens.tolist()
    path = [0]
    node = 0
    while True:
        residual = probs[node].clone()  # [V]
        accepted_child = None
        for child in children[node]:
            token = tokens[child]
            mass = residual.sum()
            u = torch.rand((), generator=generator, device=residual.device)
            if u * mass < residual[token]:
                accepted_child = child
                break
            residual[token] = 0.0
        if accepted_child is None:
            if float(residual.sum()) <= 0.0:  # candidates covered the whole support (float dust)
                residual = probs[node]
            bonus = int(torch.multinomial(residual, 1, generator=generator))
            return torch.tensor(path, device=tree.tokens.device), bonus
        node = accepted_child
        path.append(node)


def _children(tree: DraftTree) -> list[list[int]]:
    """Child node lists in node order (the draft ranks siblings best first)."""
    children: list[list[int]] = [[] for _ in range(tree.size)]
    for child, parent in enumerate(tree.parents.tolist()[1:], start=1):
        children[parent].append(child)
    return children
