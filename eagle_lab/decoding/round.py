"""One speculative round for one sequence: draft -> score -> verify -> commit.

The loops (eagle_lab/decoding/generate.py) drive this single-sequence round; the server's batched
round (eagle_lab/serving/batching.py) runs the same phases for several sequences. Anything that
wants to watch a round (profiling, tree search timing) passes a `RoundObserver` instead of
patching functions: it is told each phase's result and its wall time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from eagle_lab.decoding.sampling import DraftSampling, SamplingParams
from eagle_lab.decoding.scoring import Scored, Scorer
from eagle_lab.decoding.tree import DraftTree
from eagle_lab.decoding.verify import verify


@dataclass
class RoundResult:
    tree: DraftTree
    scored: Scored
    accepted: torch.Tensor  # [L + 1] accepted node indices, the root first
    bonus: int  # the target's token after the accepted path
    new_tokens: list[int]  # accepted draft tokens, then the bonus
    new_features: torch.Tensor  # [L + 1, F] features the drafter has not seen yet


class RoundObserver(Protocol):
    def phase(self, name: str, seconds: float, result: RoundResult | None) -> None:
        """name: drafted | scored | verified | committed; result is set on committed."""
        ...


def speculative_round(scorer: Scorer, drafter, sequence: torch.Tensor, new_features: torch.Tensor,
                      params: SamplingParams, generator: torch.Generator | None,
                      observer: RoundObserver | None = None) -> RoundResult:
    """sequence: [T] committed tokens, the last (the root) not yet in the target cache;
    new_features: [P, F] the target features the drafter has not seen."""
    clock = time.perf_counter()

    def lap(name: str, result: RoundResult | None = None) -> None:
        nonlocal clock
        if observer is not None:
            now = time.perf_counter()
            observer.phase(name, now - clock, result)
            clock = now

    past = scorer.past
    sampling = None if params.greedy else DraftSampling(params, generator)
    tree = drafter.draft(sequence, new_features, max_depth=scorer.max_context - 1 - past, sampling=sampling)
    lap("drafted")
    scored = scorer.score(tree.tokens, tree.depths, tree.mask if tree.size > 1 else None)
    lap("scored")
    accepted, bonus = verify(tree, lambda node: scored.logits[node], params, generator)  # [L + 1]
    lap("verified")
    scorer.commit(accepted)
    result = RoundResult(tree=tree, scored=scored, accepted=accepted, bonus=bonus,
                         new_tokens=tree.tokens[accepted[1:]].tolist() + [bonus],
                         new_features=scored.head_features[accepted])
    lap("committed", result)
    return result
