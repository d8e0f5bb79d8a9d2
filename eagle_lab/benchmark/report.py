"""Benchmark reports: results.json, a Markdown table (also printed) and a PNG plot."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
REFERENCE = "vanilla"  # the method every speedup is measured against


def write_outputs(results: dict[str, Any], run_dir: Path) -> str:
    """results.json, results.md and bench.png in `run_dir`; the table also goes to stdout."""
    (run_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    table = write_markdown(results)
    (run_dir / "results.md").write_text(table, encoding="utf-8")
    plot(results, run_dir / "bench.png")
    print(table, flush=True)
    log.info("wrote %s, %s and %s", run_dir / "results.json", run_dir / "results.md", run_dir / "bench.png")
    return table


def write_markdown(results: dict[str, Any]) -> str:
    """The summary as Markdown: one row per (temperature, method), then EAGLE's acceptance by depth."""
    cfg = results["config"]
    tree = cfg["tree"] or {"depth": "-", "topk": "-", "total_tokens": "-"}
    lines = [
        f"## Benchmark: {cfg['target']} on {cfg['dataset']}",
        "",
        f"{cfg['num_prompts']} prompts, max_new_tokens {cfg['max_new_tokens']}, ignore_eos {cfg['ignore_eos']}, "
        f"device {cfg['device']} ({cfg['dtype']}), head {cfg['head'] or '-'}, tree depth {tree['depth']} / "
        f"topk {tree['topk']} / {tree['total_tokens']} tokens{' (tree=online)' if cfg.get('tree_online') else ''}; "
        f"torch {cfg['torch']}, transformers {cfg['transformers']}",
        *_ngram_lines(cfg),
        *_llama_cpp_lines(cfg),
        "",
        "| T | method | tokens/s | tau | speedup | mean wall/prompt (s) | greedy mismatches | n-gram share | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for temperature, methods in results["summary"].items():
        for method, row in methods.items():
            if row["status"] != "ok":
                lines.append(f"| {temperature} | {method} | - | - | - | - | - | - | {row['note']} |")
                continue
            mismatches = "-" if row["greedy_mismatches"] is None else f"{row['greedy_mismatches']}/{row['prompts']}"
            note = "reference" if method == REFERENCE else row["note"]
            lines.append(
                f"| {temperature} | {method} | {_fmt(row['tokens_per_s'], '.1f')} | {_fmt(row['tau'], '.2f')} | "
                f"{_fmt(row['speedup'], '.2f', 'x')} | {_fmt(row['mean_wall_s'], '.3f')} | {mismatches} | "
                f"{_fmt(row.get('ngram_share'), '.2f')} | {note} |"
            )
    depth_rows = {(t, method): row["acceptance_by_depth"] for t, m in results["summary"].items()
                  for method, row in m.items() if row.get("acceptance_by_depth")}
    if depth_rows:
        depth = max(len(rows) for rows in depth_rows.values())
        lines += ["", "Acceptance rate by tree depth (accepted / reached):", "",
                  "| T | method | " + " | ".join(f"d={d}" for d in range(1, depth + 1)) + " |",
                  "|---|---|" + "---:|" * depth]
        for (temperature, method), rows in depth_rows.items():
            cells = [f"{_fmt(r['rate'], '.2f')} ({r['accepted']}/{r['reached']})" for r in rows]
            cells += ["-"] * (depth - len(cells))
            lines.append(f"| {temperature} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ngram_lines(cfg: dict[str, Any]) -> list[str]:
    """The n-gram settings, and the tree and chain length eagle+ngram ran with, when n-gram methods ran."""
    ngram = cfg.get("ngram")
    if not ngram:
        return []
    line = (f"n-gram: suffix match {ngram['min_match']}-{ngram['max_match']} tokens, chains of up to "
            f"{ngram['max_tokens']} tokens")
    hybrid = cfg.get("hybrid")
    if hybrid:
        tree = hybrid["tree"]
        line += (f"; eagle+ngram ran tree depth {tree['depth']} / topk {tree['topk']} / {tree['total_tokens']} "
                 f"tokens with chains of {hybrid['ngram_tokens']} tokens")
    return ["", line + " (n-gram share: accepted draft tokens from n-gram branches / all accepted draft tokens)"]


def _llama_cpp_lines(cfg: dict[str, Any]) -> list[str]:
    llama = cfg.get("llama_cpp")
    if not llama:
        return []
    return [f"llama.cpp: target {llama['target']}, head {llama['head'] or '-'}, EAGLE-3 chains of {llama['draft']} "
            "tokens, same threads; its methods' greedy outputs are compared with llamacpp's"]


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def plot(results: dict[str, Any], path: Path) -> None:
    """Two panels: EAGLE's acceptance rate by depth, and tokens/s by method (bars per temperature)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    summary = results["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    plotted = False
    for temperature, methods in summary.items():
        for method, row in methods.items():
            rows = row.get("acceptance_by_depth") or []
            points = [(r["depth"], r["rate"]) for r in rows if r["rate"] is not None]
            if points:
                left.plot(*zip(*points), marker="o", label=f"{method} T={temperature}")
                plotted = True
    left.set(title="Acceptance rate by tree depth", xlabel="tree depth d",
             ylabel="P(accept >= d | tree reached d)", ylim=(0, 1.05))
    if plotted:
        left.legend()
        left.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        left.text(0.5, 0.5, "eagle not run", ha="center", va="center", transform=left.transAxes)

    methods = list(results["config"]["methods"])
    width = 0.8 / max(len(summary), 1)
    for offset, (temperature, rows) in enumerate(summary.items()):
        xs = [i + (offset - (len(summary) - 1) / 2) * width for i in range(len(methods))]
        heights = [rows.get(m, {}).get("tokens_per_s") or 0.0 for m in methods]
        right.bar(xs, heights, width=width, label=f"T={temperature}")
    right.set_xticks(range(len(methods)), methods, rotation=15)
    right.set(title="Throughput by method", ylabel="tokens/s")
    right.legend()
    cfg = results["config"]
    fig.suptitle(f"{cfg['target']} on {cfg['dataset']} ({cfg['num_prompts']} prompts, {cfg['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_sweep(results: dict[str, Any], run_dir: Path) -> str:
    """The concurrency sweep (eagle_lab/benchmark/sweep.py): sweep.json, sweep.md (also printed), sweep.png."""
    (run_dir / "sweep.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    cfg = results["config"]
    lines = [
        f"## Concurrency sweep: {cfg['target']} on {cfg['dataset']}",
        "",
        f"{cfg['prompts']} prompts per level, max_new_tokens {cfg['max_new_tokens']}, ignore_eos {cfg['ignore_eos']}, "
        f"device {cfg['device']} ({cfg['dtype']}){', tree=online' if cfg.get('tree_online') else ''}; "
        "closed-loop clients, max_batch = concurrency",
        "",
        "| T | method | clients | tokens/s | latency p50 (s) | p95 (s) | tree at this batch | rounds per batch size | "
        "greedy mismatches (vs c=1 / vs vanilla) |",
        "|---|---|---:|---:|---:|---:|---|---|---|",
    ]
    for row in results["rows"]:
        mismatch = "-" if row["greedy_mismatches"] is None else (
            f"{row['greedy_mismatches']}/{row['requests']} / "
            f"{'-' if row['vanilla_mismatches'] is None else row['vanilla_mismatches']}")
        sizes = ", ".join(f"{b}: {n}" for b, n in row["batch_sizes"].items())
        lines.append(f"| {row['temperature']} | {row['method']} | {row['concurrency']} | {row['tokens_per_s']:.1f} | "
                     f"{row['latency_p50_s']:.2f} | {row['latency_p95_s']:.2f} | {row['tree']} | {sizes} | "
                     f"{mismatch} |")
    table = "\n".join(lines) + "\n"
    (run_dir / "sweep.md").write_text(table, encoding="utf-8")
    plot_sweep(results, run_dir / "sweep.png")
    print(table, flush=True)
    log.info("wrote %s, %s and %s", run_dir / "sweep.json", run_dir / "sweep.md", run_dir / "sweep.png")
    return table


def plot_sweep(results: dict[str, Any], path: Path) -> None:
    """Two panels against the number of concurrent clients: total tokens/s, and latency p50 (p95 dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    keys = sorted({(r["method"], r["temperature"]) for r in results["rows"]})
    for method, temperature in keys:
        rows = sorted((r for r in results["rows"] if (r["method"], r["temperature"]) == (method, temperature)),
                      key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        label = f"{method} T={temperature}"
        left.plot(xs, [r["tokens_per_s"] for r in rows], marker="o", label=label)
        line, = right.plot(xs, [r["latency_p50_s"] for r in rows], marker="o", label=f"{label} p50")
        right.plot(xs, [r["latency_p95_s"] for r in rows], linestyle="--", color=line.get_color(), label=f"{label} p95")
    levels = results["config"]["concurrency"]
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(c) for c in levels])
        axis.legend(fontsize=8)
    left.set(title="Total throughput", xlabel="concurrent clients", ylabel="tokens/s")
    right.set(title="Per-request latency", xlabel="concurrent clients", ylabel="seconds")
    cfg = results["config"]
    fig.suptitle(f"{cfg['target']}: batched serving ({cfg['prompts']} prompts, {cfg['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
