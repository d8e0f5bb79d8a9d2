"""`python serve.py mode=bench`: EAGLE against plain decoding and Hugging Face generate.

One process, one target, the same prompts for every method:
  vanilla           eagle_lab's plain decoding (the baseline: one target forward per token), on the
                    backend compile= chose (compiled where that is faster): the fastest plain decoding
  vanilla_eager     the same loop, eager over a dynamic cache (compile=false), reported beside it
  eagle             speculative decoding with the configured head and tree (no n-gram branches)
  eagle+ngram       the same head and tree with n-gram (prompt lookup) branches merged in (ngram.*)
  ngram             n-gram drafting alone, no head, through the same loop and verifier
  hf_greedy         `model.generate` (greedy at T=0, sampling at T>0)
  hf_prompt_lookup  `model.generate(prompt_lookup_num_tokens=10)`, greedy only
A speculative method may name a tree preset (conf/tree/*.yaml) after '@', so one run compares
trees against the same vanilla baseline: bench.methods=[vanilla,eagle@cpu,eagle@auto]; without
'@' a method uses the configured tree=.
For each temperature it reports tokens/s, tau (tokens per target forward), speedup over
vanilla, mean wall time per prompt, EAGLE's acceptance rate at each tree depth, the share of
accepted draft tokens that came from n-gram branches and, at T=0, how many prompts' greedy
outputs differ from vanilla's (all must be identical).
Results go to results.json, results.md and bench.png in the run directory.
"""

from __future__ import annotations

import inspect
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import transformers

from eagle_lab.benchmark.prompt_sets import Prompt, load_bench_prompts
from eagle_lab.benchmark.report import REFERENCE, write_outputs
from eagle_lab.benchmark.sweep import run_sweep
from eagle_lab.builders import (SPECULATIVE, build_decoder, build_drafter, build_head, make_generator,
                                ngram_proposer, packaged_head_dir)
from eagle_lab.card import record_mtbench_tau
from eagle_lab.config import ServeConfig, TreeConfig
from eagle_lab.decoding.backend import Backend, EagerBackend, build_backend
from eagle_lab.draft import Drafter, EagleDrafter
from eagle_lab.errors import EagleLabError
from eagle_lab.generate import GenerationStats, Stopper, generate
from eagle_lab.ngram import NgramDrafter
from eagle_lab.prompts import as_tensor, encode_prompt
from eagle_lab.sampling import SamplingParams
from eagle_lab.target import Target, load_target
from eagle_lab.tree_search.presets import tree_preset

log = logging.getLogger(__name__)
METHODS = ("vanilla", "vanilla_eager", "eagle", "eagle+ngram", "ngram", "hf_greedy", "hf_prompt_lookup")
HEAD_METHODS = ("eagle", "eagle+ngram")  # methods that run the head
HF_METHODS = ("hf_greedy", "hf_prompt_lookup")
GREEDY_ONLY = ("hf_prompt_lookup",)
PROMPT_LOOKUP_TOKENS = 10


@dataclass
class Run:
    """One method on one prompt."""

    token_ids: list[int]
    wall_s: float
    target_forwards: int | None  # None when it could not be counted
    stop_reason: str
    stats: GenerationStats | None = None  # eagle_lab methods only


@dataclass
class BenchContext:
    """What every method run needs: the target, the drafters and the shared settings."""

    cfg: ServeConfig
    target: Target
    drafters: dict[str, Drafter]  # speculative method -> its drafter
    eos: set[int]  # empty when cfg.ignore_eos
    pad_token_id: int
    cache_kwarg: str  # the name `model.generate` takes a cache under
    backend: Backend | None = None  # how vanilla and the speculative methods run the target (None: eager)


def run_bench(cfg: ServeConfig, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Run every method at every temperature; write results.json, results.md, bench.png; print the table.
    With bench.concurrency set: the batched server's concurrency sweep instead (eagle_lab/benchmark/sweep.py)."""
    if cfg.bench.concurrency:
        return run_sweep(cfg, resolve_run_dir(out_dir))
    validate_bench(cfg)
    prompts = load_bench_prompts(cfg.bench.dataset, cfg.bench.limit)
    run_dir = resolve_run_dir(out_dir)
    target = load_target(cfg.target)
    encoded = [encode_prompt(target.tokenizer, p, cfg.chat, cfg.system) for p in prompts]  # checked before any work
    backend = build_backend(target, cfg.compile, cfg.decoding, longest_prompt=max(len(ids) for ids in encoded),
                            max_new_tokens=cfg.max_new_tokens)
    drafters = build_drafters(cfg, target, backend)
    ctx = make_context(cfg, target, drafters, backend)
    log.info("bench: %d prompts from %s, methods %s, temperatures %s -> %s", len(prompts), cfg.bench.dataset,
             ", ".join(cfg.bench.methods), ", ".join(map(str, cfg.bench.temperatures)), run_dir)

    summary: dict[str, dict[str, dict[str, Any]]] = {}
    records: list[dict[str, Any]] = []
    warmed: set[str] = set()
    for temperature in cfg.bench.temperatures:
        params = SamplingParams(temperature, cfg.top_k, cfg.top_p)
        active = []
        for method in cfg.bench.methods:
            if method in GREEDY_ONLY and not params.greedy:
                log.info("T=%g %s: skipped (greedy only)", temperature, method)
                continue
            if method not in warmed:
                warm_up(ctx, method, encoded[: cfg.bench.warmup], params)
                warmed.add(method)
            active.append(method)
        if cfg.bench.interleave:
            runs = run_interleaved(ctx, active, encoded, params, temperature)
        else:
            runs = {method: run_prompts(ctx, method, encoded, params, temperature) for method in active}
        summary[temperature_key(temperature)] = summarise(cfg.bench.methods, runs, params.greedy)
        records.extend(prompt_records(runs, temperature, target.tokenizer, params.greedy))

    results = {
        "config": config_summary(cfg, target, len(prompts), drafters, backend),
        "prompts": [{"index": i, "prompt_tokens": len(ids), "preview": _preview(p)}
                    for i, (p, ids) in enumerate(zip(prompts, encoded))],
        "summary": summary,
        "records": records,
    }
    write_outputs(results, run_dir)
    if cfg.bench.update_card:
        update_card(cfg, target, summary, len(prompts))
    return results


def split_method(method: str) -> tuple[str, str]:
    """'eagle@auto' -> ('eagle', 'auto'); 'eagle' -> ('eagle', '') (the configured tree=)."""
    base, _, tree = method.partition("@")
    return base, tree


def build_drafters(cfg: ServeConfig, target: Target, backend: Backend | None = None) -> dict[str, Drafter]:
    """One drafter per speculative method requested; every head method shares one head
    (under tree=auto each is calibrated, and cached, on its own)."""
    methods = cfg.bench.methods
    head = build_head(cfg.head, target) if any(split_method(m)[0] in HEAD_METHODS for m in methods) else None
    drafters: dict[str, Drafter] = {}
    for method in methods:
        base, preset = split_method(method)
        tree = tree_preset(preset) if preset else cfg.tree
        if base == "eagle":
            drafters[method] = build_drafter(head, target, tree, backend=backend)
        elif base == "eagle+ngram":
            drafters[method] = build_drafter(head, target, tree, ngram_proposer(cfg.ngram), backend)
        elif base == "ngram":
            drafters[method] = NgramDrafter(ngram_proposer(cfg.ngram))
    return drafters


def tree_label(tree: TreeConfig) -> str:
    """How head cards key MT-bench tau: the preset's name, or the shape."""
    return "auto" if tree.auto else tree.name or f"d{tree.depth}-k{tree.topk}-n{tree.total_tokens}"


def update_card(cfg: ServeConfig, target: Target, summary: dict[str, dict[str, Any]], prompts: int) -> None:
    """bench.update_card: eagle's measured MT-bench tau -> the head's card.json. The packaged head's card
    (tracked in the repository) is written only when head.path names its directory explicitly."""
    if not cfg.head.path:
        log.warning("bench.update_card: not rewriting the packaged head's card with this machine's figures; pass "
                    "head.path=%s to do so on purpose", packaged_head_dir(target.name) or "DIR")
        return
    head = cfg.head.path
    eagle = [m for m in cfg.bench.methods if split_method(m)[0] == "eagle"]
    if cfg.bench.dataset != "mt_bench" or not head or not eagle:
        log.warning("bench.update_card needs bench.dataset=mt_bench, the eagle method and a head directory")
        return
    for method in eagle:
        preset = split_method(method)[1]
        label = tree_label(tree_preset(preset) if preset else cfg.tree)
        for key, by_method in summary.items():
            tau = by_method.get(method, {}).get("tau")
            if tau is not None and record_mtbench_tau(head, label, float(key), tau, prompts):
                log.info("card %s: MT-bench tau %.3f (tree %s, T=%s, %d prompts)", head, tau, label, key, prompts)


def validate_bench(cfg: ServeConfig) -> None:
    """Refuse unknown or repeated methods, bad temperatures and a negative warm-up up front."""
    bench = cfg.bench
    if not bench.methods:
        raise EagleLabError(f"bench.methods is empty (choose from {', '.join(METHODS)})")
    unknown = [m for m in bench.methods if split_method(m)[0] not in METHODS]
    if unknown:
        raise EagleLabError(f"unknown bench method(s) {', '.join(unknown)} (choose from {', '.join(METHODS)})")
    for method in bench.methods:
        base, preset = split_method(method)
        if "@" in method and base not in HEAD_METHODS:
            raise EagleLabError(f"bench method '{method}': only {', '.join(HEAD_METHODS)} take a tree after '@'")
        if preset:
            tree_preset(preset)  # raises EagleLabError naming the presets
    if len(set(bench.methods)) != len(bench.methods):
        raise EagleLabError(f"bench.methods repeats a method: {list(bench.methods)}")
    if not bench.temperatures:
        raise EagleLabError("bench.temperatures is empty (e.g. bench.temperatures=[0.0,1.0])")
    for temperature in bench.temperatures:
        SamplingParams(temperature, cfg.top_k, cfg.top_p)  # raises EagleLabError on bad values
    if len({temperature_key(t) for t in bench.temperatures}) != len(bench.temperatures):
        raise EagleLabError(f"bench.temperatures repeats a value: {list(bench.temperatures)}")
    if any(m in ("eagle+ngram", "ngram") for m in bench.methods):
        ngram_proposer(cfg.ngram)  # raises EagleLabError on bad ngram.* values
    if bench.warmup < 0:
        raise EagleLabError(f"bench.warmup must be >= 0, got {bench.warmup}")
    if cfg.max_new_tokens < 1:
        raise EagleLabError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.stop:
        log.warning("bench ignores stop strings (stop=%s): every method stops at eos or max_new_tokens", cfg.stop)
    if cfg.temperature != 0:
        log.warning("bench ignores temperature=%g: it runs bench.temperatures=%s", cfg.temperature,
                    list(bench.temperatures))


def resolve_run_dir(out_dir: str | Path | None = None) -> Path:
    """`out_dir` if given, else Hydra's output dir, else a new outputs/bench/<timestamp>."""
    if out_dir is None:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            out_dir = HydraConfig.get().runtime.output_dir
        else:
            out_dir = Path("outputs") / "bench" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


def make_context(cfg: ServeConfig, target: Target, drafters: dict[str, Drafter],
                 backend: Backend | None = None) -> BenchContext:
    eos = set() if cfg.ignore_eos else set(target.eos_token_ids)
    pad = target.tokenizer.pad_token_id
    if pad is None:
        pad = getattr(target.model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = min(target.eos_token_ids, default=0)
    params = inspect.signature(target.model.forward).parameters
    cache_kwarg = "cache" if "cache" in params else "past_key_values"
    return BenchContext(cfg, target, drafters, eos, int(pad), cache_kwarg, backend)


def warm_up(ctx: BenchContext, method: str, encoded: list[list[int]], params: SamplingParams) -> None:
    """Untimed runs, so one-off costs (allocations, kernel choice, lazy init) are not measured."""
    for index, ids in enumerate(encoded):
        log.info("warm-up %s: prompt %d/%d", method, index + 1, len(encoded))
        run_method(ctx, method, ids, params)


def run_prompts(ctx: BenchContext, method: str, encoded: list[list[int]], params: SamplingParams,
                temperature: float) -> list[Run]:
    runs = []
    for index, ids in enumerate(encoded):
        log.info("T=%g %s: prompt %d/%d", temperature, method, index + 1, len(encoded))
        runs.append(run_method(ctx, method, ids, params))
    return runs


def run_interleaved(ctx: BenchContext, methods: list[str], encoded: list[list[int]], params: SamplingParams,
                    temperature: float) -> dict[str, list[Run]]:
    """Every prompt run by every method in turn, the order rotated from one prompt to the next: a
    machine whose speed drifts over minutes (a shared VM, other jobs, clocks) then slows every
    method alike, where whole-method blocks would charge the drift to whichever ran during it.
    Outputs do not depend on the order (each run seeds its own generator)."""
    runs: dict[str, list[Run | None]] = {method: [None] * len(encoded) for method in methods}
    for index, ids in enumerate(encoded if methods else []):
        for method in methods[index % len(methods):] + methods[: index % len(methods)]:
            log.info("T=%g %s: prompt %d/%d", temperature, method, index + 1, len(encoded))
            runs[method][index] = run_method(ctx, method, ids, params)
    return runs


def run_method(ctx: BenchContext, method: str, prompt_ids: list[int], params: SamplingParams) -> Run:
    """Generate for one prompt with one method, timed from the call to the last token."""
    if method in ("vanilla", "vanilla_eager") or split_method(method)[0] in SPECULATIVE:
        return _run_eagle_lab(ctx, method, prompt_ids, params)
    if method in HF_METHODS:
        return _run_hf(ctx, method, prompt_ids, params)
    raise EagleLabError(f"unknown bench method '{method}' (choose from {', '.join(METHODS)})")


def _run_eagle_lab(ctx: BenchContext, method: str, prompt_ids: list[int], params: SamplingParams) -> Run:
    target = ctx.target

    def decode():
        stopper = Stopper(target.tokenizer, ctx.cfg.max_new_tokens, ctx.eos)
        generator = make_generator(ctx.cfg.seed, target.device)
        base = split_method(method)[0]
        backend = EagerBackend(target) if method == "vanilla_eager" else ctx.backend
        decoder = build_decoder("vanilla" if base == "vanilla_eager" else base, target, ctx.drafters.get(method),
                                as_tensor(prompt_ids, target.device), params, stopper, generator, backend)
        return generate(decoder)

    result, wall = _timed(decode, target.device)
    stats = result.stats
    return Run(result.token_ids, wall, stats.target_forwards, stats.stop_reason, stats)


def _run_hf(ctx: BenchContext, method: str, prompt_ids: list[int], params: SamplingParams) -> Run:
    """`model.generate` with the same eos, length and sampling settings as eagle_lab's loops.

    ignore_eos passes eos_token_id=None rather than min_new_tokens: the latter masks eos out
    of the logits, which would change greedy outputs. Target forwards are counted with a hook.
    """
    target, cfg = ctx.target, ctx.cfg
    input_ids = as_tensor(prompt_ids, target.device)[None]  # [1, T]
    kwargs: dict[str, Any] = {
        "attention_mask": torch.ones_like(input_ids),
        "max_new_tokens": cfg.max_new_tokens,
        "eos_token_id": sorted(ctx.eos) if ctx.eos else None,
        "pad_token_id": ctx.pad_token_id,
        ctx.cache_kwarg: target.new_cache(),
    }
    if params.greedy:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    if method == "hf_prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    forwards = [0]

    def count(_module, _args) -> None:
        forwards[0] += 1

    hook = target.model.register_forward_pre_hook(count)
    try:
        if not params.greedy:
            torch.manual_seed(cfg.seed)
        output, wall = _timed(lambda: target.model.generate(input_ids, **kwargs), target.device)
    finally:
        hook.remove()
    tokens, reason = cut_hf_output(output[0, input_ids.shape[1]:].tolist(), ctx.eos, cfg.max_new_tokens)
    return Run(tokens, wall, forwards[0] or None, reason)


def cut_hf_output(tokens: list[int], eos: set[int], max_new_tokens: int) -> tuple[list[int], str]:
    """HF's new tokens up to and including the first eos (any padding after it dropped)."""
    for index, token in enumerate(tokens):
        if token in eos:
            return tokens[: index + 1], "eos"
    return tokens, "length" if len(tokens) >= max_new_tokens else "other"


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    _synchronize(device)
    start = time.perf_counter()
    result = fn()
    _synchronize(device)
    return result, time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def temperature_key(temperature: float) -> str:
    return str(float(temperature))


def summarise(methods: list[str], runs: dict[str, list[Run]], greedy: bool) -> dict[str, dict[str, Any]]:
    """Per-method figures at one temperature; `runs` lacks the methods that were skipped."""
    reference = runs.get(REFERENCE)
    summary: dict[str, dict[str, Any]] = {}
    for method in methods:
        if method not in runs:
            summary[method] = {"status": "skipped", "note": "greedy only: skipped at temperature > 0"}
            continue
        method_runs = runs[method]
        new_tokens = sum(len(r.token_ids) for r in method_runs)
        wall = sum(r.wall_s for r in method_runs)
        counted = all(r.target_forwards for r in method_runs)
        forwards = sum(r.target_forwards or 0 for r in method_runs) if counted else None
        row: dict[str, Any] = {
            "status": "ok",
            "note": "",
            "prompts": len(method_runs),
            "new_tokens": new_tokens,
            "wall_s": wall,
            "tokens_per_s": new_tokens / wall if wall > 0 else None,
            "mean_wall_s": wall / len(method_runs) if method_runs else None,
            "target_forwards": forwards,
            "tau": new_tokens / forwards if forwards else None,
            "speedup": None,
            "greedy_mismatches": None,
            "acceptance_by_depth": None,
            "ngram_share": None,
        }
        if split_method(method)[0] == "eagle":
            row["acceptance_by_depth"] = acceptance_by_depth([r.stats for r in method_runs if r.stats])
        if split_method(method)[0] in SPECULATIVE:
            row["ngram_share"] = ngram_share([r.stats for r in method_runs if r.stats])
        if greedy and reference is not None:
            row["greedy_mismatches"] = sum(r.token_ids != ref.token_ids for r, ref in zip(method_runs, reference))
        summary[method] = row
    base = summary.get(REFERENCE, {}).get("tokens_per_s")
    for row in summary.values():
        if base and row.get("tokens_per_s") is not None:
            row["speedup"] = row["tokens_per_s"] / base
    return summary


def ngram_share(stats: list[GenerationStats]) -> float | None:
    """Accepted draft tokens that came from n-gram branches / all accepted draft tokens (None: none accepted)."""
    accepted = sum(s.accepted_draft_tokens for s in stats)
    return sum(s.accepted_ngram_tokens for s in stats) / accepted if accepted else None


def acceptance_by_depth(stats: list[GenerationStats]) -> list[dict[str, Any]]:
    """Per depth d: rounds that accepted >= d drafts / rounds whose tree reached depth d."""
    depth = max((len(s.reached_depth) for s in stats), default=0)
    rows = []
    for d in range(depth):
        reached = sum(s.reached_depth[d] for s in stats if d < len(s.reached_depth))
        accepted = sum(s.accepted_depth[d] for s in stats if d < len(s.accepted_depth))
        rows.append({"depth": d + 1, "reached": reached, "accepted": accepted,
                     "rate": accepted / reached if reached else None})
    return rows


def prompt_records(runs: dict[str, list[Run]], temperature: float, tokenizer, greedy: bool) -> list[dict[str, Any]]:
    """One record per (method, prompt) at this temperature."""
    reference = runs.get(REFERENCE)
    records = []
    for method, method_runs in runs.items():
        for index, run in enumerate(method_runs):
            records.append({
                "temperature": temperature,
                "method": method,
                "prompt_index": index,
                "new_tokens": len(run.token_ids),
                "wall_s": run.wall_s,
                "tokens_per_s": len(run.token_ids) / run.wall_s if run.wall_s > 0 else None,
                "target_forwards": run.target_forwards,
                "tau": len(run.token_ids) / run.target_forwards if run.target_forwards else None,
                "stop_reason": run.stop_reason,
                "matches_vanilla": (run.token_ids == reference[index].token_ids
                                    if greedy and reference is not None else None),
                "token_ids": run.token_ids,
                "text": tokenizer.decode(run.token_ids, skip_special_tokens=True),
            })
    return records


def config_summary(cfg: ServeConfig, target: Target, num_prompts: int,
                   drafters: dict[str, Drafter] | None = None, backend: Backend | None = None) -> dict[str, Any]:
    head = cfg.head.path
    if head == "":
        packaged = packaged_head_dir(target.name)
        head = str(packaged) if packaged else "random"
    device = target.device
    drafters = drafters or {}
    eagle = [drafter for drafter in drafters.values() if isinstance(drafter, EagleDrafter)]
    uses_ngram = any(split_method(m)[0] in ("eagle+ngram", "ngram") for m in drafters)
    hybrid = drafters.get("eagle+ngram")
    return {
        "target": target.name,
        "target_source": cfg.target.source,
        "target_path": cfg.target.path,
        "head": head if eagle else None,
        "head_kind": cfg.head.kind,
        "tree": asdict(eagle[0].shape) if eagle else None,  # as used (tree=auto resolved)
        "tree_auto": cfg.tree.auto,
        # every head method's tree as used (methods named method@preset ran that preset)
        "trees": {m: asdict(d.shape) for m, d in drafters.items() if isinstance(d, EagleDrafter)},
        "ngram": asdict(cfg.ngram) if uses_ngram else None,
        # eagle+ngram as used: its tree and chain length (tree=auto may choose others than eagle's, or none)
        "hybrid": ({"tree": asdict(hybrid.shape), "ngram_tokens": hybrid.ngram.max_tokens if hybrid.ngram else 0}
                   if isinstance(hybrid, EagleDrafter) else None),
        "device": str(device),
        "backend": getattr(backend, "name", "eager"),  # compiled | static | eager: how vanilla and eagle ran
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else platform.processor() or platform.machine()),
        "torch_threads": torch.get_num_threads(),
        "dtype": str(target.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "dataset": cfg.bench.dataset,
        "limit": cfg.bench.limit,
        "num_prompts": num_prompts,
        "methods": list(cfg.bench.methods),
        "temperatures": [float(t) for t in cfg.bench.temperatures],
        "warmup": cfg.bench.warmup,
        "max_new_tokens": cfg.max_new_tokens,
        "top_k": cfg.top_k,
        "top_p": cfg.top_p,
        "seed": cfg.seed,
        "chat": cfg.chat,
        "system": cfg.system,
        "ignore_eos": cfg.ignore_eos,
        "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
        "time": datetime.now().isoformat(timespec="seconds"),
    }


def _preview(prompt: Prompt, width: int = 80) -> str:
    text = prompt if isinstance(prompt, str) else " | ".join(m["content"] for m in prompt)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."
