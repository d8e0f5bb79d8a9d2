"""Feature corpus: one capture of a whole conversation source, shared by every data size.

Used when `data.eval_conversations > 0`. Layout under `<cache>/features/<target>-corpus-<hash>/`:

  manifest.json                 what was captured from what, and per-conversation token counts
  eval/shard_00000.safetensors  the held-out tail: the last `eval_conversations` conversations
                                of the source that keep a supervised token within max_length
  train/shard_00000.safetensors conversation i of those before it lives in shard i // S
  train/layers-3-16-28_00000.safetensors   EAGLE-3 layer features of that shard, when asked for

A training set of the first N conversations reads the first ceil(N / S) shards, the last cut at
conversation N: the points of a scaling curve are prefixes of one capture, and capturing more
extends every earlier point. Each shard is claimed with a lock file, so several capture workers
(a background job, a trainer) share the work; a lock whose process died is taken over.

Shard file (safetensors): input_ids [N] int32, loss_mask [N] uint8, offsets [E+1] int64,
conversation [E] int64 (index within its split), features [N, H] bf16, and on the eval split
target_token [N] int32 (the target's greedy next token, so every evaluation reads the same).
Layer file: layer_features [N, n*H] bf16.
"""

from __future__ import annotations

import bisect
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from eagle_lab.errors import EagleLabError
from eagle_lab.models.embedded import cache_root
from eagle_lab.models.target import Target
from eagle_lab.training.corpus_layout import (
    MANIFEST,
    Conversation,
    Split,
    claim,
    layer_tag,
    read_manifest,
    release,
    write_manifest,
)
from eagle_lab.training.features import STORE_DTYPE, Example, compute_features, greedy_tokens

log = logging.getLogger(__name__)

Tokenize = Callable[[Conversation], tuple[list[int], list[int]]]
# ---- capture ------------------------------------------------------------------------------

@dataclass
class CaptureProgress:
    """One line per shard: tokens done of the requested total, this process's rate, and the
    rate of all workers together (what the ETA uses: other workers fill shards too)."""

    split: str
    total_tokens: int
    done_tokens: int
    shards_total: int
    shards_done: int
    started: float = 0.0
    tokens_this_run: int = 0
    done_at_start: int = -1

    def line(self) -> str:
        if self.done_at_start < 0:
            self.done_at_start = self.done_tokens
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        mine, overall = self.tokens_this_run / elapsed, (self.done_tokens - self.done_at_start) / elapsed
        left = max(self.total_tokens - self.done_tokens, 0)
        eta = _duration(left / overall) if overall > 0 else "?"
        return (f"capture {self.split}: {self.shards_done}/{self.shards_total} shards, "
                f"{self.done_tokens / 1e6:.2f}M/{self.total_tokens / 1e6:.2f}M tokens, "
                f"{mine:.0f} tok/s here, {overall:.0f} tok/s all workers, ETA {eta}")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def _shard_tokens(path: Path) -> int:
    with safe_open(str(path), framework="pt") as shard:
        return int((shard.metadata() or {}).get("tokens", 0))


def capture_split(target: Target, split: Split, count: int, tokenize: Tokenize, token_counts: list[int],
                  layer_ids: tuple[int, ...] = (), batch_size: int = 4, wait: bool = True) -> None:
    """Capture the shards holding the first `count` conversations of `split`.

    Shards already on disk are kept; shards locked by a live worker are left to it, and
    with `wait` this call then waits until they appear (so a trainer never starts on a
    partial set). token_counts: tokens of each conversation of the split (for progress).
    """
    shards = split.shards_for(count)
    split.directory.mkdir(parents=True, exist_ok=True)
    todo = [k for k in shards if not split.is_complete(k, layer_ids)]
    tokens = lambda ks: sum(token_counts[i] for k in ks for i in split.conversation_range(k))  # noqa: E731
    progress = CaptureProgress(split.name, tokens(shards), tokens(shards) - tokens(todo), len(shards),
                               len(shards) - len(todo), started=time.perf_counter())
    if not todo:
        return
    log.info("%s (%s)", progress.line(), f"features{' + ' + layer_tag(layer_ids) if layer_ids else ''}")
    bar = tqdm(total=progress.total_tokens, initial=progress.done_tokens, unit="tok", unit_scale=True,
               desc=f"capture {split.name}", disable=not sys.stderr.isatty())
    waiting: list[int] = []
    for k in todo:
        if split.is_complete(k, layer_ids):  # another worker finished it meanwhile
            continue
        if not claim(split, k):
            waiting.append(k)
            continue
        try:
            if not split.is_complete(k, layer_ids):
                done = _capture_shard(target, split, k, tokenize, layer_ids, batch_size)
                progress.tokens_this_run += done
                bar.update(done)
        finally:
            release(split, k)
        progress.done_tokens = tokens([j for j in shards if split.is_complete(j, layer_ids)])
        progress.shards_done = sum(split.is_complete(j, layer_ids) for j in shards)
        log.info(progress.line())
    bar.close()
    while wait and waiting:
        waiting = [k for k in waiting if not split.is_complete(k, layer_ids)]
        if not waiting:
            break
        orphaned = [k for k in waiting if claim(split, k)]  # its worker died: do it here
        for k in orphaned:
            try:
                _capture_shard(target, split, k, tokenize, layer_ids, batch_size)
            finally:
                release(split, k)
        if len(orphaned) < len(waiting):
            log.info("capture %s: waiting for %d shard(s) another worker is capturing", split.name,
                     len(waiting) - len(orphaned))
            time.sleep(10)


def _capture_shard(target: Target, split: Split, k: int, tokenize: Tokenize, layer_ids: tuple[int, ...],
                   batch_size: int) -> int:
    """Compute and write shard k (or only its missing layer file); returns tokens computed."""
    top_file = split.shard_file(k)
    rows: list[tuple[int, list[int], list[int]]] = []  # (conversation index, input_ids, loss_mask)
    if top_file.exists():  # only the layer file is missing: reuse the stored tokens
        with safe_open(str(top_file), framework="pt") as shard:
            ids, offsets = shard.get_tensor("input_ids"), shard.get_tensor("offsets").tolist()
            conv = shard.get_tensor("conversation").tolist()
        rows = [(c, ids[a:b].tolist(), []) for c, a, b in zip(conv, offsets[:-1], offsets[1:])]
    else:
        for index in split.conversation_range(k):
            input_ids, loss_mask = tokenize(split.conversations[index])
            if any(loss_mask):  # no supervised token left after truncation: nothing to learn
                rows.append((index, input_ids, loss_mask))
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][1]))  # similar lengths batch well
    computed: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for start in range(0, len(order), batch_size):
        chunk = order[start: start + batch_size]
        for i, value in zip(chunk, compute_features(target, [rows[i][1] for i in chunk], layer_ids)):
            layers = None if value[1] is None else value[1].to("cpu", STORE_DTYPE)
            computed[i] = (value[0].to("cpu", STORE_DTYPE), layers)
    n_tokens = sum(len(r[1]) for r in rows)
    meta = {"tokens": str(n_tokens), "conversations": f"{split.conversation_range(k).start}:"
                                                       f"{split.conversation_range(k).stop}"}
    if layer_ids:
        layers = torch.cat([computed[i][1] for i in range(len(rows))]) if rows else torch.zeros(0, 0, dtype=STORE_DTYPE)
        _atomic_save({"layer_features": layers}, split.layer_file(k, layer_ids), meta)
    if not top_file.exists():
        if rows:
            features = torch.cat([computed[i][0] for i in range(len(rows))])
        else:
            features = torch.zeros(0, 0, dtype=STORE_DTYPE)
        lengths = torch.tensor([0] + [len(r[1]) for r in rows], dtype=torch.long)
        tensors = {
            "input_ids": torch.tensor([t for r in rows for t in r[1]], dtype=torch.int32),
            "loss_mask": torch.tensor([m for r in rows for m in r[2]], dtype=torch.uint8),
            "offsets": lengths.cumsum(0),
            "conversation": torch.tensor([r[0] for r in rows], dtype=torch.long),
            "features": features,
        }
        if split.name == "eval":
            tensors["target_token"] = greedy_tokens(target, features.to(target.dtype)).to(torch.int32).cpu()
        _atomic_save(tensors, top_file, meta)
    return n_tokens


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    tmp.replace(path)


# ---- reading ------------------------------------------------------------------------------

class CorpusStore:
    """Examples of the first `count` conversations of a split, read lazily from the shards.

    Token ids and masks (small) are held in memory; features are sliced from the memory-
    mapped shard files on demand, so a corpus far larger than RAM trains from the page cache.
    """

    def __init__(self, split: Split, count: int, layer_ids: tuple[int, ...] = ()):
        self.split, self.layer_ids, self.count = split, layer_ids, count
        self._handles: list = []
        self._index: list[tuple[int, int, int]] = []  # (handle slot, start, end) per example
        self._ids: list[torch.Tensor] = []
        self._masks: list[torch.Tensor] = []
        self._greedy: list[torch.Tensor | None] = []
        for k in split.shards_for(count):
            if not split.is_complete(k, layer_ids):
                raise EagleLabError(f"corpus shard {split.shard_file(k)} is missing: capture it first")
            top = safe_open(str(split.shard_file(k)), framework="pt")
            layers = safe_open(str(split.layer_file(k, layer_ids)), framework="pt") if layer_ids else None
            slot = len(self._handles)
            self._handles.append((top, layers))
            ids, mask = top.get_tensor("input_ids"), top.get_tensor("loss_mask")
            greedy = top.get_tensor("target_token") if "target_token" in top.keys() else None  # noqa: SIM118 (no __contains__)
            offsets, conversations = top.get_tensor("offsets").tolist(), top.get_tensor("conversation").tolist()
            for c, a, b in zip(conversations, offsets[:-1], offsets[1:]):
                if c >= count:
                    break
                self._index.append((slot, a, b))
                self._ids.append(ids[a:b].long())
                self._masks.append(mask[a:b].bool())
                self._greedy.append(None if greedy is None else greedy[a:b].long())

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int) -> Example:
        slot, a, b = self._index[index]
        top, layers = self._handles[slot]
        return Example(self._ids[index], self._masks[index], top.get_slice("features")[a:b],
                       None if layers is None else layers.get_slice("layer_features")[a:b],
                       self._greedy[index])

    def lengths(self) -> list[int]:
        return [ids.numel() for ids in self._ids]

    @property
    def tokens(self) -> int:
        return sum(self.lengths())

    def supervised_tokens(self) -> Iterator[torch.Tensor]:
        """Per example: the token ids under the loss mask (for the draft vocabulary)."""
        for ids, mask in zip(self._ids, self._masks):
            yield ids[mask]


class CorpusStores:
    """Several stores read as one training set (a mix of corpora: the source's replies and the
    target's own); example i of the whole is example i - offset of the store that holds it."""

    def __init__(self, stores: list[CorpusStore]):
        self.stores = stores
        self._starts = [0]
        for store in stores:
            self._starts.append(self._starts[-1] + len(store))

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> Example:
        part = bisect.bisect_right(self._starts, index) - 1
        return self.stores[part][index - self._starts[part]]

    def lengths(self) -> list[int]:
        return [n for store in self.stores for n in store.lengths()]

    @property
    def tokens(self) -> int:
        return sum(store.tokens for store in self.stores)

    def supervised_tokens(self) -> Iterator[torch.Tensor]:
        for store in self.stores:
            yield from store.supervised_tokens()


@dataclass
class Corpus:
    """A corpus on disk and how it splits: the training pool and the held-out tail."""

    train: Split
    eval: Split
    train_counts: list[int]  # tokens of each pool conversation (0: nothing supervised)
    eval_counts: list[int]


def count_and_split(conversations: list[Conversation], tokenize: Tokenize, held: int) -> dict:
    """Tokens of every conversation (0: nothing supervised within max_length), the held-out set
    (the last `held` conversations that have a supervised token) and the training pool (every
    conversation before the first held-out one, in source order), as the manifest stores them."""
    counts = [len(ids) if any(mask) else 0 for ids, mask in
              (tokenize(c) for c in tqdm(conversations, desc="counting tokens", unit="conv",
                                         disable=not sys.stderr.isatty()))]
    supervised = [i for i, n in enumerate(counts) if n > 0]
    if len(supervised) <= held:
        raise EagleLabError(f"only {len(supervised)} conversations keep a supervised token: too few to hold out "
                            f"data.eval_conversations={held}")
    heldout_ids = supervised[-held:]
    return {"source_conversations": len(conversations), "heldout_indices": heldout_ids,
            "train_token_counts": counts[: heldout_ids[0]], "eval_token_counts": [counts[i] for i in heldout_ids]}


def open_corpus(directory: Path, fingerprint: dict, conversations: list[Conversation], tokenize: Tokenize,
                held: int, shard_conversations: int, write: bool = True) -> Corpus:
    """The corpus of `conversations` in `directory`: its manifest is read, or counted (about a
    minute for ShareGPT) and written once (`write`: only one rank writes)."""
    manifest = read_manifest(directory)
    if manifest is None or manifest.get("source_conversations") != len(conversations):
        manifest = count_and_split(conversations, tokenize, held)
        if write:
            write_manifest(directory, fingerprint, manifest)
    heldout_ids = manifest["heldout_indices"]
    return Corpus(Split("train", conversations[: heldout_ids[0]], directory / "train", shard_conversations),
                  Split("eval", [conversations[i] for i in heldout_ids], directory / "eval", shard_conversations),
                  manifest["train_token_counts"], manifest["eval_token_counts"])


def status(directory: Path, shard_conversations: int, layer_ids: tuple[int, ...] = ()) -> dict:
    """How much of a corpus is on disk: shards, conversations and tokens per split, and bytes."""
    manifest = read_manifest(directory) or {}
    stored = sum(p.stat().st_size for p in directory.rglob("*.safetensors"))
    result: dict = {"directory": str(directory), "bytes": stored}
    for name in ("train", "eval"):
        counts = manifest.get(f"{name}_token_counts", [])
        split = Split(name, [{}] * len(counts), directory / name, shard_conversations)  # type: ignore[list-item]
        done = [k for k in range(split.shard_count) if split.is_complete(k, layer_ids)]
        prefix = next((k for k in range(split.shard_count) if k not in set(done)), split.shard_count)
        result[name] = {
            "conversations": len(counts), "tokens": sum(counts), "shards": split.shard_count,
            "shards_done": len(done),
            "tokens_done": sum(_shard_tokens(split.shard_file(k)) for k in done),
            "prefix_conversations": min(prefix * shard_conversations, len(counts)),
        }
    return result


def main(argv: list[str] | None = None) -> int:
    """`python -m eagle_lab.training.corpus [DIR ...]`: what each feature corpus holds (default: all in the cache)."""
    argv = sys.argv[1:] if argv is None else argv
    directories = [Path(a) for a in argv] or sorted((cache_root() / "features").glob("*-corpus-*"))
    if not directories:
        print(f"no feature corpus under {cache_root() / 'features'}")
        return 0
    for directory in directories:
        manifest = read_manifest(directory)
        if manifest is None:
            print(f"{directory}: no {MANIFEST} (not a corpus, or its first capture has not counted tokens yet)")
            continue
        fp = manifest["fingerprint"]
        tags = sorted({p.name.split("_")[0] for p in (directory / "train").glob("layers-*.safetensors")})
        report = status(directory, int(fp["shard_conversations"]))
        print(f"{directory}  ({report['bytes'] / 2**30:.2f} GiB; max_length {fp['max_length']}; "
              f"layer files: {', '.join(tags) or 'none'})")
        for name in ("train", "eval"):
            r = report[name]
            print(f"  {name:5s} {r['shards_done']}/{r['shards']} shards, {r['tokens_done'] / 1e6:.2f}M of "
                  f"{r['tokens'] / 1e6:.2f}M tokens; complete prefix: {r['prefix_conversations']} of "
                  f"{r['conversations']} conversations")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
