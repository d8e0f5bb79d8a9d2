"""Typed configs: dataclasses registered in Hydra's ConfigStore.

Every YAML file under conf/ is merged onto these schemas, so a mistyped key or a value of
the wrong type fails at start-up with Hydra's message instead of being ignored. Library
code never sees OmegaConf: entry points turn configs into these dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from eagle_lab.draft import TreeShape
from eagle_lab.target import TargetConfig


@dataclass
class HeadConfig:
    kind: str = "eagle2"
    # "" = the head packaged for this target if there is one, else a random head (warned);
    # "random" = always a random head; otherwise a directory with config.json + model.safetensors
    path: str = ""
    draft_vocab_size: int = 0  # 0 = the target's full vocabulary
    seed: int = 0


@dataclass
class TreeConfig(TreeShape):
    pass


@dataclass
class BenchConfig:
    dataset: str = "mt_bench"  # mt_bench | humaneval | a .jsonl file of prompts
    limit: int = 10
    methods: list[str] = field(default_factory=lambda: ["vanilla", "eagle", "hf_greedy", "hf_prompt_lookup"])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    warmup: int = 1


@dataclass
class ServeConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    mode: str = "generate"  # generate | bench
    method: str = "eagle"  # eagle | vanilla
    prompt: str = ""
    prompts_file: str = ""
    chat: bool = True
    system: str = ""  # optional system message when chat=true
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    output: str = "text"  # text (streamed) | json (one object per prompt)


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="serve_schema", node=ServeConfig)


def to_object(cfg: DictConfig, schema: type):
    """Resolved DictConfig -> the schema dataclass (nested dataclasses included)."""
    merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
    return OmegaConf.to_object(merged)
