"""Training: configs compose, smoke runs end to end, resume continues exactly, sweeps run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from eagle_lab.config import ServeConfig, TrainConfig, register_configs, to_object
from eagle_lab.decoding.generate import Stopper, generate, speculative_decode, vanilla_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.layouts import load_head
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.errors import EagleLabError
from eagle_lab.models.target import TargetConfig, load_target
from eagle_lab.models.tiny import TinyModelConfig
from tests.conftest import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
register_configs()


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def composed(config_name: str, overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=False)


TRAIN_GROUPS = ["target", "head", "data", "optim", "loss", "trainer", "deepspeed", "experiment", "debug"]


@pytest.mark.parametrize("group", TRAIN_GROUPS)
def test_every_train_option_composes(group):
    for option in group_options(group):
        overrides = [f"{group}={option}", "run_dir=/tmp/x"]
        if group == "data" and option == "file":
            overrides.append("data.path=/tmp/conversations.jsonl")
        cfg = to_object(composed("train", overrides), TrainConfig)
        assert isinstance(cfg, TrainConfig)


@pytest.mark.parametrize("group", ["target", "head", "tree", "ngram", "server"])
def test_every_serve_option_composes(group):
    for option in group_options(group):
        assert isinstance(to_object(composed("serve", [f"{group}={option}"]), ServeConfig), ServeConfig)


def test_slurm_launcher_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["hydra/launcher=slurm", "run_dir=/tmp/x"],
                      return_hydra_config=True)
    assert cfg.hydra.launcher.nodes == 1 and "submitit" in cfg.hydra.launcher._target_


def test_ngram_keys_compose_and_are_typed():
    cfg = to_object(composed("serve", ["ngram.enabled=true", "ngram.max_tokens=4", "method=ngram"]), ServeConfig)
    assert cfg.ngram.enabled and cfg.ngram.max_tokens == 4 and cfg.ngram.min_match == 2
    assert to_object(composed("serve", []), ServeConfig).ngram.enabled  # on by default (README, "Hybrid drafting")
    with pytest.raises(Exception, match="max_tokenz"):
        composed("serve", ["ngram.max_tokenz=3"])


def test_mistyped_key_fails():
    with pytest.raises(Exception, match="trainer.max_stepz|max_stepz"):
        composed("train", ["trainer.max_stepz=3"])


def smoke_cfg(tmp_path: Path, *extra: str) -> TrainConfig:
    overrides = ["experiment=smoke", f"run_dir={tmp_path / 'run'}", f"trainer.features_dir={tmp_path / 'features'}",
                 "trainer.max_steps=10", "trainer.save_every=5", "trainer.log_every=1", "trainer.eval_every=100",
                 "data.num_conversations=24", *extra]
    return to_object(composed("train", overrides), TrainConfig)


def losses(metrics: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_resume_continues_with_the_same_losses(tmp_path):
    from eagle_lab.training.trainer import Recipe

    def run(cfg):
        recipe = Recipe(cfg)
        recipe.setup()
        recipe.train()
        return recipe

    run(smoke_cfg(tmp_path / "a"))  # uninterrupted reference
    first = run(smoke_cfg(tmp_path / "b", "trainer.stop_at=5"))  # as if killed after the step-5 checkpoint
    assert first.step == 5
    with pytest.raises(EagleLabError, match="resume"):
        Recipe(smoke_cfg(tmp_path / "b")).setup()  # a fresh run would overwrite: refused
    resumed = run(smoke_cfg(tmp_path / "b", "trainer.resume=true"))
    assert resumed.step == 10
    a, b = losses(tmp_path / "a" / "run" / "metrics.jsonl"), losses(tmp_path / "b" / "run" / "metrics.jsonl")
    for step in range(6, 11):
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-5), step


def test_sigterm_checkpoints_the_step_and_resume_continues_with_the_same_losses(tmp_path, monkeypatch):
    """SIGTERM during step 3: the step finishes, step_3 is checkpointed, no evaluation runs, and the
    resumed run's losses are the uninterrupted run's."""
    import os
    import signal

    from eagle_lab.training import checkpoint as ckpt
    from eagle_lab.training.trainer import Recipe

    reference = Recipe(smoke_cfg(tmp_path / "a"))
    reference.setup()
    reference.train()
    recipe = Recipe(smoke_cfg(tmp_path / "b"))
    recipe.setup()
    step = recipe._train_step

    def signalled_step(rows):
        step(rows)
        if recipe.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives between two steps, as from a launcher

    monkeypatch.setattr(recipe, "_train_step", signalled_step)
    monkeypatch.setattr(recipe, "evaluate", lambda: pytest.fail("a signalled stop must not evaluate"))
    previous = signal.getsignal(signal.SIGTERM)
    recipe.train()
    assert recipe.step == 3 and signal.getsignal(signal.SIGTERM) == previous  # handlers restored
    assert ckpt.latest_checkpoint(recipe.ckpt_dir).name == "step_3"
    monkeypatch.undo()
    resumed = Recipe(smoke_cfg(tmp_path / "b", "trainer.resume=true"))
    resumed.setup()
    resumed.train()
    assert resumed.step == 10
    a, b = losses(tmp_path / "a" / "run" / "metrics.jsonl"), losses(tmp_path / "b" / "run" / "metrics.jsonl")
    for n in range(4, 11):
        assert b[n] == pytest.approx(a[n], rel=1e-4, abs=1e-5), n


def test_partial_checkpoint_is_never_resumed(tmp_path):
    from eagle_lab.training import checkpoint as ckpt

    ckpt_dir = tmp_path / "ckpt"
    (ckpt_dir / "step_5").mkdir(parents=True)
    ckpt.partial_path(ckpt_dir, 10).mkdir()  # a save that was killed half-way
    assert ckpt.latest_checkpoint(ckpt_dir) == ckpt_dir / "step_5"


def run_script(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    launcher_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # set by in-process runs
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    env["TOKENIZERS_PARALLELISM"] = "false"
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.mark.slow
def test_smoke_trains_exports_and_serves_losslessly(tmp_path):
    run_dir = tmp_path / "smoke"
    done = run_script("train.py", "experiment=smoke", f"hydra.run.dir={run_dir}",
                      f"trainer.features_dir={tmp_path / 'features'}")
    assert done.returncode == 0, done.stderr[-3000:]
    head_dir = run_dir / "head"
    assert (head_dir / "config.json").is_file() and (head_dir / "model.safetensors").is_file()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "eval_acc_1" in m]
    assert evals and "eval_tau_chain" in evals[-1] and all(f"eval_acc_{d}" in evals[-1] for d in range(1, 6))
    assert (run_dir / "resolved_config.yaml").is_file()
    card = json.loads((head_dir / "card.json").read_text())
    assert card["target"] == "tiny_llama" and card["kind"] == "eagle2" and card["steps"] == 30
    assert card["command"].startswith("python train.py experiment=smoke")
    assert card["train_tokens"] > 0 and card["epochs"] > 0
    assert card["recipe"]["global_batch"] > 0 and card["recipe"]["lr"] > 0  # the recipe a run is compared by
    assert card["heldout_top1"] == [pytest.approx(evals[-1][f"eval_acc_{d}"], abs=1e-4) for d in range(1, 6)]

    target = load_target(TargetConfig(name="tiny_llama", source="tiny"))
    drafter = EagleDrafter(load_head(head_dir, target), target, TreeShape(depth=4, topk=4, total_tokens=12))
    prompt = torch.tensor(target.tokenizer("<|im_start|>user\nHow do I bake bread?<|im_end|>\n")["input_ids"])
    greedy = SamplingParams()
    plain = generate(vanilla_decode(target, prompt, greedy, Stopper(target.tokenizer, 40, set())))
    spec = generate(speculative_decode(target, drafter, prompt, greedy, Stopper(target.tokenizer, 40, set())))
    assert spec.token_ids == plain.token_ids

    served = run_script("serve.py", "target=tiny_llama", f"head.path={head_dir}", "prompt=hi", "output=json",
                        "max_new_tokens=8", f"hydra.run.dir={tmp_path / 'serve'}")
    assert served.returncode == 0, served.stderr[-2000:]
    assert json.loads(served.stdout)["new_tokens"] >= 1
    assert "head card: eagle2 for tiny_llama" in served.stderr


@pytest.mark.slow
def test_sweep_runs_one_job_per_point(tmp_path):
    done = run_script("train.py", "-m", "experiment=smoke", "optim.lr=1e-4,3e-4", "trainer.max_steps=3",
                      f"trainer.features_dir={tmp_path / 'features'}", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert done.returncode == 0, done.stderr[-3000:]
    heads = sorted(p.parent.parent.name for p in (tmp_path / "sweep").glob("*/head/model.safetensors"))
    assert heads == ["optim.lr=0.0001,trainer.max_steps=3", "optim.lr=0.0003,trainer.max_steps=3"]


def test_eagle3_smoke_trains_end_to_end(tmp_path):
    from eagle_lab.training.trainer import Recipe

    cfg = smoke_cfg(tmp_path, "head=eagle3", "head.draft_vocab_size=128", "trainer.max_steps=4",
                    "trainer.eval_every=4")
    recipe = Recipe(cfg)
    recipe.setup()
    recipe.train()
    out = recipe.export()
    head = load_head(out, recipe.target)
    assert head.arch.kind == "eagle3" and head.arch.draft_vocab_size == 128
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_acc_3" in e for e in evals)


@pytest.mark.parametrize("family", FAMILIES)
def test_head_layer_can_start_from_the_targets_last_layer(family):
    from eagle_lab.drafters.eagle.kinds import new_head

    tiny_target = load_target(TargetConfig(name=f"tiny_{family}", source="tiny", tiny=TinyModelConfig(family=family),
                                           device="cpu"), trainable_layers=True)  # as the trainer loads it
    head = new_head(tiny_target, layer_from_target=True)
    last = tiny_target.backbone.layers[-1]
    gain = last.input_layernorm.weight
    assert torch.allclose(head.layer.self_attn.q_proj.weight, last.self_attn.q_proj.weight * gain)
    assert torch.equal(head.layer.mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert torch.equal(head.layer.post_attention_layernorm.weight, last.post_attention_layernorm.weight)
    assert not torch.equal(new_head(tiny_target).layer.mlp.down_proj.weight, last.mlp.down_proj.weight)
    with pytest.raises(EagleLabError, match="eagle2 heads only"):
        new_head(tiny_target, kind="eagle3", layer_from_target=True)


def test_capture_dtype_is_chosen_as_configured(monkeypatch):
    """trainer.capture_dtype: the target's own dtype by default, bf16 under auto only where it is
    native (an explicit target.dtype wins), a clear error for anything else."""
    from eagle_lab.models import device

    def chosen(capture: str, dtype: str = "auto") -> str:
        return device.training_dtype(capture, TargetConfig(dtype=dtype, device="cpu"))

    assert chosen("target") == "auto"
    assert chosen("target", "float32") == "float32"
    assert chosen("bfloat16", "float32") == "bfloat16"
    assert chosen("auto", "float32") == "float32"
    monkeypatch.setattr(device, "cpu_has_bf16", lambda: True)
    assert chosen("auto") == "bfloat16"
    monkeypatch.setattr(device, "cpu_has_bf16", lambda: False)
    assert chosen("auto") == "auto"
    with pytest.raises(EagleLabError, match="capture_dtype"):
        chosen("int8")


def test_trains_and_evaluates_against_a_bf16_target(tmp_path):
    """trainer.capture_dtype=bfloat16: capture, training steps and the held-out evaluation all run
    with an fp32 head beside a bf16 target (the evaluation once failed on the dtype mix)."""
    from eagle_lab.training.trainer import Recipe

    recipe = Recipe(smoke_cfg(tmp_path, "trainer.capture_dtype=bfloat16", "trainer.max_steps=2",
                              "trainer.eval_every=2"))
    recipe.setup()
    assert recipe.target.dtype == torch.bfloat16
    recipe.train()
    assert recipe.step == 2 and 0.0 <= recipe.last_eval["eval_acc_1"] <= 1.0


def test_ranks_wait_at_collectives_as_long_as_configured(monkeypatch):
    import deepspeed

    from eagle_lab.training.deepspeed_setup import init_distributed

    seen = {}
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kwargs: seen.update(kwargs))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # recorded, so the launcher variables it sets are undone afterwards
        monkeypatch.delenv(name)
    assert init_distributed("auto", torch.device("cpu"), timeout_min=90) == (0, 1)
    assert seen["dist_backend"] == "gloo" and seen["timeout"].total_seconds() == 90 * 60
    cfg = to_object(composed("train", ["run_dir=/tmp/x"]), TrainConfig)
    assert cfg.deepspeed.timeout_min == 360  # DeepSpeed's own 10 min ended ranks that finished regeneration early


def test_training_can_start_from_a_trained_head(tmp_path):
    """trainer.init_from: the new run begins with the given head's weights and draft vocabulary (not one built
    from its own data), trains on, and its card names where it started."""
    from eagle_lab.training.trainer import Recipe

    first = Recipe(smoke_cfg(tmp_path / "a", "head.draft_vocab_size=128", "trainer.max_steps=3"))
    first.setup()
    first.train()
    start = first.export()
    trained = load_head(start, first.target)

    cfg = smoke_cfg(tmp_path / "b", f"trainer.init_from={start}", "head.draft_vocab_size=256",
                    "data.num_conversations=16", "trainer.max_steps=2")
    recipe = Recipe(cfg)
    recipe.setup()
    assert torch.equal(recipe.head.draft_to_target, trained.draft_to_target)  # 128 ids, not 256 from this data
    for name, value in trained.state_dict().items():
        assert torch.equal(recipe.head.state_dict()[name], value.float()), name
    recipe.train()
    assert recipe.step == 2
    moved = [name for name, value in trained.state_dict().items()
             if value.is_floating_point() and not torch.equal(recipe.head.state_dict()[name], value.float())]
    assert moved  # the steps trained it further
    card = json.loads((recipe.export() / "card.json").read_text())
    assert card["recipe"]["init_from"] == str(start)


def test_init_from_refuses_a_head_of_another_kind(tmp_path):
    from eagle_lab.training.trainer import Recipe

    first = Recipe(smoke_cfg(tmp_path / "a", "head.draft_vocab_size=128", "trainer.max_steps=1"))
    first.setup()
    first.train()
    start = first.export()
    with pytest.raises(EagleLabError, match="eagle2 head, but head.kind=eagle3"):
        Recipe(smoke_cfg(tmp_path / "b", "head=eagle3", f"trainer.init_from={start}")).setup()
    with pytest.raises(EagleLabError, match="init_from"):
        Recipe(smoke_cfg(tmp_path / "c", "head=draft_lm", "head.ttt_steps=1", f"trainer.init_from={start}")).setup()
