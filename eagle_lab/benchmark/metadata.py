"""What a bench ran on (config, machine, versions), and MT-bench tau written into a head's card."""

from __future__ import annotations

import logging
import platform
from dataclasses import asdict
from datetime import datetime
from typing import Any

import torch
import transformers

from eagle_lab.benchmark.methods import PROMPT_LOOKUP_TOKENS, head_config, method_head, split_method, tree_label
from eagle_lab.benchmark.prompt_sets import Prompt
from eagle_lab.builders import packaged_head_dir
from eagle_lab.config import ServeConfig
from eagle_lab.decoding.backend import Backend
from eagle_lab.decoding.tree import Drafter
from eagle_lab.drafters.card import record_mtbench_tau
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.models.target import Target
from eagle_lab.tree_search.presets import tree_preset

log = logging.getLogger(__name__)


def update_card(cfg: ServeConfig, target: Target, summary: dict[str, dict[str, Any]], prompts: int) -> None:
    """bench.update_card: eagle's measured MT-bench tau -> the head's card.json. The packaged head's card
    (tracked in the repository) is written only when head.path names its directory explicitly."""
    if not cfg.head.path:
        log.warning("bench.update_card: not rewriting the packaged head's card with this machine's figures; pass "
                    "head.path=%s to do so on purpose", packaged_head_dir(target.name, cfg.head.kind) or "DIR")
        return
    head = cfg.head.path
    eagle = [m for m in cfg.bench.methods if split_method(m)[0] == "eagle" and not method_head(m)]
    if cfg.bench.dataset != "mt_bench" or not head or not eagle:
        log.warning("bench.update_card needs bench.dataset=mt_bench, the eagle method and a head directory")
        return
    for method in eagle:
        preset = split_method(method)[1]
        label = tree_label(tree_preset(preset) if preset else cfg.tree)
        for key, by_method in summary.items():
            tau = by_method.get(method, {}).get("tau")
            if tau is not None and record_mtbench_tau(head, label, float(key), tau, prompts):
                log.info("card %s: MT-bench tau %.3f (tree %s, T=%s, %d prompts)", head, tau, label, key, prompts)

def config_summary(cfg: ServeConfig, target: Target, num_prompts: int,
                   drafters: dict[str, Drafter] | None = None, backend: Backend | None = None) -> dict[str, Any]:
    head = cfg.head.path
    if head == "":
        packaged = packaged_head_dir(target.name, cfg.head.kind)
        head = str(packaged) if packaged else "random"
    device = target.device
    drafters = drafters or {}
    eagle = [drafter for drafter in drafters.values() if isinstance(drafter, EagleDrafter)]
    uses_ngram = any(split_method(m)[0] in ("eagle+ngram", "ngram") for m in drafters)
    hybrid = drafters.get("eagle+ngram")
    return {
        "target": target.name,
        "target_source": cfg.target.source,
        "target_path": cfg.target.path,
        "head": head if eagle else None,
        "head_kind": cfg.head.kind,
        # methods that named their own head (eagle/NAME): the head each ran
        "method_heads": {m: head_config(cfg, method_head(m)).path or f"packaged {method_head(m)}"
                         for m in drafters if method_head(m)},
        "tree": asdict(eagle[0].shape) if eagle else None,  # as used (tree=online: the longest chain)
        "tree_online": cfg.tree.online,
        # every head method's tree as used (methods named method@preset ran that preset)
        "trees": {m: asdict(d.shape) for m, d in drafters.items() if isinstance(d, EagleDrafter)},
        "ngram": asdict(cfg.ngram) if uses_ngram else None,
        # eagle+ngram as used: its tree and longest chain
        "hybrid": ({"tree": asdict(hybrid.shape), "ngram_tokens": hybrid.ngram.max_tokens if hybrid.ngram else 0}
                   if isinstance(hybrid, EagleDrafter) else None),
        "device": str(device),
        "backend": getattr(backend, "name", "eager"),  # compiled | static | eager: how vanilla and eagle ran
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else platform.processor() or platform.machine()),
        "torch_threads": torch.get_num_threads(),
        "dtype": str(target.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "dataset": cfg.bench.dataset,
        "limit": cfg.bench.limit,
        "num_prompts": num_prompts,
        "methods": list(cfg.bench.methods),
        "temperatures": [float(t) for t in cfg.bench.temperatures],
        "warmup": cfg.bench.warmup,
        "max_new_tokens": cfg.max_new_tokens,
        "top_k": cfg.top_k,
        "top_p": cfg.top_p,
        "seed": cfg.seed,
        "chat": cfg.chat,
        "system": cfg.system,
        "ignore_eos": cfg.ignore_eos,
        "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
        "time": datetime.now().isoformat(timespec="seconds"),
    }

def preview(prompt: Prompt, width: int = 80) -> str:
    text = prompt if isinstance(prompt, str) else " | ".join(m["content"] for m in prompt)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."
