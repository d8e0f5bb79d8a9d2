"""serve.py through a subprocess: the JSON contract, streamed text, and refusals of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle_lab.drafters.eagle.head import save_head
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.models.target import TargetConfig, load_target
from eagle_lab.models.tiny import TinyModelConfig

pytestmark = pytest.mark.slow  # every test here starts serve.py in a process of its own

ROOT = Path(__file__).resolve().parents[1]


def serve(*overrides: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, "serve.py", f"hydra.run.dir={tmp_path}/run", *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )


def json_rows(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def test_json_contract_and_methods_agree(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "Tell me a story."}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                   {"role": "user", "content": "more"}]}) + "\n"
    )
    results = {}
    for method in ("eagle", "vanilla"):
        run = serve("target=tiny_qwen2", f"prompts_file={prompts}", "max_new_tokens=24", "ignore_eos=true",
                    "output=json", f"method={method}", tmp_path=tmp_path)
        assert run.returncode == 0, run.stderr
        rows = json_rows(run.stdout)
        assert len(rows) == 2
        for row in rows:
            for key in ("text", "token_ids", "new_tokens", "target_forwards", "accept_length", "wall_s",
                        "tokens_per_s"):
                assert key in row, key
            assert row["new_tokens"] == len(row["token_ids"]) == 24
            assert row["accept_length"] == pytest.approx(row["new_tokens"] / row["target_forwards"], abs=1e-3)
        results[method] = [row["token_ids"] for row in rows]
    assert results["eagle"] == results["vanilla"]


def test_ngram_methods_agree_with_vanilla(tmp_path):
    """method=ngram (no head) and method=eagle with ngram.enabled=true (tree=online prices the chains)."""
    common = ("target=tiny_llama", "prompt=one two three one two three one two three", "chat=false",
              "max_new_tokens=20", "ignore_eos=true", "output=json", "ngram.min_match=1")
    outputs = {}
    for name, extra in (("vanilla", ["method=vanilla"]), ("ngram", ["method=ngram"]),
                        ("hybrid", ["method=eagle", "ngram.enabled=true"])):
        run = serve(*common, *extra, tmp_path=tmp_path)
        assert run.returncode == 0, run.stderr[-2000:]
        row = json_rows(run.stdout)[0]
        assert row["new_tokens"] == 20 and row["accepted_ngram_tokens"] <= row["accepted_draft_tokens"]
        outputs[name] = row["token_ids"]
        if name == "hybrid":
            assert "tree=online: each round drafts a chain of 0-3 tokens (and merges n-gram" in run.stderr
    assert outputs["ngram"] == outputs["vanilla"] and outputs["hybrid"] == outputs["vanilla"]


def test_draft_model_method_agrees_with_vanilla(tmp_path):
    """method=draft_model with a one-layer tiny LM as the draft model, chain and tree."""
    common = ("target=tiny_llama", "prompt=Tell me a story.", "max_new_tokens=20", "ignore_eos=true", "output=json")
    outputs = {}
    for name, extra in (("vanilla", ["method=vanilla"]),
                        ("chain", ["method=draft_model", "draft_model.source=tiny", "draft_model.tiny.num_layers=1"]),
                        ("tree", ["method=draft_model", "draft_model.source=tiny", "tree=cpu"])):
        run = serve(*common, *extra, tmp_path=tmp_path)
        assert run.returncode == 0, run.stderr[-2000:]
        outputs[name] = json_rows(run.stdout)[0]["token_ids"]
    assert outputs["chain"] == outputs["vanilla"] and outputs["tree"] == outputs["vanilla"]


def test_streams_text_to_stdout_and_logs_to_stderr(tmp_path):
    common = ("target=tiny_llama", "prompt=Hello there", "max_new_tokens=16", "ignore_eos=true", "temperature=0.8",
              "seed=3")
    streamed = serve(*common, tmp_path=tmp_path)
    as_json = serve(*common, "output=json", tmp_path=tmp_path)
    assert streamed.returncode == 0 and as_json.returncode == 0, streamed.stderr + as_json.stderr
    assert streamed.stdout.rstrip("\n") == json_rows(as_json.stdout)[0]["text"]
    assert "target forwards" in streamed.stderr  # progress and stats on stderr


def test_stop_string_cuts_text(tmp_path):
    run = serve("target=tiny_llama", "prompt=Hello", "max_new_tokens=40", "ignore_eos=true", "output=json",
                tmp_path=tmp_path)
    text = json_rows(run.stdout)[0]["text"]
    start = next(i for i in range(3, len(text) - 1) if text[i:i + 2].isalnum())
    stop = text[start:start + 2]
    cut = serve("target=tiny_llama", "prompt=Hello", "max_new_tokens=40", "ignore_eos=true", "output=json",
                f"stop=[{json.dumps(stop)}]", tmp_path=tmp_path)
    row = json_rows(cut.stdout)[0]
    assert row["stop_reason"] == "stop" and row["text"] == text[: text.index(stop)]


@pytest.fixture(scope="module")
def foreign_heads(tmp_path_factory):
    """Heads saved for other targets: another family, another hidden size."""
    root = tmp_path_factory.mktemp("heads")
    qwen = load_target(TargetConfig(name="tiny_qwen2", source="tiny", tiny=TinyModelConfig(family="qwen2")))
    save_head(new_head(qwen), root / "qwen2")
    wide = load_target(TargetConfig(name="wide", source="tiny", tiny=TinyModelConfig(hidden_size=96)))
    save_head(new_head(wide), root / "wide")
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{not json")
    (root / "broken" / "model.safetensors").write_text("")
    return root


def bad_inputs(tmp: Path, heads: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "bad.jsonl").write_text('{"prompt": "ok"}\n{"prompt": \n')
    (tmp / "wrong.jsonl").write_text('{"text": "no prompt key"}\n')
    (tmp / "empty_prompt.jsonl").write_text('{"prompt": "   "}\n')
    return {
        "missing head": (["head.path=/nonexistent/head"], "does not exist"),
        "head of another family": ([f"head.path={heads / 'qwen2'}"], "family"),
        "head of another width": ([f"head.path={heads / 'wide'}"], "hidden size"),
        "malformed head config": ([f"head.path={heads / 'broken'}"], "not an eagle_lab head config"),
        "unreadable prompts file": (["prompts_file=/nonexistent.jsonl"], "does not exist"),
        "malformed prompts file": ([f"prompts_file={tmp / 'bad.jsonl'}"], "not valid JSON"),
        "prompts file without prompt": ([f"prompts_file={tmp / 'wrong.jsonl'}"], "expected"),
        "empty prompt in file": ([f"prompts_file={tmp / 'empty_prompt.jsonl'}"], "empty"),
        "empty prompt": (["prompt="], "empty"),
        "prompt longer than context": (["prompt=" + "long " * 40, "target.max_context=64"], "context"),
        "negative temperature": (["prompt=hi", "temperature=-0.5"], "temperature"),
        "top_p zero": (["prompt=hi", "temperature=1", "top_p=0"], "top_p"),
        "top_p above one": (["prompt=hi", "temperature=1", "top_p=1.5"], "top_p"),
        "max_new_tokens zero": (["prompt=hi", "max_new_tokens=0"], "max_new_tokens"),
        "ngram min_match above max_match": (["ngram.min_match=5", "ngram.max_match=2"], "ngram.max_match"),
        "ngram max_tokens zero": (["method=ngram", "ngram.max_tokens=0"], "ngram.max_tokens"),
        "ngram min_match zero": (["ngram.enabled=true", "ngram.min_match=0"], "ngram.min_match"),
        "unknown method": (["method=lookahead"], "method"),
        "medusa without a path": (["method=medusa"], "medusa.path=DIR"),
        "medusa path not a medusa head": (["method=medusa", f"medusa.path={tmp}"], "not a Medusa head directory"),
        "draft model without a path": (["method=draft_model"], "draft_model.path=DIR"),
        "draft model path not a model": (["method=draft_model", f"draft_model.path={tmp}"], "not a model directory"),
        "tree batch_min_gain below one": (["tree.batch_min_gain=0.9"], "tree.batch_min_gain"),
        "online tree without a chain": (["tree.depth=0"], "tree.depth"),
        "fixed tree without a shape": (["tree=cpu", "tree.topk=0"], "tree.depth, tree.topk and tree.total_tokens"),
    }


CASES = list(bad_inputs(Path("/tmp"), Path("/tmp")).keys())


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_refused_cleanly(case, tmp_path, foreign_heads):
    overrides, expected = bad_inputs(tmp_path, foreign_heads)[case]
    if not any(o.startswith("prompt") for o in overrides):
        overrides = ["prompt=hi", *overrides]
    run = serve("target=tiny_llama", *overrides, tmp_path=tmp_path)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stderr
    assert expected in errors[0], errors[0]
    assert run.stdout == ""


@pytest.mark.parametrize("overrides", [["target=no_such_target"], ["no_such_key=1"], ["temperature=hot"]])
def test_bad_config_is_refused_by_hydra(overrides, tmp_path):
    run = serve("prompt=hi", *overrides, tmp_path=tmp_path)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr and run.stdout == ""


def test_max_new_tokens_is_checked_once_where_the_typed_config_is_built():
    from eagle_lab.config import ServeConfig
    from eagle_lab.errors import EagleLabError

    with pytest.raises(EagleLabError, match=r"^max_new_tokens must be >= 1, got 0$"):
        ServeConfig(max_new_tokens=0)
    assert ServeConfig(max_new_tokens=1).max_new_tokens == 1
