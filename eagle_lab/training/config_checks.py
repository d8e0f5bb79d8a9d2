"""A training config's settings checked together before any work starts: one clear message for the first that
cannot work."""

from __future__ import annotations

from eagle_lab.errors import EagleLabError
from eagle_lab.training.trainable import check_kind


def check_train_config(cfg) -> None:
    """cfg: a TrainConfig (eagle_lab.config). Raise EagleLabError for the first setting, or combination of
    settings, that a run cannot honour."""
    if cfg.deepspeed.timeout_min <= 0:
        raise EagleLabError(f"deepspeed.timeout_min must be > 0, got {cfg.deepspeed.timeout_min}")
    if cfg.trainer.features not in ("offline", "online"):
        raise EagleLabError(f"trainer.features must be offline or online, got '{cfg.trainer.features}'")
    if cfg.trainer.max_steps < 1 or cfg.trainer.micro_batch_size < 1 or cfg.trainer.grad_accum < 1:
        raise EagleLabError("trainer.max_steps, micro_batch_size and grad_accum must be >= 1")
    if cfg.trainer.epochs < 0:
        raise EagleLabError(f"trainer.epochs must be >= 0 (0: use trainer.max_steps), got {cfg.trainer.epochs}")
    if cfg.trainer.cpu_autocast not in ("auto", "on", "off"):
        raise EagleLabError(f"trainer.cpu_autocast must be auto, on or off, got '{cfg.trainer.cpu_autocast}'")
    if cfg.trainer.capture_layers not in ("auto", "eagle3"):
        raise EagleLabError(f"trainer.capture_layers must be auto or eagle3, got '{cfg.trainer.capture_layers}'")
    check_kind(cfg.head)
    loss = cfg.loss
    if min(loss.accept_weight, loss.distill_top_k, loss.align_top_k, loss.opening_tokens) < 0 \
            or loss.opening_weight <= 0:
        raise EagleLabError("loss.accept_weight, distill_top_k, align_top_k and opening_tokens must be >= 0 "
                            f"(0: off) and loss.opening_weight > 0, got {loss.accept_weight}, {loss.distill_top_k}, "
                            f"{loss.align_top_k}, {loss.opening_tokens}, {loss.opening_weight}")
    if cfg.data.eval_conversations < 0 or cfg.data.shard_conversations < 1:
        raise EagleLabError("data.eval_conversations must be >= 0 and data.shard_conversations >= 1")
    if cfg.trainer.eval_only and (cfg.trainer.capture_only or cfg.head.kind not in ("eagle2", "eagle3")
                                  or cfg.head.path in ("", "random")):
        raise EagleLabError("trainer.eval_only evaluates a trained EAGLE head: set head.path=<head directory> "
                            "(head.kind eagle2 or eagle3) and leave trainer.capture_only off")
    if cfg.trainer.init_from and (cfg.trainer.eval_only or cfg.head.kind not in ("eagle2", "eagle3")):
        raise EagleLabError("trainer.init_from starts training from a trained EAGLE head (head.kind eagle2 or "
                            "eagle3); trainer.eval_only evaluates head.path instead")
    if cfg.data.add_regenerated < 0 or (cfg.data.add_regenerated > 0 and (
            cfg.data.regenerate.enabled or cfg.data.eval_conversations == 0)):
        raise EagleLabError("data.add_regenerated=N mixes the target's replies to N conversations into a feature "
                            "corpus of the source's own (data.eval_conversations > 0, data.regenerate.enabled=false)")
    if cfg.data.eval_conversations > 0 and cfg.trainer.features != "offline":
        raise EagleLabError("data.eval_conversations > 0 (the shared feature corpus) needs trainer.features=offline")
