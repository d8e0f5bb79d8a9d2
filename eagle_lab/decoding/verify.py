"""Accept a prefix of the draft tree so that the output is exactly the target's.

Notation: p = target probability (after temperature / top-k / top-p, `target_probs`),
q = draft probability. Tree nodes are draft tokens; node 0 is the root, a token the
target already chose.

Greedy rule. Walk from the root; at each accepted node, accept the child whose token is
argmax p at that node, if there is one. The accepted path is exactly the prefix plain
greedy decoding would produce, and the bonus token is argmax p at the last accepted
node, so output equals greedy decoding token for token.

Sampling rule (recursive rejection over siblings). At an accepted node with target
distribution p and children c_1..c_m in order, each proposed by a distribution q_i fixed before
c_i is seen (given the siblings before it):
    r = p
    for i = 1..m:  accept c_i with probability min(1, r(c_i) / q_i(c_i));
                   on rejection r = norm(max(r - q_i, 0))      (the residual)
    if all are rejected: emit a bonus token drawn from r, stop.
If c_i is accepted, descend to it and repeat with p at c_i; at a leaf, draw the bonus from p there.
Two kinds of children:
  - point masses, q_i = delta(c_i): top-k drafts (deterministic given the context) and n-gram
    nodes. Acceptance is r(c_i), and the residual is r with c_i removed, renormalised.
  - sampled drafts (eagle_lab/drafters/sampled.py, T > 0): c_1, c_2, ... drawn from the head's
    distribution q without replacement, so q_i = q with c_1..c_{i-1} removed, renormalised.

Why it is lossless. By induction on i, the token emitted from step i on follows r: it is c with
probability q_i(c) min(1, r(c)/q_i(c)) = min(q_i(c), r(c)), else (probability 1 - sum min(q_i, r))
a token from the next residual norm(max(r - q_i, 0)), whose mass is exactly what the first term
left out of r; the residual does not depend on which c_i was drawn, so the induction applies to
the rest whatever c_i was. Hence every token has probability exactly p(x), whatever the draft
proposed; the draft only decides how often the answer comes from a candidate (cheap) rather
than the final draw. Because the target's logits at a child are computed with the child's token
in context (tree attention), descending repeats the argument one position later, so whole
sequences follow the target's distribution. What the argument needs of a tree: c_i follows q_i
given everything before it, so whether a child is in the tree may depend on its earlier siblings
but never on its own token (a sampled tree's topology is fixed in advance for this reason), and
siblings hold distinct tokens.

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

from eagle_lab.decoding.sampling import SamplingParams, draw, greedy_token, next_token, target_probs
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

    node_logits is asked only for nodes on the accepted path (the scorer has computed every scored
    row's logits beforehand, in one LM-head matmul). A tree of the root alone (a round that drafted nothing) is a
    plain step: its token is next_token's, the very draw the walk below would make, without the walk.
    """
    if tree.size == 1:
        return torch.zeros(1, dtype=torch.long, device=tree.tokens.device), next_token(node_logits(0), params,
                                                                                       generator)
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
    proposals = tree.proposals
    sampled = proposals.sampled.tolist() if proposals is not None else [False] * tree.size
    path = [0]
    node = 0
    while True:
        p = to_probs((yield node))
        residual = p.clone()  # [V] r, unnormalised
        remaining = None  # [S] this node's q without the sampled children rejected so far, unnormalised
        accepted_child = None
        for child in children[node]:
            token = tokens[child]
            mass = residual.sum()
            u = torch.rand((), generator=generator, device=residual.device)
            if not sampled[child]:  # q = delta(token): accept with r(token)
                if u * mass < residual[token]:
                    accepted_child = child
                    break
                residual[token] = 0.0
                continue
            if remaining is None:
                remaining = proposals.probs[node].clone()
            support = proposals.ids[node]  # [S]
            slot = int((support == token).nonzero()[0])
            q = remaining / remaining.sum()  # [S] q_i
            if u * q[slot] * mass < residual[token]:  # u < r(token) / q_i(token), r normalised
                accepted_child = child
                break
            residual = residual / mass
            residual.index_add_(0, support, -q.to(residual.dtype)).clamp_(min=0.0)  # max(r - q_i, 0)
            remaining[slot] = 0.0
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
