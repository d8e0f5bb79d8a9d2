"""Where a feature corpus lives on disk: its directory name, its splits and shard files, the lock
files that let several capture workers share the work, and the manifest (eagle_lab/training/corpus.py
describes the layout)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eagle_lab.errors import EagleLabError

log = logging.getLogger(__name__)
Conversation = list[dict[str, str]]

MANIFEST = "manifest.json"
STALE_LOCK_S = 3600.0  # a shard takes minutes; a lock this old belongs to a dead run
FORMAT_VERSION = 2  # 2: the held-out set is the last N conversations with a supervised token


def corpus_key(target_name: str, fingerprint: dict) -> str:
    """Directory name: the target plus a hash of everything that decides the shards' contents."""
    blob = json.dumps({"target": target_name, "format": FORMAT_VERSION, **fingerprint}, sort_keys=True)
    return f"{target_name}-corpus-{hashlib.sha1(blob.encode()).hexdigest()[:12]}"


def layer_tag(layer_ids: Sequence[int]) -> str:
    return "layers-" + "-".join(str(i) for i in layer_ids)


@dataclass
class Split:
    """One split of the corpus: its conversations in order and where their shards live."""

    name: str  # train | eval
    conversations: list[Conversation]
    directory: Path
    shard_conversations: int

    @property
    def shard_count(self) -> int:
        return math.ceil(len(self.conversations) / self.shard_conversations)

    def shards_for(self, count: int) -> list[int]:
        """Shards holding the first `count` conversations."""
        return list(range(math.ceil(min(count, len(self.conversations)) / self.shard_conversations)))

    def shard_file(self, k: int) -> Path:
        return self.directory / f"shard_{k:05d}.safetensors"

    def layer_file(self, k: int, layer_ids: Sequence[int]) -> Path:
        return self.directory / f"{layer_tag(layer_ids)}_{k:05d}.safetensors"

    def is_complete(self, k: int, layer_ids: Sequence[int]) -> bool:
        return self.shard_file(k).exists() and (not layer_ids or self.layer_file(k, layer_ids).exists())

    def conversation_range(self, k: int) -> range:
        return range(k * self.shard_conversations, min(len(self.conversations), (k + 1) * self.shard_conversations))


# ---- claiming shards ------------------------------------------------------------------------

def _lock_path(split: Split, k: int) -> Path:
    return split.directory / f".shard_{k:05d}.lock"


def _lock_is_stale(lock: Path) -> bool:
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False  # released meanwhile: not ours to remove
    try:
        info = json.loads(lock.read_text())
    except (OSError, ValueError):
        return age > 60  # empty or half-written: its writer gets a minute to finish
    if age > STALE_LOCK_S:
        return True
    if info.get("host") != socket.gethostname():
        return False  # another machine on a shared filesystem: trust it until it is old
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, ValueError):
        return False
    return False


def claim(split: Split, k: int) -> bool:
    """Take shard k's lock (atomic create); a stale lock is removed and retried once."""
    lock = _lock_path(split, k)
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if _lock_is_stale(lock):
                log.info("taking over the stale lock %s", lock.name)
                lock.unlink(missing_ok=True)
                continue
            return False
        with os.fdopen(fd, "w") as handle:
            json.dump({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}, handle)
        return True
    return False


def release(split: Split, k: int) -> None:
    _lock_path(split, k).unlink(missing_ok=True)


# ---- the manifest -------------------------------------------------------------------------

def write_manifest(directory: Path, fingerprint: dict, split: dict) -> None:
    """Record what the corpus is and how it splits (written once): split holds
    train_token_counts and eval_token_counts (tokens per conversation of each split) and
    whatever else defines the split (the held-out indices)."""
    path = directory / MANIFEST
    if path.exists():
        return
    directory.mkdir(parents=True, exist_ok=True)
    train, evals = split["train_token_counts"], split["eval_token_counts"]
    tmp = directory / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"fingerprint": fingerprint, "train_conversations": len(train),
                               "eval_conversations": len(evals), "train_tokens": sum(train),
                               "eval_tokens": sum(evals), **split}))
    tmp.replace(path)


def read_manifest(directory: Path) -> dict | None:
    path = directory / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise EagleLabError(f"corpus manifest {path} is unreadable ({err}); delete it to recount") from err
