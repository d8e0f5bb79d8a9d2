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

Sampling: the recording also keeps the target's probability of each candidate's token at its
parent, wherever the recorded tree scored the parent, at a few temperatures; replay turns them
into each shape's expected accept length under sampling verification (expected_accept).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from eagle_lab.decoding.generate import Stopper, speculative_decode
from eagle_lab.decoding.sampling import SamplingParams, target_probs, temperature_key
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.growth import Candidates, TreeShape
from eagle_lab.drafters.ngram import NgramProposer, common_prefix
from eagle_lab.models.target import Target
from eagle_lab.tree_search.space import TreeSearchConfig

NGRAM_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16)  # chain lengths searched, up to ngram.max_tokens


Path = tuple[int, ...]  # draft tokens after the root, from the root down to a node


@dataclass
class Recording:
    rounds: list[tuple[Candidates, list[int]]]  # candidates, then the output tokens after the root
    chains: list[list[int]] | None = None  # per round: the n-gram chain proposed (hybrid drafting only)
    ngram_ms: float = 0.0  # median time to propose one chain
    # per round, per sampling temperature: a node's path -> the target's probability of the node's
    # token at its parent, for every candidate (and chain token) whose parent the recorded tree scored
    path_probs: list[dict[float, dict[Path, float]]] | None = None


def candidate_paths(cands: Candidates) -> list[Path]:
    """Each candidate's path from the root (parents precede children in candidate order)."""
    paths: list[Path] = []
    for parent, token in zip(cands.parents.tolist(), cands.tokens.tolist()):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return paths


def node_paths(tree) -> list[Path]:
    """Each tree node's path from the root (the root's is empty)."""
    paths: list[Path] = [()]
    for parent, token in zip(tree.parents.tolist()[1:], tree.tokens.tolist()[1:]):
        paths.append(paths[parent] + (token,))
    return paths


def scored_probs(cands: Candidates, chain: list[int] | None, tree, logits: torch.Tensor,
                 temperatures: list[float]) -> dict[float, dict[Path, float]]:
    """The target's probability of each candidate's (and chain prefix's) last token at its parent, at
    each temperature, where the recorded tree scored that parent. logits: [N, V] at the tree's nodes."""
    row_of = {path: row for row, path in enumerate(node_paths(tree))}
    wanted: dict[Path, tuple[int, int]] = {}  # path -> (parent's logits row, token)
    for path in candidate_paths(cands):
        if path[:-1] in row_of:
            wanted[path] = (row_of[path[:-1]], path[-1])
    for end in range(1, len(chain or ()) + 1):
        path = tuple(chain[:end])
        if path[:-1] not in row_of:
            break
        wanted[path] = (row_of[path[:-1]], path[-1])
    if not wanted:
        return {t: {} for t in temperatures}
    parents = sorted({row for row, _ in wanted.values()})
    index = {row: i for i, row in enumerate(parents)}
    rows = torch.tensor([index[row] for row, _ in wanted.values()])  # [W]
    tokens = torch.tensor([token for _, token in wanted.values()])  # [W]
    picked = logits[parents].float()  # [P, V]
    out = {}
    for temperature in temperatures:
        probs = target_probs(picked, SamplingParams(temperature))[rows, tokens].tolist()  # [W]
        out[temperature] = dict(zip(wanted, probs))
    return out


class RoundRecorder:
    """A RoundObserver for record(): after each drafting round, its candidates, where the output after
    its root starts, the n-gram chain the proposer would merge and the target's probabilities along
    the scored paths. Its own time is kept apart (`spent`), so the recording's round times stay the loop's."""

    def __init__(self, drafter: EagleDrafter, ngram: NgramProposer | None, temperatures: list[float]):
        self.drafter, self.ngram, self.temperatures = drafter, ngram, temperatures
        self.rounds: list[tuple[Candidates, int, int]] = []  # candidates, prompt index, sequence length
        self.chains: list[list[int]] = []
        self.propose_ms: list[float] = []
        self.path_probs: list[dict[float, dict[Path, float]]] = []
        self.spent = 0.0
        self.prompt: list[int] = []
        self.tokens: list[int] = []  # emitted so far for the prompt being decoded
        self.prompt_index = 0

    def phase(self, name: str, seconds: float, result) -> None:
        cands = self.drafter.last_candidates
        if name != "committed" or cands is None or result.tree.size <= 1:
            return
        start = time.perf_counter()
        sequence = self.prompt + self.tokens  # the committed sequence the round drafted after (root last)
        self.rounds.append((cands, self.prompt_index, len(sequence)))
        chain = None
        if self.ngram is not None:
            tick = time.perf_counter()
            chain = self.ngram.propose(torch.tensor(sequence))
            self.propose_ms.append(1000 * (time.perf_counter() - tick))
            self.chains.append(chain)
        if self.temperatures:
            self.path_probs.append(scored_probs(cands, chain, result.tree, result.scored.logits, self.temperatures))
        self.spent += time.perf_counter() - start


def record(target: Target, drafter: EagleDrafter, prompts: list[list[int]], new_tokens: int,
           ngram: NgramProposer | None = None, backend=None, temperatures: list[float] = ()):
    """Greedy runs with a large tree; returns (Recording, measured ms per round).
    ngram: also record the chain it proposes each round (not merged: the timing stays the tree's).
    temperatures: also record the target's probabilities along the scored paths at each (sampling replay)."""
    recorder = RoundRecorder(drafter, ngram, list(temperatures))
    outputs, round_ms = [], []
    for index, ids in enumerate(prompts):
        recorder.prompt, recorder.tokens, recorder.prompt_index = list(ids), [], index
        prompt = torch.tensor(ids, device=target.device)
        decoder = speculative_decode(target, drafter, prompt, SamplingParams(),
                                     Stopper(target.tokenizer, new_tokens, set()), backend=backend, observer=recorder)
        stamps = []
        for chunk in decoder:  # the first chunk is the prefill, then one chunk per round
            recorder.tokens.extend(chunk)
            stamps.append((time.perf_counter(), recorder.spent))
        round_ms += [1000 * ((b - a) - (b_spent - a_spent)) for (a, a_spent), (b, b_spent) in zip(stamps, stamps[1:])]
        outputs.append((prompt.numel(), recorder.tokens))
    replay = []
    for cands, prompt_index, seq_len in recorder.rounds:
        prompt_len, tokens = outputs[prompt_index]
        replay.append((cands, tokens[seq_len - prompt_len:]))  # greedy continuation after the root
    recording = Recording(replay, recorder.chains if ngram is not None else None,
                          statistics.median(recorder.propose_ms) if recorder.propose_ms else 0.0,
                          recorder.path_probs if temperatures else None)
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


def expected_accept(paths: list[Path], probs: dict[Path, float], chain: list[int] = ()) -> float:
    """Draft tokens a tree accepts on average under sampling verification (verify.py): at each accepted
    node the walk draws x ~ p and descends to the child holding x, so a node is reached with the product
    of p along its path, and the expected accept length is the sum of that over the tree's nodes.
    paths: the tree's nodes (closed under parents); chain: merged after them (its new prefixes count
    too). A probability the recording lacks counts as 0, so the figure is a lower bound."""
    reach: dict[Path, float] = {(): 1.0}
    total = 0.0
    for path in sorted(paths, key=len):
        reach[path] = reach.get(path[:-1], 0.0) * probs.get(path, 0.0)
        total += reach[path]
    for end in range(1, len(chain) + 1):
        path = tuple(chain[:end])
        if path not in reach:
            reach[path] = reach[path[:-1]] * probs.get(path, 0.0)
            total += reach[path]
    return total


def replay_all(recording: Recording, search: TreeSearchConfig, lengths: list[int] = ()) -> list[dict]:
    """Accept length (tau, bonus included) of every grid shape on the recorded rounds.
    Shape (0, 0, 0) is "do not draft": chosen when no tree pays for itself here.

    lengths: n-gram chain lengths to merge (hybrid drafting; needs recording.chains). Each
    shape then also gets one row per length L, with "ngram_tokens": L and "extra": how many
    rounds added how many chain tokens ({added: rounds}); depth 0 with L > 0 is n-gram alone.
    With recording.path_probs, each row also has "sampled_tau": {temperature: expected tau under
    sampling verification} (expected_accept).
    """
    shapes = [TreeShape(0, 0, 0)]
    for depth in search.depths:
        for topk in search.topks:
            for total in search.totals:
                if total > topk * depth or total < min(depth, topk):
                    continue
                shapes.append(TreeShape(depth, topk, total))
    paths = [candidate_paths(cands) for cands, _ in recording.rounds]
    probs = recording.path_probs
    count = max(len(recording.rounds), 1)

    def sampled(kept: list[list[Path]], chains: list[list[int]] | None = None) -> dict[str, float]:
        if probs is None:
            return {}
        return {temperature_key(t): 1 + sum(expected_accept(k, p[t], c) for k, p, c in
                                            zip(kept, probs, chains or [()] * len(kept))) / count
                for t in search.sampled_temperatures}

    rows = []
    for shape in shapes:
        trees = [ReplayTree(c, shape) for c, _ in recording.rounds]
        kept = [[p[i] for i in tree.chosen] for tree, p in zip(trees, paths)]
        accepted = [tree.follow(out) for tree, (_, out) in zip(trees, recording.rounds)]
        rows.append({"shape": asdict(shape), "tau": 1 + sum(accepted) / count, "sampled_tau": sampled(kept)})
        for length in lengths:
            extra: dict[str, int] = {}
            accepted = []
            for tree, (_, out), chain in zip(trees, recording.rounds, recording.chains):
                count_accepted, added = simulate_hybrid(tree, out, chain[:length])
                accepted.append(count_accepted)
                extra[str(added)] = extra.get(str(added), 0) + 1
            rows.append({"shape": asdict(shape), "ngram_tokens": length, "tau": 1 + sum(accepted) / count,
                         "sampled_tau": sampled(kept, [chain[:length] for chain in recording.chains]),
                         "extra": extra})
    return rows
