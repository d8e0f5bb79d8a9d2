"""Data-parallel training: two ranks (torchrun, gloo on CPU) take the same steps as one rank at the
same global batch, and a two-rank run resumes from its own checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_train import run_script

pytestmark = pytest.mark.slow

COMMON = ("experiment=smoke", "trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every=100",
          "trainer.save_every=100", "loss.noise_std=0", "trainer.cpu_autocast=off")


def train(tmp_path, name: str, *overrides: str, ranks: int = 1) -> list[float]:
    run_dir = tmp_path / name
    launcher = ("-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}") if ranks > 1 else ()
    done = run_script(*launcher, "train.py", *COMMON, f"hydra.run.dir={run_dir}",
                      f"trainer.features_dir={tmp_path / 'features'}", *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r.get("loss") is not None]


def test_two_ranks_match_one_rank_and_gradient_accumulation_at_the_same_global_batch(tmp_path):
    one_rank = train(tmp_path, "one", "trainer.micro_batch_size=4")
    accumulated = train(tmp_path, "accum", "trainer.micro_batch_size=2", "trainer.grad_accum=2")
    two_ranks = train(tmp_path, "two", "trainer.micro_batch_size=2", ranks=2)
    assert len(one_rank) == 6
    assert accumulated == pytest.approx(one_rank, rel=1e-5)
    assert two_ranks == pytest.approx(one_rank, rel=1e-5)
    assert one_rank[-1] < one_rank[0]  # it trains
    # the held-out set is split over the ranks (same batches of 2 as one rank's) and the counts summed
    assert final_eval(tmp_path / "two") == pytest.approx(final_eval(tmp_path / "accum"), rel=1e-6)


def final_eval(run_dir: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "eval_acc_1" in r][-1]
    return {k: v for k, v in last.items() if k.startswith("eval_")}


def test_two_ranks_resume_from_their_checkpoint(tmp_path):
    whole = train(tmp_path, "whole", "trainer.micro_batch_size=2", ranks=2)
    first = train(tmp_path, "parts", "trainer.micro_batch_size=2", "trainer.stop_at=3", ranks=2)
    rest = train(tmp_path, "parts", "trainer.micro_batch_size=2", "trainer.resume=true", ranks=2)
    assert len(first) == 3 and first + rest[3:] == pytest.approx(whole, rel=1e-5)
    assert (tmp_path / "parts" / "head" / "model.safetensors").is_file()


def test_the_readme_gives_the_tested_launch():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "torchrun --standalone --nproc_per_node=2 train.py experiment=smoke trainer.micro_batch_size=2" in readme
