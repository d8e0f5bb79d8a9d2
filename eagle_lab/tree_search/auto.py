"""Hardware-aware tree shape (`tree=auto`): pick depth, top-k and size for this device.

Speculative decoding pays off only when the tokens a round accepts outweigh its cost, and
both sides depend on the hardware and the head: on a GPU scoring 60 tokens costs about as
much as one, on a 2-core CPU several times more. So:
  1. measure the target's forward cost for K scored tokens after a realistic prefix, and
     the drafter's cost per tree level for each frontier width k;
  2. record one greedy run with a large tree on calibration prompts, keeping every draft
     candidate and the output;
  3. replay each candidate shape (depth, k, total) on the recorded candidates: under greedy
     verification a tree accepts the longest path that follows the output, so its accept
     length is known exactly for the recorded rounds;
  4. rank the shapes by (accepted + 1) / (target cost + draft cost + overhead), then time the
     best few in the decoding loop itself, plain decoding among them, each prompt decoded by
     all of them in turn, and choose by measured tokens/s (the model prices a round's parts
     one by one; a small tree's round on a CPU can cost more than they add up to).
"Do not draft" competes like for like: it is priced by timing the no-draft path itself (the
same loop with the head switched off), not by a model. The per-round overhead of tree rounds
(verification, cache compaction, bookkeeping) is fitted as a line in the tree size through
two timed shapes, the recording's and a small probe.
The result is cached per target, head, device and dtype. Fixed `tree.depth/topk/total_tokens`
values (non-zero) are kept; only the free ones are searched.

Hybrid drafting (the drafter has an n-gram proposer): the recording also keeps, for every
round, the chain the proposer copies from the committed sequence, and the proposer's time.
Replay merges the first L chain tokens into each candidate tree as the drafter would: the
round accepts the longer of the tree's and the chain's agreement with the output, and
scores the tree's tokens plus the chain tokens the tree did not already hold, which the
cost model charges round by round (target(K + 1) with the extra tokens in K, the overhead
slope on them, plus the proposer's time). The search covers chain lengths L up to
`ngram.max_tokens`, L = 0 (n-gram off), and "n-gram only": no head run, the root plus the
chain, priced as target(K + 1) plus the measured cost of such a round beyond its forward (timed
n-gram-only rounds: proposing, verification, compaction; it shares none of the head rounds'
tree overhead), or as the measured no-draft round when the chain is empty. So a target without
a useful head can still speculate where copying pays.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from eagle_lab.draft import Candidates, EagleDrafter, TreeShape
from eagle_lab.embedded import cache_root
from eagle_lab.generate import Stopper, speculative_decode
from eagle_lab.ngram import NgramProposer
from eagle_lab.sampling import SamplingParams
from eagle_lab.target import Target

log = logging.getLogger(__name__)
K_GRID = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
NGRAM_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16)  # chain lengths searched, up to ngram.max_tokens
VALIDATE_TOP = 3  # the model's best shapes timed in the decoding loop before one is chosen
CALIBRATION_PROMPTS = (
    "Explain how a hash table works, with an example in Python.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of inflation? Answer in a few paragraphs.",
    "Give me a step-by-step plan to learn linear algebra in a month.",
)


@dataclass
class TreeSearchConfig:
    depths: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 7])
    topks: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8])
    totals: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 48, 60])
    record_shape: tuple[int, int, int] = (7, 8, 64)  # the largest shape searched: its candidates contain all others'
    probe_shape: tuple[int, int, int] = (2, 2, 4)  # a small shape, timed to fit the overhead's slope
    new_tokens: int = 48
    context: int = 256
    validate_new_tokens: int = 128  # per prompt when the best shapes are timed against plain decoding


@dataclass
class CostModel:
    target_ms: dict[int, float]  # K scored tokens -> ms
    level_ms: dict[int, float]  # frontier width k -> ms per tree level below the first
    first_level_ms: float  # feeding the accepted pairs + the root's children
    overhead_ms: float  # per tree round, outside the two models (verification, bookkeeping)...
    overhead_per_token_ms: float = 0.0  # ... plus this much per scored draft token
    plain_ms: float = 0.0  # measured: one round of the no-draft path (one token); 0 = not measured
    ngram_ms: float = 0.0  # measured: proposing one n-gram chain (hybrid drafting only)
    ngram_round_ms: float | None = None  # measured: an n-gram-only round beyond target(K); None = not measured

    def target(self, k: int) -> float:
        keys = sorted(self.target_ms)
        if k <= keys[0]:
            return self.target_ms[keys[0]]
        for lo, hi in zip(keys, keys[1:]):
            if k <= hi:
                w = (k - lo) / (hi - lo)
                return (1 - w) * self.target_ms[lo] + w * self.target_ms[hi]
        lo, hi = keys[-2], keys[-1]  # extrapolate linearly past the grid
        return self.target_ms[hi] + (k - hi) * (self.target_ms[hi] - self.target_ms[lo]) / (hi - lo)

    def round_ms(self, shape: TreeShape, extra: int = 0, ngram: bool = False) -> float:
        """One round of `shape` that also scores `extra` n-gram tokens (ngram: a chain was proposed)."""
        propose = self.ngram_ms if ngram else 0.0
        if shape.depth == 0 and extra == 0:  # no draft: one token per round, the head is not run at all
            return (self.plain_ms if self.plain_ms > 0 else self.target(1)) + propose
        if shape.depth == 0 and self.ngram_round_ms is not None:  # n-gram only, priced by its own timed rounds
            return self.target(extra + 1) + self.ngram_round_ms  # (the proposing is in the measured part)
        scored = shape.total_tokens + extra
        return self.model_ms(shape, extra) + self.overhead_ms + self.overhead_per_token_ms * scored + propose

    def row_ms(self, row: dict) -> float:
        """Mean ms per round of a replayed row: with n-gram branches, priced round by round by the
        tokens the chain added (a round pays for every token it scores)."""
        shape = TreeShape(**row["shape"])
        if not row.get("ngram_tokens"):
            return self.round_ms(shape)
        extra = {int(k): v for k, v in row["extra"].items()}
        return sum(v * self.round_ms(shape, k, ngram=True) for k, v in extra.items()) / max(sum(extra.values()), 1)

    def model_ms(self, shape: TreeShape, extra: int = 0) -> float:
        """The two models' share of a tree round: scoring total_tokens + extra + 1, drafting depth levels
        (none at depth 0: an n-gram-only round does not run the head)."""
        draft = 0.0
        if shape.depth > 0:
            level = self.level_ms.get(shape.topk) or max(self.level_ms.values())
            draft = self.first_level_ms + (shape.depth - 1) * level
        return self.target(shape.total_tokens + extra + 1) + draft


@dataclass
class Recording:
    rounds: list[tuple[Candidates, list[int]]]  # candidates, then the output tokens after the root
    chains: list[list[int]] | None = None  # per round: the n-gram chain proposed (hybrid drafting only)
    ngram_ms: float = 0.0  # median time to propose one chain


def _timed(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


@torch.no_grad()
def measure_target_costs(target: Target, context: int, grid=K_GRID) -> dict[int, float]:
    from eagle_lab.cache import truncate

    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, target.vocab_size, (1, context), generator=g).to(target.device)
    cache = target.new_cache()
    target.forward(prefix, cache)
    costs = {}
    for k in grid:
        tokens = torch.randint(0, target.vocab_size, (1, k), generator=g).to(target.device)
        mask = torch.ones(k, k, dtype=torch.bool, device=target.device).tril()
        positions = torch.arange(context, context + k, device=target.device)[None]

        def score():
            out = target.forward(tokens, cache, positions, mask)
            target.logits(out.features[0])
            truncate(cache, context)

        score()  # warm-up
        costs[k] = _timed(score)
    return costs


@torch.no_grad()
def measure_draft_costs(drafter: EagleDrafter, target: Target, topks, context: int) -> tuple[float, dict[int, float]]:
    g = torch.Generator().manual_seed(1)
    sequence = torch.randint(0, target.vocab_size, (context,), generator=g).to(target.device)
    out = target.forward(sequence[None], layer_ids=drafter.feature_layers)
    feats = (out.layer_features if out.layer_features is not None else out.features)[0]  # [T, F]
    original = drafter.shape

    def draft(depth: int, k: int) -> float:
        drafter.shape = TreeShape(depth, k, k * depth)

        def once():
            drafter.reset()
            drafter._commit(sequence[:-3], feats[: context - 4])  # a committed prefix, as mid-generation
            drafter.draft(sequence, feats[context - 4: context - 1], max_depth=depth)

        once()
        return _timed(once)

    first, levels = [], {}
    for k in topks:
        one, three = draft(1, k), draft(3, k)
        levels[k] = max((three - one) / 2, 0.0)
        first.append(one)
    drafter.shape = original
    drafter.reset()
    # the commit of the prefix was timed too: remove it by timing a depth-0 draft
    drafter.shape = TreeShape(0, 1, 0)

    def commit_only():
        drafter.reset()
        drafter._commit(sequence[:-3], feats[: context - 4])

    prefix_ms = _timed(commit_only)
    drafter.shape = original
    drafter.reset()
    return max(statistics.median(first) - prefix_ms, 0.0), levels


def timed_rounds(target: Target, drafter: EagleDrafter, prompts: list[list[int]], new_tokens: int,
                 shape: TreeShape) -> float:
    """Median ms per round of greedy runs with `shape` (depth 0: the no-draft path)."""
    saved, drafter.shape = drafter.shape, shape
    round_ms: list[float] = []
    try:
        for ids in prompts:
            decoder = speculative_decode(target, drafter, torch.tensor(ids, device=target.device), SamplingParams(),
                                         Stopper(target.tokenizer, new_tokens, set()))
            stamps = [time.perf_counter() for _ in decoder]  # the prefill, then one chunk per round
            round_ms += [1000 * (b - a) for a, b in zip(stamps, stamps[1:])]
    finally:
        drafter.shape = saved
    return statistics.median(round_ms) if round_ms else 0.0


def timed_ngram_rounds(target: Target, drafter: EagleDrafter, prompts: list[list[int]], new_tokens: int,
                       ngram: NgramProposer, costs: CostModel) -> float | None:
    """Median ms an n-gram-only round (no head run, the root plus a chain) costs beyond its target
    forward, target(tree size): proposing, verification, compaction, bookkeeping. None when no
    round of the calibration prompts found a chain."""
    saved_shape, saved_ngram, original_draft = drafter.shape, drafter.ngram, drafter.draft
    sizes: list[int] = []

    def sized_draft(sequence, new_features, max_depth):
        tree = original_draft(sequence, new_features, max_depth)
        sizes.append(tree.size)
        return tree

    drafter.shape, drafter.ngram, drafter.draft = TreeShape(0, 0, 0), ngram, sized_draft
    beyond: list[float] = []
    try:
        for ids in prompts:
            sizes.clear()
            decoder = speculative_decode(target, drafter, torch.tensor(ids, device=target.device), SamplingParams(),
                                         Stopper(target.tokenizer, new_tokens, set()))
            stamps = [time.perf_counter() for _ in decoder]  # the prefill, then one chunk per round
            for size, (a, b) in zip(sizes, zip(stamps, stamps[1:])):
                if size > 1:  # a chain was merged
                    beyond.append(1000 * (b - a) - costs.target(size))
    finally:
        drafter.shape, drafter.ngram, drafter.draft = saved_shape, saved_ngram, original_draft
    return max(statistics.median(beyond), 0.0) if beyond else None


def record(target: Target, drafter: EagleDrafter, prompts: list[list[int]], new_tokens: int,
           ngram: NgramProposer | None = None):
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
                                         Stopper(target.tokenizer, new_tokens, set()))
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


def row_ms(row: dict, costs: CostModel) -> float:
    """Mean ms per round of a replayed row (costs.row_ms; batch sizes price rows their own way)."""
    return costs.row_ms(row)


def choose(shapes: list[dict], costs: CostModel, fixed: TreeShape) -> tuple[TreeShape, list[dict]]:
    """The fastest shape among those matching the fixed (non-zero) fields (ranked[0] also says the
    n-gram chain length chosen, "ngram_tokens", when the rows were replayed with chains)."""
    ranked = []
    for row in shapes:
        shape = TreeShape(**row["shape"])
        if shape.depth == 0 and (fixed.depth or fixed.topk or fixed.total_tokens):
            continue
        if (fixed.depth and shape.depth != fixed.depth) or (fixed.topk and shape.topk != fixed.topk) or (
                fixed.total_tokens and shape.total_tokens != fixed.total_tokens):
            continue
        round_ms = row_ms(row, costs)
        ranked.append({**row, "round_ms": round_ms, "tokens_per_s": 1000 * row["tau"] / round_ms})
    if not ranked:
        raise ValueError(f"no searched tree shape matches the fixed values {fixed}")
    ranked.sort(key=lambda r: -r["tokens_per_s"])
    return TreeShape(**ranked[0]["shape"]), ranked


def _fingerprint(target: Target, drafter: EagleDrafter, search: TreeSearchConfig,
                 ngram: NgramProposer | None = None) -> str:
    head = drafter.head
    weights = float(sum(p.detach().float().abs().sum() for p in head.parameters()))
    fields = {"target": target.name, "device": str(target.device), "dtype": str(target.dtype),
              "head": asdict(head.arch), "weights": round(weights, 3), "search": asdict(search)}
    if ngram is not None:  # only then: summaries cached without n-gram stay valid
        fields["ngram"] = {**asdict(ngram), "lengths": ngram_lengths(ngram), "priced": "timed-ngram-rounds"}
    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def calibrate(target: Target, drafter: EagleDrafter, prompts: list[list[int]], search: TreeSearchConfig,
              ngram: NgramProposer | None = None) -> dict:
    """Measure costs and record acceptance; returns the cacheable summary.
    The drafter must have no n-gram proposer attached (every timing is of the head's trees);
    ngram: record its chains and replay them too."""
    target_ms = measure_target_costs(target, search.context)
    first_ms, level_ms = measure_draft_costs(drafter, target, search.topks, search.context)
    saved = drafter.shape
    big, small = TreeShape(*search.record_shape), TreeShape(*search.probe_shape)
    drafter.shape = big
    try:
        recording, big_ms = record(target, drafter, prompts, search.new_tokens, ngram)
    finally:
        drafter.shape = saved
    small_ms = timed_rounds(target, drafter, prompts, search.new_tokens, small)
    plain_ms = timed_rounds(target, drafter, prompts, search.new_tokens, TreeShape(0, 0, 0))
    models = CostModel(target_ms, level_ms, first_ms, 0.0)
    # overhead = measured - modelled, as a line in the tree size through the two timed shapes
    extra_big, extra_small = big_ms - models.model_ms(big), small_ms - models.model_ms(small)
    slope = max((extra_big - extra_small) / max(big.total_tokens - small.total_tokens, 1), 0.0)
    intercept = max(extra_small - slope * small.total_tokens, 0.0)
    costs = CostModel(target_ms, level_ms, first_ms, intercept, slope, plain_ms, recording.ngram_ms)
    if ngram is not None:
        costs.ngram_round_ms = timed_ngram_rounds(target, drafter, prompts, search.new_tokens, ngram, costs)
    return {"cost_model": asdict(costs), "rounds": len(recording.rounds),
            "shapes": replay_all(recording, search, ngram_lengths(ngram)),
            "measured_round_ms": {"record": big_ms, "probe": small_ms, "no_draft": plain_ms}}


def calibration(target: Target, drafter: EagleDrafter, fixed: TreeShape, prompts: list[list[int]] | None = None,
                search: TreeSearchConfig | None = None, cache_dir: Path | None = None) -> tuple[dict, CostModel, Path]:
    """The measured summary (shapes with their tau, costs) for this target, head and device:
    read from the cache, else measured once and cached. Returns (summary, cost model, cache file)."""
    search = search or TreeSearchConfig()
    for name, values in (("depth", search.depths), ("topk", search.topks), ("total_tokens", search.totals)):
        if getattr(fixed, name) and getattr(fixed, name) not in values:
            values.append(getattr(fixed, name))
    cache_dir = cache_dir or cache_root() / "tree_auto"
    ngram = drafter.ngram
    path = cache_dir / f"{target.name}-{_fingerprint(target, drafter, search, ngram)}.json"
    if path.is_file():
        summary = json.loads(path.read_text())
    else:
        log.info("tree=auto: measuring costs and acceptance on %s (once; cached in %s)", target.device, path)
        prompts = prompts if prompts is not None else calibration_prompts(target)
        drafter.ngram = None  # calibrate times the head's trees alone; chains are recorded beside them
        try:
            summary = calibrate(target, drafter, prompts, search, ngram)
        finally:
            drafter.ngram = ngram
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2))
    cm = summary["cost_model"]
    costs = CostModel({int(k): v for k, v in cm["target_ms"].items()}, {int(k): v for k, v in cm["level_ms"].items()},
                      cm["first_level_ms"], cm["overhead_ms"], cm["overhead_per_token_ms"], cm["plain_ms"],
                      cm.get("ngram_ms", 0.0), cm.get("ngram_round_ms"))
    return summary, costs, path


def calibration_prompts(target: Target) -> list[list[int]]:
    from eagle_lab.prompts import encode_prompt

    return [encode_prompt(target.tokenizer, p, chat=True) for p in CALIBRATION_PROMPTS]


def decode_timings(target: Target, drafter: EagleDrafter, prompts: list[list[int]], new_tokens: int,
                   candidates: list[tuple[TreeShape, NgramProposer | None]]) -> list[dict]:
    """Greedy decoding with each candidate (tree shape, n-gram proposer or None; depth 0 and no
    proposer = the no-draft path): tokens, rounds and seconds summed over the prompts, prefills
    not counted. Each prompt is decoded by every candidate in turn, in an order rotated from one
    prompt to the next, so a drift in the machine's speed (other work, clocks) falls on all of
    them alike instead of on whichever was timed last."""
    totals = [{"tokens": 0, "rounds": 0, "seconds": 0.0} for _ in candidates]
    saved_shape, saved_ngram = drafter.shape, drafter.ngram
    try:
        for p, ids in enumerate(prompts):
            for c in [(p + i) % len(candidates) for i in range(len(candidates))]:
                drafter.shape, drafter.ngram = candidates[c]
                decoder = speculative_decode(target, drafter, torch.tensor(ids, device=target.device),
                                             SamplingParams(), Stopper(target.tokenizer, new_tokens, set()))
                stamps, tokens = [], 0
                for i, chunk in enumerate(decoder):  # the prefill's token, then one chunk per round
                    stamps.append(time.perf_counter())
                    tokens += len(chunk) if i else 0
                totals[c]["tokens"] += tokens
                totals[c]["rounds"] += len(stamps) - 1
                totals[c]["seconds"] += stamps[-1] - stamps[0]
    finally:
        drafter.shape, drafter.ngram = saved_shape, saved_ngram
    return totals


def with_plain(rows: list[dict], fixed: TreeShape) -> list[dict]:
    """Copies of `rows`, plus plain decoding (no draft, no chain) when the fixed fields allow it
    and it is not among them: the candidates timed against each other in the loop."""
    rows = [dict(row) for row in rows]
    free = not (fixed.depth or fixed.topk or fixed.total_tokens)
    if free and not any(r["shape"]["depth"] == 0 and not r.get("ngram_tokens") for r in rows):
        rows.append({"shape": asdict(TreeShape(0, 0, 0)), "tau": 1.0})
    return rows


def validate(target: Target, drafter: EagleDrafter, ranked: list[dict], costs: CostModel, fixed: TreeShape,
             prompts: list[list[int]], search: TreeSearchConfig, ngram: NgramProposer | None) -> list[dict]:
    """The model's best VALIDATE_TOP rows, timed in the decoding loop and re-ranked by measured
    tokens/s (tokens over seconds, as the benchmark measures it), with plain decoding timed in
    the same interleaved runs when the fixed fields allow it. The model prices each part of a
    round on its own; on a CPU a small tree's round can cost more than its parts add up to, so
    the model may rank a tree above plain decoding that is slower in the loop; the measured
    ranking decides."""
    rows = with_plain(ranked[:VALIDATE_TOP], fixed)
    candidates = []
    for row in rows:
        chain = int(row.get("ngram_tokens", 0))
        proposer = replace(ngram, max_tokens=chain) if ngram is not None and chain else None
        candidates.append((TreeShape(**row["shape"]), proposer))
    timings = decode_timings(target, drafter, prompts, search.validate_new_tokens, candidates)
    for row, timing in zip(rows, timings):
        rounds, seconds = max(timing["rounds"], 1), max(timing["seconds"], 1e-9)
        row.update(measured_tokens_per_s=timing["tokens"] / seconds, measured_tau=timing["tokens"] / rounds,
                   measured_round_ms=1000 * seconds / rounds)
    return sorted(rows, key=lambda r: -r["measured_tokens_per_s"])


def validated(target: Target, drafter: EagleDrafter, summary: dict, path: Path, ranked: list[dict], costs: CostModel,
              fixed: TreeShape, prompts: list[list[int]] | None, search: TreeSearchConfig,
              ngram: NgramProposer | None) -> list[dict]:
    """validate()'s ranking for these fixed fields: read from the calibration file, else timed
    once and added to it."""
    key = f"d{fixed.depth}-k{fixed.topk}-n{fixed.total_tokens}"
    done = summary.setdefault("validated", {})
    if key not in done:
        prompts = prompts if prompts is not None else calibration_prompts(target)
        done[key] = validate(target, drafter, ranked, costs, fixed, prompts, search, ngram)
        path.write_text(json.dumps(summary, indent=2))
    return done[key]


def auto_tree(target: Target, drafter: EagleDrafter, fixed: TreeShape, prompts: list[list[int]] | None = None,
              search: TreeSearchConfig | None = None, cache_dir: Path | None = None) -> TreeShape:
    """The fastest shape for this target, head and device (measured once, cached); sets it
    on the drafter. fixed: non-zero fields are kept as given.

    With an n-gram proposer on the drafter (hybrid drafting), its chain length is chosen too
    (up to its max_tokens): the drafter's proposer is replaced by one with the chosen length,
    or removed when merging chains does not pay."""
    ngram = drafter.ngram
    search = search or TreeSearchConfig()
    summary, costs, path = calibration(target, drafter, fixed, prompts, search, cache_dir)
    _, ranked = choose(summary["shapes"], costs, fixed)
    measured = validated(target, drafter, summary, path, ranked, costs, fixed, prompts, search, ngram)
    best = measured[0]
    chosen, chain = TreeShape(**best["shape"]), int(best.get("ngram_tokens", 0))
    plain = next((r for r in measured if r["shape"]["depth"] == 0 and not r.get("ngram_tokens")), None)
    first = next(r for r in measured if r["shape"] == ranked[0]["shape"]
                 and r.get("ngram_tokens", 0) == ranked[0].get("ngram_tokens", 0))
    log.info("tree=auto chose depth=%d topk=%d total_tokens=%d%s: %.1f tok/s timed in the loop (tau %.2f; model: "
             "%.1f tok/s; the model's first choice timed %.1f)%s (costs: %s)",
             chosen.depth, chosen.topk, chosen.total_tokens,
             f" + n-gram chains of {chain} tokens" if chain else " (no n-gram branches)" if ngram else "",
             best["measured_tokens_per_s"], best.get("measured_tau", best["tau"]),
             best.get("tokens_per_s", best["measured_tokens_per_s"]), first["measured_tokens_per_s"],
             f" vs {plain['measured_tokens_per_s']:.1f} tok/s without drafting, timed beside it" if plain else "",
             path)
    drafter.ngram = replace(ngram, max_tokens=chain) if ngram is not None and chain else None
    if chosen.depth == 0 and chain:
        log.info("tree=auto: n-gram drafting alone (no head run) is fastest here")
    elif chosen.depth == 0:
        log.warning("tree=auto: with this head no draft tree pays for itself on %s; decoding without drafts "
                    "(train a better head, or set tree.depth/topk/total_tokens to force one)", target.device)
    drafter.shape = chosen
    return chosen
