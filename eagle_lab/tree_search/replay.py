"""Recording a run and replaying shapes on it (tree=auto): record one greedy run with a large tree
on calibration prompts, keeping every draft candidate and the output, then replay each candidate
shape (depth, k, total) on the recorded candidates: under greedy verification a tree accepts the
longest path that follows the output, so its accept length is known exactly for the recorded rounds.

Hybrid drafting (the drafter has an n-gram proposer): the recording also keeps, for every
round, the chain the proposer copies from the committed sequence, and the proposer's time.
Replay merges the first L chain tokens into each candidate tree as the drafter would: the
round accepts the longer of the tree's and the chain's agreement with the output, and
scores the tree's tokens plus the chain tokens the tree did not already hold (priced round by
round in costs.py). The search covers chain lengths L up to `ngram.max_tokens`, L = 0 (n-gram
off), and "n-gram only": no head run, the root plus the chain.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from eagle_lab.draft import Candidates, EagleDrafter, TreeShape
from eagle_lab.generate import Stopper, speculative_decode
from eagle_lab.ngram import NgramProposer
from eagle_lab.sampling import SamplingParams
from eagle_lab.target import Target
from eagle_lab.tree_search.space import TreeSearchConfig


NGRAM_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16)  # chain lengths searched, up to ngram.max_tokens


@dataclass
class Recording:
    rounds: list[tuple[Candidates, list[int]]]  # candidates, then the output tokens after the root
    chains: list[list[int]] | None = None  # per round: the n-gram chain proposed (hybrid drafting only)
    ngram_ms: float = 0.0  # median time to propose one chain


def record(target: Target, drafter: EagleDrafter, prompts: list[list[int]], new_tokens: int,
           ngram: NgramProposer | None = None, backend=None):
    """Greedy runs with a large tree; returns (Recording, measured ms per round).
    ngram: also record the chain it proposes each round (not merged: the timing stays the tree's)."""
    rounds: list[tuple[Candidates, int, int]] = []
    outputs, round_ms, chains, propose_ms = [], [], [], []
    original_draft = drafter.draft

    def recording_draft(sequence, new_features, max_depth):
        tree = original_draft(sequence, new_features, max_depth)
        if drafter.last_candidates is not None and tree.size > 1:
            rounds.append((drafter.last_candidates, len(outputs), int(sequence.numel())))
            if ngram is not None:
                start = time.perf_counter()
                chains.append(ngram.propose(sequence))
                propose_ms.append(1000 * (time.perf_counter() - start))
        return tree

    drafter.draft = recording_draft
    try:
        for ids in prompts:
            prompt = torch.tensor(ids, device=target.device)
            decoder = speculative_decode(target, drafter, prompt, SamplingParams(),
                                         Stopper(target.tokenizer, new_tokens, set()), backend=backend)
            tokens, stamps = [], []
            for chunk in decoder:  # the first chunk is the prefill, then one chunk per round
                tokens.extend(chunk)
                stamps.append(time.perf_counter())
            round_ms += [1000 * (b - a) for a, b in zip(stamps, stamps[1:])]
            outputs.append((prompt.numel(), tokens))
    finally:
        drafter.draft = original_draft
    replay = []
    for cands, prompt_index, seq_len in rounds:
        prompt_len, tokens = outputs[prompt_index]
        after_root = tokens[seq_len - prompt_len:]  # greedy continuation after the root
        replay.append((cands, after_root))
    recording = Recording(replay, chains if ngram is not None else None,
                          statistics.median(propose_ms) if propose_ms else 0.0)
    return recording, statistics.median(round_ms) if round_ms else 0.0


class ReplayTree:
    """The sub-tree a shape keeps of one round's recorded candidates (as the drafter selects it)."""

    def __init__(self, cands: Candidates, shape: TreeShape):
        scores, parents = cands.scores.tolist(), cands.parents.tolist()
        self.tokens = cands.tokens.tolist()
        self.children: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            self.children.setdefault(p, []).append(i)  # best first within each parent
        available = self.children.get(-1, [])[: shape.topk] if shape.depth else []
        frontier, kept = available, list(available)
        for _ in range(1, shape.depth):
            frontier = sorted(frontier, key=lambda i: -scores[i])[: shape.topk]
            level = [c for f in frontier for c in self.children.get(f, [])[: shape.topk]]
            kept += level
            frontier = level
        self.chosen = set(sorted(kept, key=lambda i: (-scores[i], i))[: shape.total_tokens])

    def follow(self, tokens: list[int]) -> int:
        """How many of `tokens` a walk down the kept tree from the root matches."""
        node, matched = -1, 0
        for token in tokens:
            nxt = [c for c in self.children.get(node, []) if c in self.chosen and self.tokens[c] == token]
            if not nxt:
                break
            node, matched = nxt[0], matched + 1
        return matched


def simulate_accept(cands: Candidates, after_root: list[int], shape: TreeShape) -> int:
    """Draft tokens a tree of `shape` would accept in this recorded round (greedy)."""
    return ReplayTree(cands, shape).follow(after_root)


def common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def simulate_hybrid(tree: ReplayTree, after_root: list[int], chain: list[int]) -> tuple[int, int]:
    """(accepted draft tokens, n-gram tokens added) when `chain` is merged into the kept tree.

    The merged tree's root paths are the tree's plus the chain's prefixes, so greedy
    verification accepts the longer of the two agreements with the output; the chain adds
    the tokens after its deepest agreement with the tree (merge_chain).
    """
    accepted = max(tree.follow(after_root), common_prefix(chain, after_root))
    return accepted, len(chain) - tree.follow(chain)


def ngram_lengths(proposer: NgramProposer | None) -> list[int]:
    """Chain lengths tree=auto searches for this proposer (none without one)."""
    if proposer is None:
        return []
    return sorted({n for n in NGRAM_TOKENS if n < proposer.max_tokens} | {proposer.max_tokens})


def replay_all(recording: Recording, search: TreeSearchConfig, lengths: list[int] = ()) -> list[dict]:
    """Accept length (tau, bonus included) of every grid shape on the recorded rounds.
    Shape (0, 0, 0) is "do not draft": chosen when no tree pays for itself here.

    lengths: n-gram chain lengths to merge (hybrid drafting; needs recording.chains). Each
    shape then also gets one row per length L, with "ngram_tokens": L and "extra": how many
    rounds added how many chain tokens ({added: rounds}); depth 0 with L > 0 is n-gram alone.
    """
    shapes = [TreeShape(0, 0, 0)]
    for depth in search.depths:
        for topk in search.topks:
            for total in search.totals:
                if total > topk * depth or total < min(depth, topk):
                    continue
                shapes.append(TreeShape(depth, topk, total))
    rows = []
    for shape in shapes:
        trees = [ReplayTree(c, shape) for c, _ in recording.rounds]
        accepted = [tree.follow(out) for tree, (_, out) in zip(trees, recording.rounds)]
        rows.append({"shape": asdict(shape), "tau": 1 + sum(accepted) / max(len(accepted), 1)})
        for length in lengths:
            extra: dict[str, int] = {}
            accepted = []
            for tree, (_, out), chain in zip(trees, recording.rounds, recording.chains):
                count, added = simulate_hybrid(tree, out, chain[:length])
                accepted.append(count)
                extra[str(added)] = extra.get(str(added), 0) + 1
            rows.append({"shape": asdict(shape), "ngram_tokens": length,
                         "tau": 1 + sum(accepted) / max(len(accepted), 1), "extra": extra})
    return rows
