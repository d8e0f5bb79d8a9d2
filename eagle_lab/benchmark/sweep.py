"""`python serve.py mode=bench bench.concurrency=[1,2,4,8]`: the server's batched decoding under load.

For each method the server can batch (eagle, vanilla, ngram; others in bench.methods are
skipped), each temperature and each concurrency c: c closed-loop clients send the bench
prompts through the server's own BatchScheduler (in process, no HTTP; max_batch = c), each
client sending its next prompt when its last one finished. Reported per (method, c):
  total tokens/s   all new tokens / wall time of the level
  latency p50/p95  per request, from submission to its last token
  batch sizes      rounds scored at each batch size (how full the batch really was)
  tree             the tree each batch size drafts (eagle_lab/serving/batch_trees.py)
  greedy mismatch  at T=0, requests whose tokens differ from the same method at c = 1 and
                   from vanilla at c = 1 (batching is lossless: both must be 0)
Results go to sweep.json, sweep.md and sweep.png in the run directory.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from eagle_lab.benchmark.prompt_sets import load_bench_prompts
from eagle_lab.benchmark.report import write_sweep
from eagle_lab.builders import make_drafter
from eagle_lab.config import ServeConfig
from eagle_lab.decoding.backend import build_backend
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.decoding.static_rows import StaticRows
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.errors import EagleLabError
from eagle_lab.models.prompts import encode_prompt
from eagle_lab.models.target import Target, load_target
from eagle_lab.serving.batching import BatchScheduler
from eagle_lab.serving.engine import Engine, Finished, Plan, drafter_factory
from eagle_lab.serving.scheduler import Job
from eagle_lab.serving.server import batch_trees, serving_rows

log = logging.getLogger(__name__)
BATCHABLE = ("eagle", "vanilla", "ngram", "draft_model", "medusa")


def validate_sweep(cfg: ServeConfig) -> list[str]:
    """The methods to sweep; EagleLabError on bad concurrency values."""
    levels = list(cfg.bench.concurrency)
    if any(c < 1 for c in levels) or len(set(levels)) != len(levels):
        raise EagleLabError(f"bench.concurrency needs distinct values >= 1, got {levels}")
    methods = [m for m in cfg.bench.methods if m in BATCHABLE]
    skipped = [m for m in cfg.bench.methods if m not in BATCHABLE]
    if skipped:
        log.info("bench.concurrency: %s not served by the batched scheduler: skipped", ", ".join(skipped))
    if not methods:
        raise EagleLabError(f"bench.concurrency sweeps {', '.join(BATCHABLE)}; bench.methods has none of them")
    if not cfg.bench.temperatures:
        raise EagleLabError("bench.temperatures is empty (e.g. bench.temperatures=[0.0])")
    for temperature in cfg.bench.temperatures:
        SamplingParams(temperature, cfg.top_k, cfg.top_p)
    return sorted(methods, key=lambda m: m != "vanilla")  # vanilla first: the greedy reference


def run_sweep(cfg: ServeConfig, run_dir: Path) -> dict[str, Any]:

    methods = validate_sweep(cfg)
    prompts = load_bench_prompts(cfg.bench.dataset, cfg.bench.limit)
    target = load_target(cfg.target)
    encoded = [encode_prompt(target.tokenizer, p, cfg.chat, cfg.system) for p in prompts]
    levels = sorted(cfg.bench.concurrency)
    if levels[-1] > len(encoded):
        log.warning("bench.concurrency %d > %d prompts: the batch can never fill (raise bench.limit)", levels[-1],
                    len(encoded))
    backend = build_backend(target, cfg.compile, cfg.decoding)
    # every method's sequences take rows of one static cache (methods run in turns, never together)
    shared_rows = serving_rows(backend, max(levels), max(len(ids) for ids in encoded) + cfg.max_new_tokens,
                               cfg.decoding)
    engines = {method: _engine(cfg, method, target, max(levels), backend, shared_rows) for method in methods}
    rows = []
    for temperature in cfg.bench.temperatures:
        params = SamplingParams(temperature, cfg.top_k, cfg.top_p)
        if cfg.bench.warmup:
            for engine, per_batch in engines.values():
                # untimed; compiled, each batch size's graphs are built here rather than inside a timed level
                for level in levels if shared_rows.backend.compiled else [1]:
                    run_level(engine, target, per_batch, encoded[: max(cfg.bench.warmup, level)], params, cfg, level,
                              shared_rows)
        for turn, level in enumerate(levels):
            # the methods take turns at each level (first one rotating), so a drift in the machine's
            # speed over the sweep falls on every method alike (bench.interleave)
            order = methods[turn % len(methods):] + methods[: turn % len(methods)] if cfg.bench.interleave \
                else methods
            for method in order:
                engine, per_batch = engines[method]
                log.info("sweep: %s at T=%g, %d concurrent clients, %d prompts", method, temperature, level,
                         len(encoded))
                result = run_level(engine, target, per_batch, encoded, params, cfg, level, shared_rows)
                rows.append({"method": method, "temperature": float(temperature), "concurrency": level,
                             **result, "tree": tree_label(per_batch, level, params)})
    rows.sort(key=lambda r: (r["temperature"], methods.index(r["method"]), r["concurrency"]))
    mark_mismatches(rows)
    results = {"config": {"target": target.name, "device": str(target.device), "dtype": str(target.dtype),
                          "dataset": cfg.bench.dataset, "prompts": len(encoded), "max_new_tokens": cfg.max_new_tokens,
                          "ignore_eos": cfg.ignore_eos, "tree_online": cfg.tree.online, "methods": methods,
                          "decoding": backend.name,
                          "concurrency": levels},
               "trees": {m: {str(t): {str(b): tree_shape(per_batch, b, SamplingParams(t)) for b in levels}
                             for t in cfg.bench.temperatures} for m, (_, per_batch) in engines.items()},
               "rows": rows}
    write_sweep(results, run_dir)
    return results


def _engine(cfg: ServeConfig, method: str, target: Target, max_batch: int, backend, rows: StaticRows):
    """The server's engine for `method`, and its trees:
    {"prototype": the drafter, "trees": the policy at batch >= 2}."""
    method_cfg = replace(cfg, method=method, server=replace(cfg.server, max_batch=max_batch))
    prototype = make_drafter(method_cfg, target, backend)
    per_batch = {"prototype": prototype, "trees": batch_trees(method_cfg, target, prototype, rows)}
    return Engine(method_cfg, target, drafter_factory(prototype), rows), per_batch


def tree_shape(per_batch: dict, batch: int, params: SamplingParams) -> dict | None:
    """The tree a row at these parameters drafts at `batch` (depth, topk, total_tokens, ngram_tokens);
    None for a drafter without a tree shape."""
    prototype = per_batch["prototype"]
    if not isinstance(prototype, EagleDrafter):
        return None
    if per_batch["trees"].plain(batch, params):
        return {"depth": 0, "topk": 0, "total_tokens": 0, "ngram_tokens": 0}
    shape, ngram = prototype.shape, prototype.ngram  # under tree=online: the longest chain the controller drafts
    return {**asdict(shape), "ngram_tokens": ngram.max_tokens if ngram is not None else 0}


def tree_label(per_batch: dict, batch: int, params: SamplingParams) -> str:
    """'d3 k2 n6', 'd1 k2 n2 + ngram 4', 'ngram 4' (n-gram only) or 'plain (no draft)'."""
    shape = tree_shape(per_batch, batch, params)
    if shape is None:
        return "-"
    chain = shape.get("ngram_tokens") or 0
    if shape["depth"] == 0:
        return f"ngram {chain}" if chain else "plain (no draft)"
    head = f"d{shape['depth']} k{shape['topk']} n{shape['total_tokens']}"
    return f"{head} + ngram {chain}" if chain else head


def run_level(engine, target: Target, per_batch: dict, encoded: list[list[int]], params: SamplingParams,
              cfg: ServeConfig, level: int, rows: StaticRows) -> dict[str, Any]:
    """All prompts through a fresh BatchScheduler (max_batch = level) from `level` closed-loop clients.
    The loop starts once every client has queued its first request, so the level is reached from the first
    round whatever the threads' start order (on a tiny target a request can finish before the next thread runs)."""
    scheduler = BatchScheduler(level, len(encoded) + level, target, rows, per_batch["trees"])
    plans = [Plan(ids, params, cfg.max_new_tokens, [], cfg.ignore_eos, cfg.seed) for ids in encoded]
    outputs: list[list[int] | None] = [None] * len(plans)
    latency = [0.0] * len(plans)
    errors: list[str] = []
    lock, cursor = threading.Lock(), [0]
    first_wave, queued = threading.Event(), [0]

    def client() -> None:
        while True:
            with lock:
                index, cursor[0] = cursor[0], cursor[0] + 1
            if index >= len(plans):
                return
            done, last = threading.Event(), []

            def deliver(event, last=last, done=done) -> None:  # on the scheduler thread
                if isinstance(event, Finished) or not hasattr(event, "token_ids"):
                    last.append(event)
                    done.set()

            start = time.perf_counter()
            scheduler.submit(Job(start=lambda p=plans[index], i=index: engine.start(p, f"sweep-{i}"), deliver=deliver,
                                 name=f"sweep-{index}"))
            with lock:
                queued[0] += 1
                if queued[0] == min(level, len(plans)):
                    first_wave.set()
            done.wait()
            latency[index] = time.perf_counter() - start
            if isinstance(last[0], Finished):
                outputs[index] = last[0].token_ids
            else:
                errors.append(f"prompt {index}: {last[0].message}")

    threads = [threading.Thread(target=client) for _ in range(level)]
    clock: dict[str, float] = {}

    def drive() -> None:  # the clients, then the scheduler's stop, from a thread beside the loop
        clock["start"] = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        clock["wall"] = time.perf_counter() - clock["start"]
        scheduler.stop()

    driver = threading.Thread(target=drive)
    driver.start()
    while not first_wave.wait(0.05) and driver.is_alive():  # a client that died before queuing ends the wait
        pass
    scheduler.run()  # on this thread, which loaded the model (scheduler.ModelThread says why)
    driver.join()
    wall = clock["wall"]
    if errors:
        raise EagleLabError(f"sweep requests failed: {'; '.join(errors)}")
    new_tokens = sum(len(o) for o in outputs)
    return {"requests": len(plans), "new_tokens": new_tokens, "wall_s": wall, "tokens_per_s": new_tokens / wall,
            "latency_p50_s": float(np.percentile(latency, 50)), "latency_p95_s": float(np.percentile(latency, 95)),
            "batch_sizes": {str(b): n for b, n in sorted(scheduler.batch_sizes.items())}, "token_ids": outputs}


def mark_mismatches(rows: list[dict[str, Any]]) -> None:
    """At T=0: each row's requests that differ from its method at the lowest concurrency and from vanilla."""
    for row in rows:
        row["greedy_mismatches"] = row["vanilla_mismatches"] = None
        if row["temperature"] != 0.0:
            continue
        same = [r for r in rows if r["temperature"] == 0.0 and r["method"] == row["method"]]
        base = min(same, key=lambda r: r["concurrency"])
        row["greedy_mismatches"] = sum(a != b for a, b in zip(row["token_ids"], base["token_ids"]))
        vanilla = [r for r in rows if r["temperature"] == 0.0 and r["method"] == "vanilla"]
        if vanilla:
            ref = min(vanilla, key=lambda r: r["concurrency"])
            row["vanilla_mismatches"] = sum(a != b for a, b in zip(row["token_ids"], ref["token_ids"]))
