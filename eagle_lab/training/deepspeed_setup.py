"""Process and engine set-up for training: distributed init (launchers set RANK / WORLD_SIZE), the
DeepSpeed config and the learning-rate schedule."""

from __future__ import annotations

import math
import os
import socket
from datetime import timedelta

import torch


def init_distributed(backend: str, device: torch.device, timeout_min: float = 360.0) -> tuple[int, int]:
    """Single process by default; deepspeed/torchrun launchers set RANK/WORLD_SIZE. timeout_min: how
    long a collective may wait (DeepSpeed's default, 10 min, ends a rank that finished its share of
    regeneration early)."""
    import deepspeed

    if "WORLD_SIZE" not in os.environ:  # a plain `python train.py`: one process, any free port
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(minutes=timeout_min))
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def deepspeed_config(micro_batch_size: int, grad_accum: int, grad_clip: float, zero_stage: int, bf16: str,
                     device: torch.device) -> dict:
    """bf16: "true", "false" or "auto" (on with CUDA)."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": bf16 == "true" or (bf16 == "auto" and device.type == "cuda")},
        "steps_per_print": 1 << 30,
    }


def lr_lambda(warmup: int, max_steps: int, floor: float):
    """Linear warm-up, then cosine decay to `floor` x the base rate at max_steps."""
    total = max(max_steps, 1)

    def scale(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(total - warmup, 1))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return scale
