"""The concurrency sweep (serve.py mode=bench bench.concurrency=[...]) on the tiny target."""

from __future__ import annotations

import json

import pytest

from eagle_lab.benchmark.run import run_bench
from eagle_lab.config import BenchConfig, HeadConfig, ServeConfig, TreeConfig
from eagle_lab.errors import EagleLabError
from eagle_lab.models.target import TargetConfig

PROMPTS = ["Tell me about the sea.", "def add(a, b):", "Count: one two three four", "Hi",
           "A longer prompt, with words."]


def sweep_config(tmp_path, **bench) -> ServeConfig:
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS) + "\n", encoding="utf-8")
    return ServeConfig(
        target=TargetConfig(name="tiny_llama", source="tiny", device="cpu"),
        head=HeadConfig(path="random"),
        tree=TreeConfig(online=False, depth=3, topk=2, total_tokens=6),
        bench=BenchConfig(dataset=str(prompts_file), limit=0, **bench),
        mode="bench", max_new_tokens=10, ignore_eos=True, chat=False, compile="false",
    )


def test_sweep_reports_each_method_and_level_and_is_lossless(tmp_path):
    cfg = sweep_config(tmp_path, methods=["eagle", "vanilla", "hf_greedy"], temperatures=[0.0], warmup=1,
                       concurrency=[1, 4])
    results = run_bench(cfg, out_dir=tmp_path / "run")
    rows = results["rows"]
    assert [(r["method"], r["concurrency"]) for r in rows] == [("vanilla", 1), ("vanilla", 4), ("eagle", 1),
                                                              ("eagle", 4)]  # hf_greedy is not served
    for row in rows:
        assert row["requests"] == len(PROMPTS) and row["new_tokens"] == 10 * len(PROMPTS)
        assert row["greedy_mismatches"] == 0 and row["vanilla_mismatches"] == 0  # batching is lossless
        assert 0 < row["latency_p50_s"] <= row["latency_p95_s"] and row["tokens_per_s"] > 0
    assert max(int(b) for b in rows[1]["batch_sizes"]) == 4 and set(rows[0]["batch_sizes"]) == {"1"}
    assert rows[3]["tree"] == "d3 k2 n6 + ngram 8" and rows[1]["tree"] == "-"  # hybrid drafting is on by default
    for name in ("sweep.json", "sweep.md", "sweep.png"):
        assert (tmp_path / "run" / name).stat().st_size > 0
    assert "| 0.0 | eagle | 4 |" in (tmp_path / "run" / "sweep.md").read_text(encoding="utf-8")


def test_sweep_refuses_bad_levels_and_unservable_methods(tmp_path):
    with pytest.raises(EagleLabError, match="distinct values"):
        run_bench(sweep_config(tmp_path, methods=["eagle"], concurrency=[2, 2]), out_dir=tmp_path / "a")
    with pytest.raises(EagleLabError, match="none of them"):
        run_bench(sweep_config(tmp_path, methods=["hf_greedy"], concurrency=[1]), out_dir=tmp_path / "b")
