"""Atomic training checkpoints: a checkpoint directory exists only once it is complete.

DeepSpeed writes into `ckpt/.partial-step_N/`; after every rank is done, rank 0 renames it
to `ckpt/step_N/`. Resume takes the highest complete `step_N`, so a run killed mid-save
falls back to the previous checkpoint instead of reading half a file.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

TAG = "state"
_STEP = re.compile(r"^step_(\d+)$")


def complete_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = complete_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


def partial_path(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f".partial-step_{step}"


def publish(ckpt_dir: Path, step: int, keep: int) -> Path:
    """Rename the finished partial checkpoint into place and prune old ones (rank 0 only)."""
    final = ckpt_dir / f"step_{step}"
    if final.exists():
        shutil.rmtree(final)
    partial_path(ckpt_dir, step).rename(final)
    for _, old in complete_checkpoints(ckpt_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in ckpt_dir.glob(".partial-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final
