"""Timing candidates in the decoding loop (tree=auto): the cost model's best few shapes, plain
decoding among them, each prompt decoded by all of them in turn, re-ranked by measured tokens/s
(the model prices a round's parts one by one; a small tree's round on a CPU can cost more than
they add up to).
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace

import torch

from eagle_lab.decoding.generate import Stopper, speculative_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.drafters.ngram import NgramProposer
from eagle_lab.models.target import Target
from eagle_lab.tree_search.costs import CostModel
from eagle_lab.tree_search.space import TreeSearchConfig

VALIDATE_TOP = 3  # the model's best shapes timed in the decoding loop before one is chosen
SMALL_TREE_TOKENS = 1  # the best head tree of at most this many draft tokens is always timed too


TIMING_PASSES = 2  # each prompt decoded this many times by each candidate; the fastest pass counts


def decode_timings(target: Target, drafter: EagleDrafter, prompts: list[list[int]], new_tokens: int,
                   candidates: list[tuple[TreeShape, NgramProposer | None]], backend=None,
                   params: SamplingParams = SamplingParams(), passes: int = TIMING_PASSES) -> list[dict]:
    """Decoding (greedy by default) with each candidate (tree shape, n-gram proposer or None; depth 0
    and no proposer = the no-draft path): tokens, rounds and seconds summed over the prompts, prefills
    not counted. Each prompt is decoded by every candidate in turn, in an order rotated from one
    prompt and pass to the next, so a drift in the machine's speed (other work, clocks) falls on all
    of them alike instead of on whichever was timed last; of a candidate's `passes` runs of a prompt
    the fastest counts (on a shared VM, runs seconds apart differ by enough to turn a tie into a
    win). Sampling: every candidate draws from the same seed on a prompt."""
    totals = [{"tokens": 0, "rounds": 0, "seconds": 0.0} for _ in candidates]
    for p, ids in enumerate(prompts):
        fastest: dict[int, tuple[float, int, int]] = {}  # candidate -> (seconds, tokens, rounds)
        for run in range(passes):
            for c in [(p + run + i) % len(candidates) for i in range(len(candidates))]:
                generator = None if params.greedy else torch.Generator(target.device).manual_seed(p)
                with drafter.tree_as(*candidates[c]):
                    decoder = speculative_decode(target, drafter, torch.tensor(ids, device=target.device),
                                                 params, Stopper(target.tokenizer, new_tokens, set()),
                                                 generator, backend=backend)
                    stamps, tokens = [], 0
                    for i, chunk in enumerate(decoder):  # the prefill's token, then one chunk per round
                        stamps.append(time.perf_counter())
                        tokens += len(chunk) if i else 0
                timing = (stamps[-1] - stamps[0], tokens, len(stamps) - 1)
                if c not in fastest or timing[0] < fastest[c][0]:
                    fastest[c] = timing
        for c, (seconds, tokens, rounds) in fastest.items():
            totals[c]["tokens"] += tokens
            totals[c]["rounds"] += rounds
            totals[c]["seconds"] += seconds
    return totals


def with_plain(rows: list[dict], fixed: TreeShape) -> list[dict]:
    """Copies of `rows`, plus plain decoding (no draft, no chain) when the fixed fields allow it
    and it is not among them: the candidates timed against each other in the loop."""
    rows = [dict(row) for row in rows]
    free = not (fixed.depth or fixed.topk or fixed.total_tokens)
    if free and not any(is_plain(r) for r in rows):
        rows.append({"shape": asdict(TreeShape(0, 0, 0)), "tau": 1.0})
    return rows


def candidates_to_time(ranked: list[dict], fixed: TreeShape) -> list[dict]:
    """The model's VALIDATE_TOP best rows; the best row that runs the head when none of those does (n-gram
    rows and plain decoding are priced from timed rounds, head trees from their parts, so the model can
    rank every head tree below them on a machine whose speed drifted while the parts were timed); the best
    head tree of at most SMALL_TREE_TOKENS draft tokens when none of the others is that small (the one-token
    chain: the head tree that pays at the lowest tau, which a model whose overhead is a residual fitted in a
    slow or fast minute can rank below larger trees); and plain decoding (with_plain)."""
    def runs_head(row: dict) -> bool:
        return row["shape"]["depth"] > 0

    def small(row: dict) -> bool:
        return runs_head(row) and row["shape"]["total_tokens"] <= SMALL_TREE_TOKENS

    rows = ranked[:VALIDATE_TOP]
    if not any(map(runs_head, rows)):
        rows = rows + [r for r in ranked if runs_head(r)][:1]
    if not any(map(small, rows)):
        rows = rows + [r for r in ranked if small(r)][:1]
    return with_plain(rows, fixed)


def is_plain(row: dict) -> bool:
    return row["shape"]["depth"] == 0 and not row.get("ngram_tokens")


def untimed(row: dict) -> dict:
    """A ranked row standing in for a timed one: the model's figures, marked as not timed."""
    return {**row, "measured_tokens_per_s": row["tokens_per_s"], "measured_tau": row["tau"],
            "measured_round_ms": row["round_ms"], "timed": False}


def measured_best(rows: list[dict], min_gain: float = 1.0) -> dict:
    """rows sorted by measured tokens/s -> the one to use: the fastest, unless plain decoding was
    timed beside it and the fastest drafting row beats it by less than `min_gain` (then plain).
    The candidates are timed on a few calibration prompts; served prompts can accept fewer
    tokens, so a margin keeps a tree that only just wins there from losing in service."""
    best = rows[0]
    if min_gain <= 1.0:
        return best  # sorted: nothing timed faster
    plain = next((r for r in rows if is_plain(r)), None)
    if plain is None or best is plain or best["measured_tokens_per_s"] >= min_gain * plain["measured_tokens_per_s"]:
        return best
    return plain


def validate(target: Target, drafter: EagleDrafter, ranked: list[dict], costs: CostModel, fixed: TreeShape,
             prompts: list[list[int]], search: TreeSearchConfig, ngram: NgramProposer | None,
             backend=None, params: SamplingParams = SamplingParams()) -> list[dict]:
    """The model's best rows (candidates_to_time), timed in the decoding loop and re-ranked by measured
    tokens/s (tokens over seconds, as the benchmark measures it), with plain decoding timed in
    the same interleaved runs when the fixed fields allow it. The model prices each part of a
    round on its own; on a CPU a small tree's round can cost more than its parts add up to, so
    the model may rank a tree above plain decoding that is slower in the loop; the measured
    ranking decides. params: the sampling the rows were ranked for (their tau is its expectation)."""
    rows = candidates_to_time(ranked, fixed)
    candidates = []
    for row in rows:
        chain = int(row.get("ngram_tokens", 0))
        proposer = replace(ngram, max_tokens=chain) if ngram is not None and chain else None
        candidates.append((TreeShape(**row["shape"]), proposer))
    timings = decode_timings(target, drafter, prompts, search.validate_new_tokens, candidates, backend, params)
    for row, timing in zip(rows, timings):
        rounds, seconds = max(timing["rounds"], 1), max(timing["seconds"], 1e-9)
        row.update(measured_tokens_per_s=timing["tokens"] / seconds, measured_tau=timing["tokens"] / rounds,
                   measured_round_ms=1000 * seconds / rounds)
    cap_at_tau(rows)
    return sorted(rows, key=lambda r: -r["measured_tokens_per_s"])


def cap_at_tau(rows: list[dict]) -> None:
    """A round scores its root and its drafts in one forward, so it costs at least a plain step: no drafting row
    can decode faster than its measured tau times plain decoding's speed, timed beside it. A row timed faster
    than that was timed in a faster minute of the machine; it is set to the bound (and marked `capped`), so that
    a drafter that rarely drafts (an n-gram chain at tau near 1 can time well above plain decoding on a drifting
    machine) does not win on noise against one that accepts more."""
    plain = next((r for r in rows if is_plain(r)), None)
    if plain is None:
        return
    for row in rows:
        bound = row["measured_tau"] * plain["measured_tokens_per_s"]
        if row is not plain and row["measured_tokens_per_s"] > bound:
            row.update(measured_tokens_per_s=bound, capped=True)
