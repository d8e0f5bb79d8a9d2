"""Per-method figures from the runs: tokens/s, tau, speedup, acceptance by depth, per-prompt records."""

from __future__ import annotations

from typing import Any

from eagle_lab.benchmark.context import Run
from eagle_lab.benchmark.llama_cpp_runs import LLAMA_CPP_METHODS
from eagle_lab.benchmark.methods import split_method
from eagle_lab.benchmark.report import REFERENCE
from eagle_lab.builders import SPECULATIVE
from eagle_lab.decoding.sequence import GenerationStats


def plain_reference(method: str) -> str:
    """The method whose greedy output `method`'s must equal: the same engine's plain decoding."""
    return "llamacpp" if method in LLAMA_CPP_METHODS else REFERENCE


def summarise(methods: list[str], runs: dict[str, list[Run]], greedy: bool,
              skipped: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Per-method figures at one temperature; `runs` lacks the methods that were skipped (`skipped`: why, by
    method; greedy-only methods at T > 0 otherwise). Greedy outputs are compared with the same engine's plain
    decoding (eagle_lab's vanilla; llama.cpp's own for its methods)."""
    skipped = skipped or {}
    summary: dict[str, dict[str, Any]] = {}
    for method in methods:
        if method not in runs:
            summary[method] = {"status": "skipped",
                               "note": skipped.get(method, "greedy only: skipped at temperature > 0")}
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
        if split_method(method)[0] in ("eagle", "draft_model", "medusa"):  # trees without n-gram chains
            row["acceptance_by_depth"] = acceptance_by_depth([r.stats for r in method_runs if r.stats])
        if split_method(method)[0] in SPECULATIVE:
            row["ngram_share"] = ngram_share([r.stats for r in method_runs if r.stats])
        reference = runs.get(plain_reference(method))
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
    """One record per (method, prompt) at this temperature; `matches_plain`: greedy output equal to the same
    engine's plain decoding."""
    records = []
    for method, method_runs in runs.items():
        reference = runs.get(plain_reference(method))
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
                "matches_plain": (run.token_ids == reference[index].token_ids
                                    if greedy and reference is not None else None),
                "token_ids": run.token_ids,
                "text": tokenizer.decode(run.token_ids, skip_special_tokens=True),
            })
    return records
