"""What the trainer trains: an EAGLE head (`head.kind=eagle2|eagle3`) or a draft LM (`draft_lm`).
`cfg` below is the run's `head` config (eagle_lab.config.HeadConfig)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from eagle_lab.drafters.eagle.head import save_head
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.medusa.heads import MedusaArch, MedusaHeads, save_medusa
from eagle_lab.errors import EagleLabError
from eagle_lab.models.target import Target
from eagle_lab.training.draft_lm import DraftLM, new_draft_lm, save_draft_lm

KINDS = ("eagle2", "eagle3", "draft_lm", "medusa")


def check_kind(cfg) -> None:
    if cfg.kind not in KINDS:
        raise EagleLabError(f"unknown head kind '{cfg.kind}' (choose from {', '.join(KINDS)})")
    if cfg.kind == "draft_lm" and cfg.ttt_steps != 1:
        raise EagleLabError("head=draft_lm drafts from its own tokens: it trains with head.ttt_steps=1")


def new_trainable(target: Target, cfg, vocab_ids: torch.Tensor, device: torch.device) -> nn.Module:
    if cfg.kind == "draft_lm":
        module = new_draft_lm(target, cfg.draft_layers, cfg.seed, vocab_ids)
    elif cfg.kind == "medusa":
        if cfg.medusa_heads < 1:
            raise EagleLabError(f"head.medusa_heads must be >= 1, got {cfg.medusa_heads}")
        module = MedusaHeads(MedusaArch(target.hidden_size, target.vocab_size, cfg.medusa_heads), vocab_ids)
    else:
        module = new_head(target, kind=cfg.kind, draft_vocab_ids=vocab_ids, seed=cfg.seed,
                          feature_layers=tuple(cfg.feature_layers), layer_from_target=cfg.init_layer_from_target,
                          intermediate_size=cfg.intermediate_size)
    module = module.to(device)
    return module.float() if device.type == "cpu" else module


def trained_dtype(module: nn.Module) -> torch.dtype:
    """The dtype the trained weights compute in (features are cast to it)."""
    return next(p for p in module.parameters() if p.requires_grad).dtype


def draft_vocab_size(module: nn.Module) -> int:
    return module.draft_to_target.numel()


def export_trainable(module: nn.Module, target: Target, directory: Path) -> tuple[Path, str]:
    """-> (the exported directory, the command that serves it)."""
    if isinstance(module, DraftLM):
        out = save_draft_lm(module, target, directory)
        return out, f"python serve.py target={target.name} method=draft_model draft_model.path={out}"
    if isinstance(module, MedusaHeads):
        out = save_medusa(module, directory)
        return out, f"python serve.py target={target.name} method=medusa medusa.path={out}"
    out = save_head(module, directory)
    return out, f"python serve.py target={target.name} head.path={out}"


def trainable_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
