"""Target hidden states for training: the example type, the forward that computes features and
the target's greedy tokens. One disk format stores them, the corpus shards of
`eagle_lab.training.corpus`, whether a run holds out a corpus tail or splits its own data.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

import torch

from eagle_lab.models.target import Target

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
    """Directory of a run's own train/eval split (data.eval_conversations = 0), in the corpus
    shard format ("format"; the single-file shards of earlier versions are not read)."""
    # "layer_index": which hidden state a layer id names (HF hidden_states[i], the input of layer i)
    blob = json.dumps({"target": target_name, "data": data_fingerprint, "layers": list(layer_ids),
                       "layer_index": "hf_hidden_states", "format": "corpus-shards"}, sort_keys=True)
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
