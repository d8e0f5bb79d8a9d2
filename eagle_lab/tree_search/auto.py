"""Hardware-aware tree shape (`tree=auto`): pick depth, top-k and size for this device.

Speculative decoding pays off only when the tokens a round accepts outweigh its cost, and
both sides depend on the hardware and the head: on a GPU scoring 60 tokens costs about as
much as one, on a 2-core CPU several times more. So:
  1. measure the target's forward cost for K scored tokens after a realistic prefix, and
     the drafter's cost per tree level for each frontier width k (costs.py);
  2. record one greedy run with a large tree on calibration prompts, keeping every draft
     candidate and the output (replay.py);
  3. replay each candidate shape (depth, k, total) on the recorded candidates: under greedy
     verification a tree accepts the longest path that follows the output, so its accept
     length is known exactly for the recorded rounds (replay.py);
  4. rank the shapes by (accepted + 1) / (target cost + draft cost + overhead), then time the
     best few in the decoding loop itself, plain decoding among them, each prompt decoded by
     all of them in turn, and choose by measured tokens/s (the model prices a round's parts
     one by one; a small tree's round on a CPU can cost more than they add up to) (validate.py).
Sampled decoding accepts fewer tokens: the recording also keeps the target's probabilities along
the recorded tree at `search.sampled_temperatures`, replay prices each shape's expected accept
length there (replay.expected_accept), and each temperature a run uses gets a tree of its own,
ranked and timed at that temperature (`drafter.choices`; `EagleDrafter.select` picks per request).
"Do not draft" competes like for like: it is priced by timing the no-draft path itself (the
same loop with the head switched off), not by a model. The per-round overhead of tree rounds
(verification, cache compaction, bookkeeping) is fitted as a line in the tree size through
two timed shapes, the recording's and a small probe.
A quick calibration, for a short run on a device not yet calibrated (`tree.quick_below_tokens`),
times the two shapes and the best few in the loop on one prompt each, and skips the n-gram-only
rounds, in a fraction of the full calibration's time; the next long run (a bench, the server, a
long prompts file) replaces it with the full calibration.
The result is cached per target, head, device, dtype and the code that runs and times a round (its
syntax, not its docstrings: calibration_fingerprint). Fixed `tree.depth/topk/total_tokens`
values (non-zero) are kept; only the free ones are searched.

Hybrid drafting (the drafter has an n-gram proposer): the recording also keeps each round's
n-gram chain, and replay merges it into each candidate tree (replay.py), priced round by round
(costs.py). The search covers chain lengths L up to `ngram.max_tokens`, L = 0 (n-gram off), and
"n-gram only": no head run, the root plus the chain. So a target without a useful head can still
speculate where copying pays.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch

from eagle_lab.decoding.compiled import KERNEL_SOURCES
from eagle_lab.decoding.compiled import STEP_SOURCES as TARGET_STEP_SOURCES
from eagle_lab.decoding.graph_store import code_digest
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.head_step import STEP_SOURCES as HEAD_STEP_SOURCES
from eagle_lab.drafters.growth import TreeChoice, TreeShape
from eagle_lab.drafters.ngram import NgramProposer
from eagle_lab.models.embedded import cache_root
from eagle_lab.models.native import NATIVE, kernel_march
from eagle_lab.models.prompts import encode_prompt, has_chat_template
from eagle_lab.models.target import Target
from eagle_lab.tree_search.costs import (
    K_GRID,
    CostModel,
    largest_tree,
    measure_draft_costs,
    measure_target_costs,
    timed_ngram_rounds,
    timed_rounds,
)
from eagle_lab.tree_search.replay import ngram_lengths, record, replay_all
from eagle_lab.tree_search.space import TreeSearchConfig
from eagle_lab.tree_search.validate import VALIDATE_TOP, is_plain, measured_best, untimed, validate

log = logging.getLogger(__name__)
# what a timed round runs besides the models: the steps (their packages' sources, the code that calls them),
# the loop, the drafter
ROUND_CODE = (*TARGET_STEP_SOURCES, *HEAD_STEP_SOURCES, *KERNEL_SOURCES, "decoding/compiled.py",
              "decoding/graph_store.py", "drafters/eagle/head_runner.py", "decoding/static_rows.py",
              "decoding/round.py", "decoding/generate.py",
              "decoding/verify.py", "decoding/backend.py", "decoding/scoring.py", "decoding/static_cache.py",
              "drafters/eagle/drafter.py",
              "drafters/growth.py", "drafters/ngram.py",
              "tree_search/auto.py", "tree_search/costs.py", "tree_search/validate.py")  # and what measures it
CALIBRATION_PROMPTS = (
    "Explain how a hash table works, with an example in Python.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of inflation? Answer in a few paragraphs.",
    "Give me a step-by-step plan to learn linear algebra in a month.",
)


def fit_search(search: TreeSearchConfig, backend, max_context: int | None = None) -> TreeSearchConfig:
    """On a static backend, trees up to its largest bucket: larger ones would each compile a graph of
    their own, and the recording's candidates do not depend on how many of them are kept. A target with
    a short context (max_context) times its forwards after a prefix that leaves room for the largest tree."""
    buckets = getattr(backend, "buckets", None)
    if max_context is not None:
        room = max(buckets) if buckets else max(search.totals, default=1) + 1
        search = replace(search, context=max(1, min(search.context, max_context - room)))
    if not buckets:
        return search
    cap = max(buckets)
    depth, topk, total = search.record_shape
    return replace(search, totals=[t for t in search.totals if t < cap],
                   record_shape=(depth, topk, min(total, cap - 1)))


def row_ms(row: dict, costs: CostModel) -> float:
    """Mean ms per round of a replayed row (costs.row_ms; batch sizes price rows their own way)."""
    return costs.row_ms(row)


def row_tau(row: dict, temperature: float = 0.0) -> float:
    """A replayed row's tau: greedy (exact), or expected under sampling at the nearest recorded temperature."""
    if temperature <= 0:
        return row["tau"]
    sampled = row.get("sampled_tau")
    if not sampled:
        raise ValueError("this calibration has no sampled accept lengths (search.sampled_temperatures is empty)")
    nearest = min(sampled, key=lambda key: abs(float(key) - temperature))
    return sampled[nearest]


def choose(shapes: list[dict], costs: CostModel, fixed: TreeShape,
           temperature: float = 0.0) -> tuple[TreeShape, list[dict]]:
    """The fastest shape among those matching the fixed (non-zero) fields (ranked[0] also says the
    n-gram chain length chosen, "ngram_tokens", when the rows were replayed with chains), ranked by
    tau at `temperature` (0: greedy; the ranked rows' "tau" is that one)."""
    ranked = []
    for row in shapes:
        shape = TreeShape(**row["shape"])
        if shape.depth == 0 and (fixed.depth or fixed.topk or fixed.total_tokens):
            continue
        if (fixed.depth and shape.depth != fixed.depth) or (fixed.topk and shape.topk != fixed.topk) or (
                fixed.total_tokens and shape.total_tokens != fixed.total_tokens):
            continue
        round_ms = row_ms(row, costs)
        tau = row_tau(row, temperature)
        ranked.append({**row, "tau": tau, "round_ms": round_ms, "tokens_per_s": 1000 * tau / round_ms})
    if not ranked:
        raise ValueError(f"no searched tree shape matches the fixed values {fixed}")
    ranked.sort(key=lambda r: -r["tokens_per_s"])
    return TreeShape(**ranked[0]["shape"]), ranked


def calibration_fingerprint(target: Target, drafter: EagleDrafter, search: TreeSearchConfig,
                            ngram: NgramProposer | None = None, backend=None) -> str:
    """A digest of what tree=auto's timings depend on: target, head, device, dtype, threads, backend, and the
    code that runs a round or times it (a change there may move its costs, so it is timed again, not reused)."""
    head = drafter.head
    weights = float(sum(p.detach().float().abs().sum() for p in head.parameters()))
    fields = {"target": target.name, "device": str(target.device), "dtype": str(target.dtype),
              "target_weights": getattr(target, "weights", "fp32"),
              "threads": torch.get_num_threads(),  # every cost scales with them
              "head": asdict(head.arch), "weights": round(weights, 3), "search": asdict(search),
              "head_storage": getattr(head.fc, "storage", str(head.dtype)),
              "code": code_digest(ROUND_CODE)}
    if backend is not None and getattr(backend, "name", "eager") != "eager":  # costs differ per backend
        fields["backend"] = {"name": backend.name, "buckets": list(getattr(backend, "buckets", [])),
                             "target_costs": "per bucket",
                             "min_attended_length": getattr(backend, "min_attended_length", 0),
                             "head_step": "compiled" if drafter.runner.compiled else "eager"}
    # how the weights are stored and multiplied: other costs, and (quantized) other acceptance
    fields["target_weights"] = [getattr(target, "weights", "fp32"), getattr(target, "linear_kernel", "torch")]
    if kernel_march() != NATIVE:  # kernels built for another instruction set cost differently
        fields["kernel_march"] = kernel_march()
    if head.dtype != target.dtype:  # a head drafting in its own dtype costs and accepts differently
        fields["head_dtype"] = str(head.dtype)
    if getattr(head.fc, "storage", None):  # a head on the row-stable kernel: its weights' storage sets its cost
        fields["head_storage"] = head.fc.storage
    if ngram is not None:  # only then: summaries cached without n-gram stay valid
        fields["ngram"] = {**asdict(ngram), "lengths": ngram_lengths(ngram), "priced": "timed-ngram-rounds"}
    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def calibrate(target: Target, drafter: EagleDrafter, prompts: list[list[int]], search: TreeSearchConfig,
              ngram: NgramProposer | None = None, backend=None, quick: bool = False) -> dict:
    """Measure costs and record acceptance; returns the cacheable summary.
    The drafter must have no n-gram proposer attached (every timing is of the head's trees);
    ngram: record its chains and replay them too. quick: the two shapes that fit the overhead are
    timed on the first prompt only, and n-gram-only rounds are priced by the model."""
    steps = 4 if quick else 6 if ngram is not None else 5
    log.info("tree=auto [1/%d]: timing the target's forward for 1-%d scored tokens", steps,
             largest_tree(backend, max(K_GRID)))
    target_ms = measure_target_costs(target, search.context, backend=backend)
    log.info("tree=auto [2/%d]: timing the head's draft steps for top-k %s", steps, search.topks)
    first_ms, level_ms = measure_draft_costs(drafter, target, search.topks, search.context)
    big, small = TreeShape(*search.record_shape), TreeShape(*search.probe_shape)
    log.info("tree=auto [3/%d]: recording %d greedy runs of %d tokens with the largest tree", steps, len(prompts),
             search.new_tokens)
    with drafter.tree_as(big):
        recording, big_ms = record(target, drafter, prompts, search.new_tokens, ngram, backend,
                                   search.sampled_temperatures)
    timing_prompts = prompts[:1] if quick else prompts  # a median over rounds: one prompt gives dozens
    log.info("tree=auto [4/%d]: timing a small tree and the no-draft path%s", steps, " (one prompt)" if quick else "")
    small_ms = timed_rounds(target, drafter, timing_prompts, search.new_tokens, small, backend)
    plain_ms = timed_rounds(target, drafter, timing_prompts, search.new_tokens, TreeShape(0, 0, 0), backend)
    models = CostModel(target_ms, level_ms, first_ms, 0.0)
    # overhead = measured - modelled, as a line in the tree size through the two timed shapes
    extra_big, extra_small = big_ms - models.model_ms(big), small_ms - models.model_ms(small)
    slope = max((extra_big - extra_small) / max(big.total_tokens - small.total_tokens, 1), 0.0)
    intercept = max(extra_small - slope * small.total_tokens, 0.0)
    costs = CostModel(target_ms, level_ms, first_ms, intercept, slope, plain_ms, recording.ngram_ms)
    if ngram is not None and not quick:
        log.info("tree=auto [5/%d]: timing n-gram-only rounds", steps)
        costs.ngram_round_ms = timed_ngram_rounds(target, drafter, prompts, search.new_tokens, ngram, costs, backend)
    return {"cost_model": asdict(costs), "rounds": len(recording.rounds),
            "shapes": replay_all(recording, search, ngram_lengths(ngram)),
            "measured_round_ms": {"record": big_ms, "probe": small_ms, "no_draft": plain_ms}, "quick": quick}


def calibration(target: Target, drafter: EagleDrafter, fixed: TreeShape, prompts: list[list[int]] | None = None,
                search: TreeSearchConfig | None = None, cache_dir: Path | None = None,
                backend=None, quick: bool = False) -> tuple[dict, CostModel, Path]:
    """The measured summary (shapes with their tau, costs) for this target, head and device:
    read from the cache, else measured once and cached. Returns (summary, cost model, cache file).
    quick: a quick calibration will do; a cached quick one is measured again in full otherwise."""
    search = search or TreeSearchConfig()
    for name, values in (("depth", search.depths), ("topk", search.topks), ("total_tokens", search.totals)):
        if getattr(fixed, name) and getattr(fixed, name) not in values:
            values.append(getattr(fixed, name))
    cache_dir = cache_dir or cache_root() / "tree_auto"
    ngram = drafter.ngram
    path = cache_dir / f"{target.name}-{calibration_fingerprint(target, drafter, search, ngram, backend)}.json"
    summary = json.loads(path.read_text()) if path.is_file() else None
    if summary is not None and summary.get("quick") and not quick:
        log.info("tree=auto: the cached calibration is a quick one; this run calibrates in full")
        summary = None
    if summary is None:
        if quick:
            log.info("tree=auto: a quick calibration on %s for this short run (about a minute on a 2-core CPU; "
                     "a longer run calibrates in full); cached in %s", target.device, path)
        else:
            log.info("tree=auto: measuring costs and acceptance on %s, once (about 4 min on a 2-core CPU, longer "
                     "when it compiles); cached in %s", target.device, path)
        prompts = prompts if prompts is not None else calibration_prompts(target)
        with drafter.tree_as(ngram=None):  # the head's trees are timed alone; chains are recorded beside them
            summary = calibrate(target, drafter, prompts, search, ngram, backend, quick)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2))
    return summary, cost_model(summary), path


def cost_model(summary: dict) -> CostModel:
    """The cost model of a calibration summary (as cached)."""
    cm = summary["cost_model"]
    return CostModel({int(k): v for k, v in cm["target_ms"].items()}, {int(k): v for k, v in cm["level_ms"].items()},
                     cm["first_level_ms"], cm["overhead_ms"], cm["overhead_per_token_ms"], cm["plain_ms"],
                     cm.get("ngram_ms", 0.0), cm.get("ngram_round_ms"))


def calibration_prompts(target: Target) -> list[list[int]]:
    """The calibration prompts, each cut to half the target's context at most (room to decode after it); through
    the chat template where the tokenizer has one."""
    keep, chat = max(1, target.max_context // 2), has_chat_template(target.tokenizer)
    return [encode_prompt(target.tokenizer, p, chat=chat)[:keep] for p in CALIBRATION_PROMPTS]


CLOSE_CALL = 0.6  # a drafting row the model prices at this share of plain decoding or more is timed in the loop


def _close_call(ranked: list[dict]) -> bool:
    """Whether the model's best drafting row comes within CLOSE_CALL of plain decoding (ranked first). The
    model's per-round overhead is fitted from two timed runs; when the machine slowed between those and the
    cost curve, it overprices every tree (a chain that decodes faster than plain, priced below it), and only
    timing both in the loop, in turns, tells."""
    drafting = next((r for r in ranked if not is_plain(r)), None)
    return drafting is not None and drafting["tokens_per_s"] >= CLOSE_CALL * ranked[0]["tokens_per_s"]


def validated(target: Target, drafter: EagleDrafter, summary: dict, path: Path, ranked: list[dict], costs: CostModel,
              fixed: TreeShape, prompts: list[list[int]] | None, search: TreeSearchConfig,
              ngram: NgramProposer | None, backend=None, temperature: float = 0.0) -> list[dict]:
    """validate()'s ranking for these fixed fields and this temperature: read from the calibration
    file, else timed once (sampling at `temperature` when > 0) and added to it (on one prompt after a quick
    calibration); when the model ranks plain decoding first by a wide margin (_close_call), the model's
    first row stands untimed."""
    key = f"d{fixed.depth}-k{fixed.topk}-n{fixed.total_tokens}" + (f"-T{temperature:g}" if temperature > 0 else "")
    done = summary.setdefault("validated", {})
    if key in done:
        return done[key]
    sampling = f" at T={temperature:g}" if temperature > 0 else ""
    if is_plain(ranked[0]) and not _close_call(ranked):
        drafting = next((r for r in ranked if not is_plain(r)), None)
        log.info("tree=auto [last step]%s: skipped: the cost model prices decoding without drafts first (%.1f tok/s; "
                 "its best drafting row %s, under %.2f x), so no tree is timed in the loop", sampling,
                 ranked[0]["tokens_per_s"], f"{drafting['tokens_per_s']:.1f} tok/s" if drafting else "none",
                 CLOSE_CALL)
        done[key] = [untimed(ranked[0])]
    else:
        prompts = prompts if prompts is not None else calibration_prompts(target)
        prompts = prompts[:1] if summary.get("quick") else prompts  # a quick calibration: seconds, not a minute
        log.info("tree=auto [last step]%s: timing the model's %d best shapes (and its best head tree) against "
                 "plain decoding in the loop (%d prompts x %d tokens each)", sampling, VALIDATE_TOP, len(prompts),
                 search.validate_new_tokens)
        done[key] = validate(target, drafter, ranked, costs, fixed, prompts, search, ngram, backend,
                             SamplingParams(temperature))
    path.write_text(json.dumps(summary, indent=2))
    return done[key]


def auto_tree(target: Target, drafter: EagleDrafter, fixed: TreeShape, prompts: list[list[int]] | None = None,
              search: TreeSearchConfig | None = None, cache_dir: Path | None = None,
              min_gain: float = 1.0, backend=None, quick: bool = False,
              temperatures: Sequence[float] = (0.0,), sampled_min_gain: float = 1.0) -> TreeShape:
    """The fastest shape for this target, head and device (measured once, cached); sets it
    on the drafter. fixed: non-zero fields are kept as given. min_gain: a tree must beat plain
    decoding's timed tokens/s by this factor (validate.measured_best); sampled_min_gain: by at least
    this one when sampling (T > 0). quick: a quick calibration
    will do when none is cached (a short run).

    With an n-gram proposer on the drafter (hybrid drafting), its chain length is chosen too
    (up to its max_tokens): the drafter's proposer is replaced by one with the chosen length,
    or removed when merging chains does not pay.

    temperatures: the sampling temperatures the run decodes at (0: greedy); one tree is chosen for
    each (`drafter.choices`, picked per request by `drafter.select`), sampled ones ranked by their
    expected accept lengths. The drafter is left with the first one's tree, which is returned."""
    ngram = drafter.ngram
    search = fit_search(search or TreeSearchConfig(), backend, target.max_context)
    if backend is not None and getattr(backend, "buckets", None):
        drafter.max_tree_tokens = max(backend.buckets)  # n-gram chains cut to fit the largest compiled size
    summary, costs, path = calibration(target, drafter, fixed, prompts, search, cache_dir, backend, quick)
    if not temperatures:
        raise ValueError("auto_tree needs at least one temperature (0: greedy)")
    choices = []
    for temperature in dict.fromkeys(max(float(t), 0.0) for t in temperatures):  # in order, once each
        _, ranked = choose(summary["shapes"], costs, fixed, temperature)
        measured = validated(target, drafter, summary, path, ranked, costs, fixed, prompts, search, ngram, backend,
                             temperature)
        gain = min_gain if temperature == 0 else max(min_gain, sampled_min_gain)
        best = measured_best(measured, gain)
        log_choice(best, measured, ranked, costs, path, gain, ngram is not None, temperature, target.device)
        chain = int(best.get("ngram_tokens", 0))
        choices.append(TreeChoice(temperature, TreeShape(**best["shape"]),
                                  replace(ngram, max_tokens=chain) if ngram is not None and chain else None))
    drafter.adopt_choices(tuple(choices))
    return choices[0].shape


def log_choice(best: dict, measured: list[dict], ranked: list[dict], costs: CostModel, path: Path, min_gain: float,
               hybrid: bool, temperature: float, device) -> None:
    """Say which tree tree=auto chose for this temperature, and on what evidence."""
    chosen, chain = TreeShape(**best["shape"]), int(best.get("ngram_tokens", 0))
    at = f" for T={temperature:g}" if temperature > 0 else ""
    plain = next((r for r in measured if is_plain(r)), None)
    if best is not measured[0]:
        log.info("tree=auto%s: the fastest tree timed %.1f tok/s, less than the margin %.2f x plain decoding's "
                 "%.1f: decoding without drafts", at, measured[0]["measured_tokens_per_s"], min_gain,
                 plain["measured_tokens_per_s"])
    first = next(r for r in measured if r["shape"] == ranked[0]["shape"]
                 and r.get("ngram_tokens", 0) == ranked[0].get("ngram_tokens", 0))
    if best.get("timed", True) is False:
        log.info("tree=auto%s chose depth=%d topk=%d total_tokens=%d%s by the cost model: %.1f tok/s (tau %.2f on the "
                 "calibration prompts), %.1f tok/s without drafting (costs: %s)", at, chosen.depth, chosen.topk,
                 chosen.total_tokens, f" + n-gram chains of {chain} tokens" if chain else "",
                 best["tokens_per_s"], best["tau"], 1000 / costs.round_ms(TreeShape(0, 0, 0)), path)
    else:
        log.info("tree=auto%s chose depth=%d topk=%d total_tokens=%d%s: %.1f tok/s timed in the loop%s "
                 "(tau %.2f; model: %.1f tok/s; the model's first choice timed %.1f)%s (costs: %s)", at,
                 chosen.depth, chosen.topk, chosen.total_tokens,
                 f" + n-gram chains of {chain} tokens" if chain else " (no n-gram branches)" if hybrid else "",
                 best["measured_tokens_per_s"], " (capped at tau x plain decoding's)" if best.get("capped") else "",
                 best.get("measured_tau", best["tau"]),
                 best.get("tokens_per_s", best["measured_tokens_per_s"]), first["measured_tokens_per_s"],
                 f" vs {plain['measured_tokens_per_s']:.1f} tok/s without drafting, timed beside it" if plain else "",
                 path)
    if chosen.depth == 0 and chain:
        log.info("tree=auto%s: n-gram drafting alone (no head run) is fastest here", at)
    elif chosen.depth == 0:
        log.warning("tree=auto%s: with this head no draft tree pays for itself on %s; decoding without drafts "
                    "(train a better head, or set tree.depth/topk/total_tokens to force one)", at, device)
