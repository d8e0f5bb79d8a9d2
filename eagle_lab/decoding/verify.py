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

N-gram nodes (hybrid drafting, eagle_lab/drafters/ngram.py) go through the same rule, unchanged.
The proof above used only two facts about the children of a node: (a) they are fixed
before any of this node's uniforms are drawn, i.e. a deterministic function of the
context (committed tokens and the accepted path to the node), and (b) their tokens are
distinct. An n-gram chain is copied from the committed sequence before the round starts,
so each of its tokens is a point-mass proposal q = delta(c) exactly like a top-k child:
(a) holds. merge_chain descends into a child that already holds the chain's token instead
of adding a second one, so (b) holds. Where the chain's node sits in the sibling order
(after the head's children) does not matter: any fixed order samples x ~ p. The tempting
shortcut for a "certain" proposal, accepting c with min(1, p(c) / q(c)) = p(c) as if it
were the only candidate, is wrong once a sibling was rejected: the residual r then has
mass sum(r) < 1 and c must be accepted with r(c) / sum(r); p(c) under-emits c by the
factor sum(r) (tests/test_sampling_lossless.py shows the chi-square test rejecting it).
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from eagle_lab.decoding.sampling import SamplingParams, draw, greedy_token, target_probs
from eagle_lab.decoding.tree import DraftTree


NodeLogits = Callable[[int], torch.Tensor]  # node index -> [V] target logits at that node
# A verification walk as a generator: it yields the node whose target logits it needs next, is
# sent those logits [V], and returns (accepted node indices [L + 1], bonus token id). The greedy
# and sampling rules are written once as walks; run_steps drives one with a node -> logits lookup.
VerifySteps = Generator[int, torch.Tensor, tuple[torch.Tensor, int]]


def verify(
    tree: DraftTree, node_logits: NodeLogits, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, int]:
    """Walk the tree from the root; returns (accepted node indices [L + 1], bonus token id).

    node_logits is asked only for nodes on the accepted path: the LM head over a large
    vocabulary is a big part of a CPU round, so rows nobody reads are never computed.
    """
    return run_steps(verify_steps(tree, params, generator), node_logits)


def verify_steps(tree: DraftTree, params: SamplingParams, generator: torch.Generator | None = None) -> VerifySteps:
    """verify() as a walk that is sent each node's logits (see VerifySteps)."""
    if params.greedy:
        return _greedy_steps(tree)
    return _sampling_steps(tree, generator, lambda logits: target_probs(logits, params))


def run_steps(steps: Generator[int, torch.Tensor, tuple[torch.Tensor, int]],
              node_values: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Drive one walk, answering each node it asks for with node_values(node)."""
    try:
        node = next(steps)
        while True:
            node = steps.send(node_values(node))
    except StopIteration as done:
        return done.value


def verify_sampling(
    tree: DraftTree, node_probs: Callable[[int], torch.Tensor], generator: torch.Generator | None
) -> tuple[torch.Tensor, int]:
    """node_probs: node index -> [V] target probabilities p at that node."""
    return run_steps(_sampling_steps(tree, generator, lambda probs: probs), node_probs)


def _greedy_steps(tree: DraftTree) -> VerifySteps:
    children = _children(tree)
    tokens = tree.tokens.tolist()
    path, node = [0], 0
    while True:
        best = greedy_token((yield node))  # the target's choice after this node
        match = [c for c in children[node] if tokens[c] == best]  # sibling tokens are distinct
        if not match:
            return torch.tensor(path, device=tree.tokens.device), best
        node = match[0]
        path.append(node)


def _sampling_steps(tree: DraftTree, generator: torch.Generator | None,
                    to_probs: Callable[[torch.Tensor], torch.Tensor]) -> VerifySteps:
    """Sent each node's logits (or probabilities, with to_probs the identity); to_probs -> p [V]."""
    children = _children(tree)
    tokens = tree.tokens.tolist()
    path = [0]
    node = 0
    while True:
        p = to_probs((yield node))
        residual = p.clone()  # [V]
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
                residual = p
            bonus = draw(residual, generator)
            return torch.tensor(path, device=tree.tokens.device), bonus
        node = accepted_child
        path.append(node)


def _children(tree: DraftTree) -> list[list[int]]:
    """Child node lists in node order (the draft ranks siblings best first)."""
    children: list[list[int]] = [[] for _ in range(tree.size)]
    for child, parent in enumerate(tree.parents.tolist()[1:], start=1):
        children[parent].append(child)
    return children
