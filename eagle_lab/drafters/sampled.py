"""Draft trees drawn from the drafter's own distribution, for sampled decoding (T > 0).

At T > 0 a drafted token is accepted with probability min(1, p/q) (eagle_lab/decoding/verify.py), so a
draft drawn from q, the head's distribution under the request's temperature / top-k / top-p, is accepted
with sum_x min(p(x), q(x)): more than the target's probability of the head's top token, which is what a
point-mass (top-k) draft gets whenever the two distributions are broad.

q is the head's distribution over its `SUPPORT` most likely draft tokens, warped by the request's
sampling parameters exactly as the target's logits are (sampling.target_probs) and renormalised: any q
keeps decoding lossless as long as verification uses the q the tokens were drawn from.

Topology. Verification at a node needs each sampled child to be distributed as q given the siblings
before it; that breaks if whether a child is kept depends on which token it holds (EAGLE-2's reranking
keeps the best-scoring candidates, and a candidate's score is its token's probability). So a sampled tree
has a fixed topology, a *spine*: at each level the spine node gets up to `topk` children drawn from its
q without replacement (in draw order), and the first drawn continues the spine, until `depth` levels or
`total_tokens` nodes. With topk = 1 it is a chain, the shape that pays on CPUs at T > 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eagle_lab.decoding.sampling import DraftSampling, SamplingParams, target_probs
from eagle_lab.decoding.tree import DraftTree, Proposals, tree_from_lists

SUPPORT = 8  # head tokens q ranges over (a compiled head step returns its top 8 whatever the tree's top-k)


def proposal(top_logp: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., S] the head's top-S log-probabilities -> [..., S] q: warped by params, renormalised over the S."""
    return target_probs(top_logp, params)


def draw_distinct(q: torch.Tensor, count: int, generator: torch.Generator | None) -> list[int]:
    """Up to `count` distinct indices of q [S] drawn one after another without replacement (each from q
    with the earlier ones removed, renormalised), in draw order; fewer when q has fewer non-zero entries.

    Gumbel-top-k: the order of log q + Gumbel noise is that sequence of draws (Plackett-Luce)."""
    u = torch.rand(q.shape, generator=generator, dtype=torch.float64, device=q.device).clamp_(min=1e-300)
    keys = q.double().log() - (-u.log()).log()  # [S]; -inf where q = 0
    order = keys.argsort(descending=True)[:count].tolist()
    return [i for i in order if q[i] > 0]


# spine node's token -> (its top-S log-probabilities [S], their target token ids [S]), advancing the drafter
ExpandSpine = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def grow_sampled_tree(root: int, top_logp: torch.Tensor, top_ids: torch.Tensor, depth: int, topk: int,
                      total_tokens: int, sampling: DraftSampling, expand: ExpandSpine) -> DraftTree:
    """The spine tree (module docstring) under `root`.

    top_logp, top_ids: [S] the root's proposal support (log-probabilities, target token ids).
    expand(level, token) drafts after the spine node at `level` (1 = a child of the root) holding `token`.
    """
    device = top_ids.device
    width = top_ids.numel()
    tokens, parents, sampled = [root], [-1], [False]
    support_rows: list[torch.Tensor | None] = [None]
    prob_rows: list[torch.Tensor | None] = [None]
    spine, budget = 0, total_tokens
    for level in range(1, depth + 1):
        q = proposal(top_logp, sampling.params)  # [S]
        picks = draw_distinct(q, min(topk, budget), sampling.generator)
        if not picks:
            break
        support_rows[spine], prob_rows[spine] = top_ids, q
        first = len(tokens)
        ids = top_ids.tolist()
        for index in picks:
            tokens.append(ids[index])
            parents.append(spine)
            sampled.append(True)
            support_rows.append(None)
            prob_rows.append(None)
        budget -= len(picks)
        spine = first
        if level == depth or budget <= 0:
            break
        top_logp, top_ids = expand(level, tokens[spine])
    tree = tree_from_lists(tokens, parents, device)
    zeros_ids = torch.zeros(width, dtype=torch.long, device=device)
    zeros_probs = torch.zeros(width, dtype=torch.float32, device=device)
    tree.proposals = Proposals(
        ids=torch.stack([zeros_ids if row is None else row for row in support_rows]),  # [N, S]
        probs=torch.stack([zeros_probs if row is None else row.float() for row in prob_rows]),  # [N, S]
        sampled=torch.tensor(sampled, dtype=torch.bool, device=device))  # [N]
    return tree
