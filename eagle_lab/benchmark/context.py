"""What one bench run is made of: a method's run on one prompt, the shared context, and timing."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from eagle_lab.config import ServeConfig
from eagle_lab.decoding.backend import Backend
from eagle_lab.decoding.sequence import GenerationStats
from eagle_lab.decoding.tree import Drafter
from eagle_lab.models.target import Target


@dataclass
class Run:
    """One method on one prompt."""

    token_ids: list[int]
    wall_s: float
    target_forwards: int | None  # None when it could not be counted
    stop_reason: str
    stats: GenerationStats | None = None  # eagle_lab methods only

@dataclass
class BenchContext:
    """What every method run needs: the target, the drafters and the shared settings."""

    cfg: ServeConfig
    target: Target
    drafters: dict[str, Drafter]  # speculative method -> its drafter
    eos: set[int]  # empty when cfg.ignore_eos
    pad_token_id: int
    cache_kwarg: str  # the name `model.generate` takes a cache under
    backend: Backend | None = None  # how vanilla and the speculative methods run the target (None: eager)
    llama_cpp: Any = None  # llama_cpp_runs.LlamaCppSetup when llama.cpp methods run

def make_context(cfg: ServeConfig, target: Target, drafters: dict[str, Drafter],
                 backend: Backend | None = None) -> BenchContext:
    eos = set() if cfg.ignore_eos else set(target.eos_token_ids)
    pad = target.tokenizer.pad_token_id
    if pad is None:
        pad = getattr(target.model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = min(target.eos_token_ids, default=0)
    params = inspect.signature(target.model.forward).parameters
    cache_kwarg = "cache" if "cache" in params else "past_key_values"
    return BenchContext(cfg, target, drafters, eos, int(pad), cache_kwarg, backend)
