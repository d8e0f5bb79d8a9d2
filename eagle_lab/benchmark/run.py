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
  llamacpp, llamacpp_eagle3, llamacpp_ngram
                    llama.cpp plain, with the head exported to GGUF, and with n-gram drafting
                    (eagle_lab/benchmark/llama_cpp_runs.py; skipped with one line without llama.cpp)
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

import logging
from datetime import datetime
from pathlib import Path
from typing import Any

from eagle_lab.benchmark.aggregate import prompt_records, summarise
from eagle_lab.benchmark.context import BenchContext, Run, make_context
from eagle_lab.benchmark.hf_baseline import run_hf
from eagle_lab.benchmark.llama_cpp_runs import LLAMA_CPP_METHODS, find_setup, run_llama_cpp
from eagle_lab.benchmark.metadata import config_summary, preview, update_card
from eagle_lab.benchmark.methods import (
    GREEDY_ONLY,
    HF_METHODS,
    METHODS,
    build_drafters,
    split_method,
    validate_bench,
)
from eagle_lab.benchmark.prompt_sets import load_bench_prompts
from eagle_lab.benchmark.report import write_outputs
from eagle_lab.benchmark.sweep import run_sweep
from eagle_lab.builders import SPECULATIVE, build_decoder, make_generator
from eagle_lab.config import ServeConfig
from eagle_lab.decoding.backend import EagerBackend, build_backend
from eagle_lab.decoding.gc_freeze import freeze_loaded_objects
from eagle_lab.decoding.generate import Stopper, generate
from eagle_lab.decoding.sampling import SamplingParams, temperature_key
from eagle_lab.errors import EagleLabError
from eagle_lab.models.device import timed_call
from eagle_lab.models.prompts import as_tensor, encode_prompt
from eagle_lab.models.target import load_target

log = logging.getLogger(__name__)


def run_bench(cfg: ServeConfig, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Run every method at every temperature; write results.json, results.md, bench.png; print the table.
    With bench.concurrency set: the batched server's concurrency sweep instead (eagle_lab/benchmark/sweep.py)."""
    if cfg.bench.concurrency:
        return run_sweep(cfg, resolve_run_dir(out_dir))
    validate_bench(cfg)
    llama_cpp, why_not = find_setup(cfg.bench.llama_cpp, cfg.bench.gguf_dir, cfg.bench.gguf_target, cfg.bench.methods)
    skipped = {m: why_not for m in cfg.bench.methods if m in LLAMA_CPP_METHODS and llama_cpp is None}
    prompts = load_bench_prompts(cfg.bench.dataset, cfg.bench.limit)
    run_dir = resolve_run_dir(out_dir)
    target = load_target(cfg.target)
    encoded = [encode_prompt(target.tokenizer, p, cfg.chat, cfg.system) for p in prompts]  # checked before any work
    backend = build_backend(target, cfg.compile, cfg.decoding, longest_prompt=max(len(ids) for ids in encoded),
                            max_new_tokens=cfg.max_new_tokens, compile_ahead=True)  # no compile inside a timed run
    drafters = build_drafters(cfg, target, backend)
    ctx = make_context(cfg, target, drafters, backend)
    ctx.llama_cpp = llama_cpp
    log.info("bench: %d prompts from %s, methods %s, temperatures %s -> %s", len(prompts), cfg.bench.dataset,
             ", ".join(cfg.bench.methods), ", ".join(map(str, cfg.bench.temperatures)), run_dir)

    summary: dict[str, dict[str, dict[str, Any]]] = {}
    records: list[dict[str, Any]] = []
    results = {  # summary and records fill in per temperature
        "config": config_summary(cfg, target, len(prompts), drafters, backend),
        "prompts": [{"index": i, "prompt_tokens": len(ids), "preview": preview(p)}
                    for i, (p, ids) in enumerate(zip(prompts, encoded))],
        "summary": summary,
        "records": records,
    }
    if llama_cpp is not None:
        results["config"]["llama_cpp"] = {"tools": str(llama_cpp.tools), "target": llama_cpp.target.name,
                                          "head": llama_cpp.head.name if llama_cpp.head else "",
                                          "draft": cfg.bench.llama_cpp_draft}
    warmed: set[str] = set()
    for temperature in cfg.bench.temperatures:
        params = SamplingParams(temperature, cfg.top_k, cfg.top_p)
        active = []
        for method in cfg.bench.methods:
            if method in skipped:
                continue
            if method in GREEDY_ONLY and not params.greedy:
                log.info("T=%g %s: skipped (greedy only)", temperature, method)
                continue
            if method not in warmed:
                warm_up(ctx, method, encoded[: cfg.bench.warmup], params)
                warmed.add(method)
            active.append(method)
        freeze_loaded_objects()  # what set-up and the warm-ups loaded: no full collection inside a timed run
        if cfg.bench.interleave:
            runs = run_interleaved(ctx, active, encoded, params, temperature)
        else:
            runs = {method: run_prompts(ctx, method, encoded, params, temperature) for method in active}
        key = temperature_key(temperature)
        summary[key] = summarise(cfg.bench.methods, runs, params.greedy, skipped)
        records.extend(prompt_records(runs, temperature, target.tokenizer, params.greedy))
        for method, row in summary[key].items():
            log.info("T=%s %s: tau %s, %s tok/s", key, method, _figure(row.get("tau")),
                     _figure(row.get("tokens_per_s")))
        write_outputs(results, run_dir)  # after every temperature: a run stopped later keeps what it measured
        if cfg.bench.update_card:
            update_card(cfg, target, {key: summary[key]}, len(prompts))
    return results


def _figure(value) -> str:
    return "-" if value is None else f"{value:.2f}"


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
        return run_hf(ctx, method, prompt_ids, params)
    if method in LLAMA_CPP_METHODS:
        return run_llama_cpp(ctx, ctx.llama_cpp, method, prompt_ids, params)
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

    result, wall = timed_call(decode, target.device)
    stats = result.stats
    return Run(result.token_ids, wall, stats.target_forwards, stats.stop_reason, stats)
