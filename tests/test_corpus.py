"""The shared feature corpus: prefixes serve every data size, capture resumes by shard,
workers share shards through locks, and training reads exactly the requested data."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from eagle_lab.errors import EagleLabError
from eagle_lab.models.target import TargetConfig, load_target
from eagle_lab.training.corpus import CorpusStore, capture_split, status
from eagle_lab.training.corpus_layout import Split, claim, release
from eagle_lab.training.data import tokenize_conversation
from eagle_lab.training.features import STORE_DTYPE, compute_features

LAYERS = (1, 2)


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(name="tiny_llama", source="tiny", device="cpu"))


def conversations(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "answer " * (i % 5 + 1)}]
            for i in range(n)]


def make_split(tmp_path, convs, name="train", size=4) -> Split:
    return Split(name, convs, tmp_path / name, size)


def tokenizer_of(target):
    return lambda messages: tokenize_conversation(target.tokenizer, messages, 64)


def counts(target, convs) -> list[int]:
    tok = tokenizer_of(target)
    return [len(tok(c)[0]) for c in convs]


def test_prefix_reads_exactly_the_first_conversations_with_the_targets_features(target, tmp_path):
    convs = conversations(10)
    split = make_split(tmp_path, convs)
    capture_split(target, split, 6, tokenizer_of(target), counts(target, convs))
    assert [split.shard_file(k).exists() for k in range(3)] == [True, True, False]  # 6 convs -> shards 0, 1
    store = CorpusStore(split, 6)
    assert len(store) == 6
    for i in (0, 5):
        ids, mask = tokenizer_of(target)(convs[i])
        example = store[i]
        assert example.input_ids.tolist() == ids and example.loss_mask.tolist() == [bool(m) for m in mask]
        expected = compute_features(target, [ids])[0][0].to(STORE_DTYPE)
        assert torch.equal(example.features, expected)
    assert len(CorpusStore(split, 3)) == 3  # a smaller size cuts the last shard
    with pytest.raises(EagleLabError, match="missing"):
        CorpusStore(split, 9)  # more than was captured: refused, never a silent partial set


def test_capture_resumes_only_missing_shards_and_adds_layers_later(target, tmp_path):
    convs = conversations(12)
    split = make_split(tmp_path, convs)
    capture_split(target, split, 12, tokenizer_of(target), counts(target, convs))
    kept = split.shard_file(0).stat().st_mtime_ns
    split.shard_file(1).unlink()  # lost between runs
    capture_split(target, split, 12, tokenizer_of(target), counts(target, convs))
    assert split.shard_file(1).exists() and split.shard_file(0).stat().st_mtime_ns == kept
    capture_split(target, split, 12, tokenizer_of(target), counts(target, convs), layer_ids=LAYERS)
    assert split.shard_file(0).stat().st_mtime_ns == kept  # only the layer files were written
    store = CorpusStore(split, 12, LAYERS)
    ids = tokenizer_of(target)(convs[7])[0]
    expected = compute_features(target, [ids], LAYERS)[0][1].to(STORE_DTYPE)
    assert torch.equal(store[7].layer_features, expected)


def test_eval_split_stores_the_targets_greedy_tokens(target, tmp_path):
    convs = conversations(3)
    split = make_split(tmp_path, convs, name="eval")
    capture_split(target, split, 3, tokenizer_of(target), counts(target, convs))
    example = CorpusStore(split, 3)[2]
    logits = target.logits(example.features.to(target.dtype))
    assert torch.equal(example.target_token, logits.argmax(-1))


def test_live_lock_is_left_to_its_worker_and_dead_lock_is_taken_over(target, tmp_path):
    convs = conversations(8)
    split = make_split(tmp_path, convs)
    split.directory.mkdir(parents=True)
    assert claim(split, 0)  # this process holds shard 0, as a live worker would
    capture_split(target, split, 8, tokenizer_of(target), counts(target, convs), wait=False)
    assert not split.shard_file(0).exists() and split.shard_file(1).exists()
    release(split, 0)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock = split.directory / ".shard_00000.lock"
    lock.write_text(json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename, "time": 0}))
    capture_split(target, split, 8, tokenizer_of(target), counts(target, convs))
    assert split.shard_file(0).exists() and not lock.exists()


def test_status_reports_what_is_on_disk(target, tmp_path, capsys):
    from eagle_lab.training.corpus import main
    from eagle_lab.training.corpus_layout import write_manifest

    convs = conversations(9)
    split = make_split(tmp_path, convs)
    write_manifest(tmp_path, {"max_length": 64, "shard_conversations": 4},
                   {"train_token_counts": counts(target, convs), "eval_token_counts": []})
    capture_split(target, split, 4, tokenizer_of(target), counts(target, convs))
    report = status(tmp_path, 4)
    assert report["train"]["shards"] == 3 and report["train"]["shards_done"] == 1
    assert report["train"]["prefix_conversations"] == 4
    assert report["train"]["tokens_done"] == sum(counts(target, convs)[:4])
    assert main([str(tmp_path)]) == 0
    assert "train 1/3 shards" in capsys.readouterr().out


@pytest.mark.slow
def test_training_sizes_share_one_capture_and_never_see_the_heldout_tail(tmp_path):
    from test_train import smoke_cfg

    from eagle_lab.training.trainer import Recipe

    data = tmp_path / "convs.jsonl"
    convs = conversations(30)
    convs[27][0]["content"] = "x" * 600  # a prompt past max_length: no supervised token, never held out
    data.write_text("\n".join(json.dumps({"messages": c}) for c in convs))
    common = ("data=file", f"data.path={data}", "data.eval_conversations=6", "data.shard_conversations=8",
              "trainer.epochs=1", "trainer.max_steps=1000")
    small = Recipe(smoke_cfg(tmp_path / "small", *common, "data.num_conversations=10",
                             f"trainer.features_dir={tmp_path / 'features'}"))
    small.setup()
    assert len(small.train_source) == 10 and len(small.eval_source) == 6
    assert small.cfg.trainer.max_steps == 3  # ceil(1 epoch x 10 examples / 4 per step)
    heldout = {tuple(small.eval_source.store[i].input_ids.tolist()) for i in range(6)}
    shards = sorted((tmp_path / "features").rglob("shard_*.safetensors"))
    stamps = {p: p.stat().st_mtime_ns for p in shards}

    full = Recipe(smoke_cfg(tmp_path / "full", *common, "data.num_conversations=0",
                            f"trainer.features_dir={tmp_path / 'features'}"))
    full.setup()
    assert len(full.train_source) == 23  # everything before the held-out tail (the last 6 supervised)
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())  # the smaller size's shards were reused
    trained = {tuple(full.train_source.store[i].input_ids.tolist()) for i in range(23)}
    assert not trained & heldout
    with pytest.raises(EagleLabError, match="besides the 6 held out"):
        Recipe(smoke_cfg(tmp_path / "big", *common, "data.num_conversations=25",
                         f"trainer.features_dir={tmp_path / 'features'}")).setup()


def test_head_card_round_trip_and_mtbench_tau(tmp_path):
    from eagle_lab.drafters.card import HeadCard, read_card, record_mtbench_tau, write_card

    assert read_card(tmp_path) is None and not record_mtbench_tau(tmp_path, "cpu", 0.0, 1.5, 80)
    write_card(tmp_path, HeadCard(target="t", kind="eagle2", train_tokens=2_500_000, heldout_top1=[0.4, 0.3]))
    assert record_mtbench_tau(tmp_path, "cpu", 0.0, 1.8123, 80)
    assert record_mtbench_tau(tmp_path, "cpu", 1.0, 1.7, 20)
    card = read_card(tmp_path)
    assert card.mtbench_tau == {"cpu": {"T=0": 1.812, "T=1,n=20": 1.7}}
    assert "2.50M tokens" in card.summary() and "cpu T=0: 1.81" in card.summary()
    (tmp_path / "card.json").write_text("{not json")
    with pytest.raises(EagleLabError, match="unreadable"):
        read_card(tmp_path)


def test_card_command_leaves_out_run_control_overrides():
    from eagle_lab.drafters.card import reproducing_command

    overrides = ["experiment=sharegpt_scale", "name=scale-all", "trainer.resume=true",
                 "trainer.time_limit_min=150", "+trainer.stop_at=2026-12-02T01:00", "optim.lr=3e-4",
                 "data.path=my file.jsonl"]
    assert reproducing_command("train.py", overrides) == (
        "python train.py experiment=sharegpt_scale name=scale-all optim.lr=3e-4 'data.path=my file.jsonl'")
    assert reproducing_command("train.py", []) == "python train.py"


@pytest.mark.slow
def test_capture_only_cli_captures_and_trains_nothing(tmp_path):
    from test_train import run_script

    data = tmp_path / "convs.jsonl"
    data.write_text("\n".join(json.dumps({"messages": c}) for c in conversations(20)))
    done = run_script("train.py", "experiment=smoke", "data=file", f"data.path={data}", "data.num_conversations=0",
                      "data.eval_conversations=4", "data.shard_conversations=8", "trainer.capture_only=true",
                      f"trainer.features_dir={tmp_path / 'features'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-3000:]
    corpus = next((tmp_path / "features").glob("tiny_llama-corpus-*"))
    assert len(list((corpus / "train").glob("shard_*.safetensors"))) == 2  # 16 conversations / 8
    assert len(list((corpus / "eval").glob("shard_*.safetensors"))) == 1
    assert "capture train: 2/2 shards" in done.stderr and not (tmp_path / "run" / "head").exists()


@pytest.mark.slow
def test_eval_only_scores_an_exported_head_as_its_training_run_did(tmp_path):
    from test_train import smoke_cfg

    from eagle_lab.training.trainer import Recipe

    data = tmp_path / "convs.jsonl"
    data.write_text("\n".join(json.dumps({"messages": c}) for c in conversations(24)))
    common = ("data=file", f"data.path={data}", "data.eval_conversations=6", "data.shard_conversations=8",
              "data.num_conversations=0", "trainer.max_steps=4", "trainer.eval_every=1000",
              f"trainer.features_dir={tmp_path / 'features'}")
    trained = Recipe(smoke_cfg(tmp_path / "run", *common))
    trained.setup()
    trained.train()
    head = trained.export()
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "features").rglob("shard_*.safetensors")}

    scored = Recipe(smoke_cfg(tmp_path / "eval", *common, "trainer.eval_only=true", f"head.path={head}"))
    scored.setup()
    assert scored.train_source is None  # the training split is not read
    result = scored.evaluate_only()
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())  # nothing captured again
    written = json.loads((tmp_path / "eval" / "run" / "eval.json").read_text())
    assert written["sequences"] == 6 and written["head"] == str(head.resolve())
    for depth in range(1, 6):
        key = f"eval_acc_{depth}"
        assert result[key] == pytest.approx(trained.last_eval[key], abs=1e-6), key
        assert written[key] == result[key]


def test_eval_only_needs_a_trained_head(tmp_path):
    from test_train import smoke_cfg

    from eagle_lab.training.trainer import Recipe

    for extra in (("trainer.eval_only=true",), ("trainer.eval_only=true", "head.path=random"),
                  ("trainer.eval_only=true", "head.path=/x", "trainer.capture_only=true")):
        with pytest.raises(EagleLabError, match="trainer.eval_only evaluates a trained EAGLE head"):
            Recipe(smoke_cfg(tmp_path / "run", *extra)).setup()
