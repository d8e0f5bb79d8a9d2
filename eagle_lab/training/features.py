"""Target hidden states for training: captured once into shards (offline) or per batch (online).

A shard is one safetensors file holding a run of examples back to back:
  input_ids [N] int32, loss_mask [N] uint8, offsets [E + 1] int64,
  features [N, H] (the target's top hidden state, the LM-head input),
  layer_features [N, n*H] (chosen decoder layers, EAGLE-3 heads only).
Shards are written to a temporary name and renamed, so a killed capture resumes at the
first missing shard and never reads a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from eagle_lab.target import Target

log = logging.getLogger(__name__)
STORE_DTYPE = torch.bfloat16  # halves the disk; features are regression targets, not exact values


@dataclass
class Example:
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    features: torch.Tensor  # [T, H]
    layer_features: torch.Tensor | None = None  # [T, n*H]
    target_token: torch.Tensor | None = None  # [T] the target's greedy next token at each position


@torch.no_grad()
def greedy_tokens(target: Target, top: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """[..., T, H] top features -> [..., T] argmax of the target's full-vocabulary logits,
    in chunks of positions so the [chunk, V] logits stay small."""
    weight = target.lm_head.weight
    flat = top.reshape(-1, top.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
    for start in range(0, flat.shape[0], chunk):
        piece = flat[start: start + chunk].to(device=weight.device, dtype=weight.dtype)
        out[start: start + chunk] = torch.nn.functional.linear(piece, weight).argmax(-1).to(out.device)
    return out.view(top.shape[:-1])


def features_key(target_name: str, data_fingerprint: dict, layer_ids: tuple[int, ...]) -> str:
    # "layer_index": which hidden state a layer id names (HF hidden_states[i], the input of layer i)
    blob = json.dumps({"target": target_name, "data": data_fingerprint, "layers": list(layer_ids),
                       "layer_index": "hf_hidden_states"}, sort_keys=True)
    return f"{target_name}-{hashlib.sha1(blob.encode()).hexdigest()[:12]}"


def _pad_batch(rows: list[list[int]], device) -> torch.Tensor:
    longest = max(len(r) for r in rows)
    out = torch.zeros(len(rows), longest, dtype=torch.long, device=device)  # right padding: causal attention
    for i, row in enumerate(rows):  # never lets a valid position see a pad
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


@torch.no_grad()
def compute_features(target: Target, batch_ids: list[list[int]], layer_ids: tuple[int, ...] = ()):
    """Target features for a batch of token lists -> list of ([T, H], [T, n*H] | None) on CPU."""
    ids = _pad_batch(batch_ids, target.device)  # [B, T]
    out = target.forward(ids, layer_ids=layer_ids)
    result = []
    for i, row in enumerate(batch_ids):
        top = out.features[i, : len(row)]
        layers = out.layer_features[i, : len(row)] if out.layer_features is not None else None
        result.append((top, layers))
    return result


def capture(target: Target, dataset, out_dir: Path, layer_ids: tuple[int, ...] = (), shard_examples: int = 32,
            batch_size: int = 4, rank: int = 0, world: int = 1, desc: str = "capture") -> Path:
    """Write shards for `dataset` (rows with input_ids, loss_mask); resumes where it stopped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    total = len(dataset)
    shard_count = (total + shard_examples - 1) // shard_examples
    todo = [k for k in range(shard_count) if k % world == rank and not (out_dir / f"shard_{k:05d}.safetensors").exists()]
    if not todo:
        return out_dir
    tokens_todo = sum(len(dataset[i]["input_ids"]) for k in todo
                      for i in range(k * shard_examples, min(total, (k + 1) * shard_examples)))
    bar = tqdm(total=tokens_todo, unit="tok", desc=f"{desc} ({len(todo)}/{shard_count} shards)", smoothing=0.1)
    started, done_tokens = time.perf_counter(), 0
    for k in todo:
        rows = [dataset[i] for i in range(k * shard_examples, min(total, (k + 1) * shard_examples))]
        ids, masks, feats, layer_feats = [], [], [], []
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))  # similar lengths batch well
        computed: dict[int, tuple] = {}
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            for i, value in zip(chunk, compute_features(target, [rows[i]["input_ids"] for i in chunk], layer_ids)):
                computed[i] = value
            n = sum(len(rows[i]["input_ids"]) for i in chunk)
            bar.update(n)
            done_tokens += n
        for i, row in enumerate(rows):
            ids.append(torch.tensor(row["input_ids"], dtype=torch.int32))
            masks.append(torch.tensor(row["loss_mask"], dtype=torch.uint8))
            feats.append(computed[i][0].to("cpu", STORE_DTYPE))
            if layer_ids:
                layer_feats.append(computed[i][1].to("cpu", STORE_DTYPE))
        lengths = torch.tensor([0] + [len(x) for x in ids])
        tensors = {"input_ids": torch.cat(ids), "loss_mask": torch.cat(masks), "offsets": lengths.cumsum(0),
                   "features": torch.cat(feats)}
        if layer_ids:
            tensors["layer_features"] = torch.cat(layer_feats)
        tmp = out_dir / f".shard_{k:05d}.tmp"
        save_file(tensors, str(tmp))
        tmp.replace(out_dir / f"shard_{k:05d}.safetensors")
    bar.close()
    elapsed = time.perf_counter() - started
    log.info("captured %d tokens in %.1fs: %.0f tok/s -> %s", done_tokens, elapsed, done_tokens / max(elapsed, 1e-9), out_dir)
    return out_dir


class ShardStore:
    """All examples of a shard directory, kept in memory (bf16 features)."""

    def __init__(self, directory: Path, expected_examples: int | None = None, load_layers: bool = True):
        files = sorted(directory.glob("shard_*.safetensors"))
        self.examples: list[Example] = []
        for file in files:
            with safe_open(str(file), framework="pt") as shard:
                keys = set(shard.keys())
                ids, mask, offsets = shard.get_tensor("input_ids"), shard.get_tensor("loss_mask"), shard.get_tensor("offsets")
                feats = shard.get_tensor("features")
                layers = shard.get_tensor("layer_features") if load_layers and "layer_features" in keys else None
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
                self.examples.append(Example(ids[a:b].long(), mask[a:b].bool(), feats[a:b],
                                             None if layers is None else layers[a:b]))
        if expected_examples is not None and len(self.examples) != expected_examples:
            raise RuntimeError(f"{directory} holds {len(self.examples)} examples, expected {expected_examples}")

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Example:
        return self.examples[index]

    def lengths(self) -> list[int]:
        return [e.input_ids.numel() for e in self.examples]

    @property
    def tokens(self) -> int:
        return sum(self.lengths())
