"""llama.cpp's methods in the bench: the command lines they run, what is read back from llama.cpp's output, and
a skip in one line where llama.cpp or the GGUF files are missing. The tools are stand-ins here
(tests/llama_cpp_fakes.py); tests/test_llama_cpp.py runs the real converter where llama.cpp's source is present."""

import json

import pytest
import torch

from eagle_lab.benchmark.llama_cpp_runs import parse_timing, reply_text
from eagle_lab.benchmark.run import run_bench
from eagle_lab.config import BenchConfig, HeadConfig, ServeConfig, TreeConfig
from eagle_lab.errors import EagleLabError
from eagle_lab.models.llama_cpp import ENV
from eagle_lab.models.target import TargetConfig
from tests.llama_cpp_fakes import fake_gguf_dir, fake_llama_cpp, logged_calls

METHODS = ["vanilla", "llamacpp", "llamacpp_eagle3", "llamacpp_ngram"]

# lines as llama.cpp 0.3.36's tools print them
COMPLETION_LOG = """common_perf_print: prompt eval time =     209.37 ms /    37 tokens (    5.66 ms per token,   176.72 tokens per second)
common_perf_print:        eval time =    1594.13 ms /    23 runs   (   69.31 ms per token,    14.43 tokens per second)"""  # noqa: E501 (llama.cpp's lines, verbatim)
SPECULATIVE_LOG = """0.06.146.669 I encoded   37 tokens in    0.266 seconds, speed:  138.868 t/s
0.06.146.687 I decoded   66 tokens in    5.065 seconds, speed:   13.031 t/s
0.06.146.711 I n_draft   = 3
0.06.146.722 I n_predict = 66
0.06.146.734 I n_drafted = 145
0.06.146.745 I n_accept  = 17
common_perf_print: prompt eval time =    3943.67 ms /   232 tokens (   17.00 ms per token,    58.83 tokens per second)"""  # noqa: E501 (verbatim)


def test_llama_cpp_logs_are_read():
    plain = parse_timing("llamacpp", COMPLETION_LOG)
    assert (plain.prompt_s, plain.decode_s, plain.decode_runs) == (0.20937, 1.59413, 23)
    speculative = parse_timing("llamacpp_eagle3", SPECULATIVE_LOG)
    assert (speculative.prompt_s, speculative.decode_s) == (0.266, 5.065)
    assert (speculative.generated, speculative.accepted) == (66, 17)
    with pytest.raises(EagleLabError, match="n_accept"):
        parse_timing("llamacpp_ngram", COMPLETION_LOG)


def test_the_reply_is_cut_from_what_the_tools_print():
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert reply_text("\n\n" + prompt + "Hello there.\nBye" + "\n\n\n", prompt) == "Hello there.\nBye"
    assert reply_text("\nHello there.\n", prompt) == "Hello there."
    assert reply_text("\nHello there. [end of text]\n", prompt) == "Hello there."  # llama-completion at eos


def bench_config(tmp_path, gguf_dir="", methods=METHODS, temperatures=(0.0, 1.0), extra=()) -> ServeConfig:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["Tell me about the sea.", "Count to four"]))
    return ServeConfig(compile="false", target=TargetConfig(name="tiny_llama", source="tiny", device="cpu"),
                       head=HeadConfig(path="random"), tree=TreeConfig(online=False, depth=2, topk=2, total_tokens=3),
                       bench=BenchConfig(dataset=str(prompts), limit=0, methods=list(methods),
                                         temperatures=list(temperatures), warmup=0, gguf_dir=gguf_dir,
                                         llama_cpp_args=list(extra)),
                       mode="bench", max_new_tokens=12, ignore_eos=True)


def test_llama_cpp_methods_run_beside_eagle_lab_on_the_same_prompts_budget_and_threads(tmp_path, monkeypatch):
    source, calls = fake_llama_cpp(tmp_path / "llama.cpp")
    monkeypatch.setenv(ENV, str(source))
    cfg = bench_config(tmp_path, str(fake_gguf_dir(tmp_path / "gguf")), extra=["--no-repack"])
    results = run_bench(cfg, out_dir=tmp_path / "run")
    greedy, sampled = results["summary"]["0.0"], results["summary"]["1.0"]
    for rows in (greedy, sampled):
        assert all(rows[m]["status"] == "ok" and rows[m]["new_tokens"] == 2 * 12 for m in METHODS)
        assert rows["llamacpp"]["tau"] == 1.0
        assert rows["llamacpp_eagle3"]["tau"] == pytest.approx(2.0)  # 12 tokens, 6 of them accepted drafts
        # plain: 10 ms of prompt + 11 of the 12 two-millisecond steps (the 12th sampled a 13th token)
        assert rows["llamacpp"]["tokens_per_s"] == pytest.approx(24 / (2 * (0.010 + 0.022)))
        assert rows["llamacpp_eagle3"]["tokens_per_s"] == pytest.approx(24 / (2 * (0.010 + 0.012)))
    assert greedy["llamacpp_eagle3"]["greedy_mismatches"] == 0  # against llama.cpp's own plain output
    assert greedy["vanilla"]["greedy_mismatches"] == 0
    commands = logged_calls(calls)
    assert len(commands) == 2 * 2 * 3  # temperatures x prompts x methods
    threads = str(torch.get_num_threads())
    for command in commands:
        tool, args = command[0], command[1:]
        assert args[args.index("-t") + 1] == threads and args[args.index("-m") + 1].endswith("target-f32.gguf")
        assert args[args.index("-n") + 1] == ("13" if tool == "llama-completion" else "12")
        assert "--ignore-eos" in args and args[-1] == "--no-repack"  # bench.llama_cpp_args, last
    eagle3 = [c for c in commands if "draft-eagle3" in c]
    assert len(eagle3) == 4 and all(c[c.index("--spec-draft-n-max") + 1] == "3" and "-md" in c for c in eagle3)
    assert sum("ngram-simple" in c for c in commands) == 4
    temperatures = {c[c.index("--temp") + 1] for c in commands}
    assert temperatures == {"0", "1.0"}
    table = (tmp_path / "run" / "results.md").read_text()
    assert "| 0.0 | llamacpp_eagle3 |" in table


def test_without_llama_cpp_its_methods_are_skipped_in_one_line(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(ENV, raising=False)
    results = run_bench(bench_config(tmp_path, temperatures=(0.0,)), out_dir=tmp_path / "run")
    rows = results["summary"]["0.0"]
    assert rows["vanilla"]["status"] == "ok"
    assert all(rows[m]["status"] == "skipped" and "no llama.cpp" in rows[m]["note"] for m in METHODS[1:])
    assert sum("skipped: no llama.cpp" in r.message for r in caplog.records) == 1


def test_llama_cpp_without_gguf_files_is_skipped_and_a_missing_head_refused(tmp_path, monkeypatch):
    source, _ = fake_llama_cpp(tmp_path / "llama.cpp")
    monkeypatch.setenv(ENV, str(source))
    results = run_bench(bench_config(tmp_path, temperatures=(0.0,)), out_dir=tmp_path / "run")
    assert "bench.gguf_dir" in results["summary"]["0.0"]["llamacpp"]["note"]
    gguf = fake_gguf_dir(tmp_path / "gguf")
    (gguf / "head.gguf").unlink()
    with pytest.raises(EagleLabError, match="no head.gguf"):
        run_bench(bench_config(tmp_path, str(gguf)), out_dir=tmp_path / "run2")
