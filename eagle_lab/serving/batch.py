"""One target forward over the draft trees of several sequences (batch > 1).

Each sequence keeps its own KV cache (a DynamicCache of length past_i). A batched round
gathers them into one right-padded cache and pads the trees:

  keys/values   (B, kvH, P + N, D)   P = max past_i, N = max tree size; row i holds its past in
                                     [0, past_i), padding up to P, its tree in [P, P + n_i)
  input_ids     (B, N)               padded with the root token
  position_ids  (B, N)               past_i + depth of each node (row i's own positions)
  mask          (B, 1, N, P + N)     additive: a real node sees row i's valid past and its
                                     ancestors (the tree mask); padding is never seen; a
                                     padded query sees only itself (no empty softmax row)

After verification each row's accepted entries are scattered back into its own cache
(keep: past_i entries, then the accepted nodes in order), so the cache compaction is the
per-row equivalent of eagle_lab.cache.keep_accepted and batch 1 stays untouched.

Why gather/scatter and not a persistent padded slot cache: a DynamicCache layer appends by
torch.cat, so every forward already copies each cache once; a slot cache only saves the
gather and scatter copies if it also replaces the cache class with in-place writes at
per-row offsets, which Hugging Face's caches do not support (StaticCache writes every row
at the same positions). The copies are memory traffic of B x past x layers entries, small
next to the forward's matmuls over B x N tokens; `python -m eagle_lab.serving.batch` prints
both costs on this machine (numbers in the README's serving section).
"""

from __future__ import annotations

import torch

from eagle_lab.generate import _head_features
from eagle_lab.serving.sequence import Scored, Sequence
from eagle_lab.target import Target
from eagle_lab.tree import DraftTree


def padded_mask(pasts: list[int], trees: list[DraftTree], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """(B, 1, N, P + N) additive mask for right-padded caches and trees (see the module doc)."""
    width, nodes = max(pasts), max(t.size for t in trees)
    allowed = torch.zeros(len(trees), nodes, width + nodes, dtype=torch.bool, device=device)  # (B, N, P + N)
    pad = torch.arange(nodes, device=device)
    for row, (past, tree) in enumerate(zip(pasts, trees)):
        n = tree.size
        allowed[row, :n, :past] = True
        allowed[row, :n, width: width + n] = tree.mask.to(device)
        allowed[row, pad[n:], width + pad[n:]] = True  # padded queries: themselves only
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]  # (B, 1, N, P + N)


def gather_caches(target: Target, caches: list, width: int):
    """Per-sequence caches (1, kvH, past_i, D) per layer -> one cache (B, kvH, width, D), right-padded."""
    batched = target.new_cache()
    for index, layer in enumerate(batched.layers):
        rows = [cache.layers[index] for cache in caches]
        keys, values = rows[0].keys, rows[0].values
        shape = (len(rows), keys.shape[1], width, keys.shape[3])
        k = keys.new_zeros(shape)  # (B, kvH, width, D)
        v = values.new_zeros(shape)
        for row, source in enumerate(rows):
            length = source.keys.shape[2]
            k[row, :, :length] = source.keys[0]
            v[row, :, :length] = source.values[0]
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return batched


def scatter_row(batched, cache, row: int, past: int, width: int, accepted: torch.Tensor) -> None:
    """Row `row` of the batched cache -> `cache`: its past, then the accepted tree nodes (L,)."""
    for source, target_layer in zip(batched.layers, cache.layers):
        index = accepted.to(source.keys.device) + width
        # (1, kvH, past, D) + (1, kvH, L, D) -> (1, kvH, past + L, D)
        target_layer.keys = torch.cat([source.keys[row: row + 1, :, :past],
                                       source.keys[row: row + 1].index_select(2, index)], dim=2)
        target_layer.values = torch.cat([source.values[row: row + 1, :, :past],
                                         source.values[row: row + 1].index_select(2, index)], dim=2)


@torch.no_grad()
def score_together(target: Target, sequences: list[Sequence]) -> list[Scored]:
    """One forward over every sequence's drafted tree; returns one Scored per sequence, in order."""
    device = target.device
    trees = [s.tree for s in sequences]
    pasts = [s.past for s in sequences]
    width, nodes = max(pasts), max(t.size for t in trees)
    tokens = torch.stack([torch.cat([t.tokens, t.tokens[:1].expand(nodes - t.size)]) for t in trees])  # (B, N)
    positions = torch.stack([torch.cat([past + t.depths, t.depths.new_full((nodes - t.size,), past)])
                             for past, t in zip(pasts, trees)]).to(device)  # (B, N)
    mask = padded_mask(pasts, trees, target.dtype, device)  # (B, 1, N, P + N)
    batched = gather_caches(target, [s.cache for s in sequences], width)
    layer_ids = sequences[0].layer_ids
    out = target.forward(tokens.to(device), batched, positions, layer_ids=layer_ids, attention_mask=mask)
    head = _head_features(out)  # (B, N, F)
    scored = []
    for row, (sequence, past, tree) in enumerate(zip(sequences, pasts, trees)):
        def keep(accepted, row=row, cache=sequence.cache, past=past):
            scatter_row(batched, cache, row, past, width, accepted)
        scored.append(Scored(out.features[row, :tree.size], head[row, :tree.size], keep))  # (n_i, H), (n_i, F)
    return scored


@torch.no_grad()
def time_gather_and_forward(target: Target, batch: int, past: int, nodes: int, reps: int = 3) -> dict[str, float]:
    """ms of the gather + scatter copies and of the forward they feed, for `batch` rows of `past`
    cached tokens scoring `nodes`-token chains (the comparison the module docstring makes)."""
    import statistics
    import time

    from eagle_lab.tree import build_tree

    g = torch.Generator().manual_seed(0)
    cache = target.new_cache()
    target.forward(torch.randint(0, target.vocab_size, (1, past), generator=g).to(target.device), cache)
    ids = torch.randint(0, target.vocab_size, (batch, nodes), generator=g).to(target.device)  # (B, N)
    chain = build_tree(ids[0], torch.arange(-1, nodes - 1, device=target.device))
    mask = padded_mask([past] * batch, [chain] * batch, target.dtype, target.device)  # (B, 1, N, P + N)
    positions = (past + chain.depths).expand(batch, nodes)  # (B, N)
    accepted = torch.arange(min(nodes, 3), device=target.device)
    copies, forwards = [], []
    for _ in range(reps + 1):  # the first is a warm-up
        start = time.perf_counter()
        batched = gather_caches(target, [cache] * batch, past)
        gathered = time.perf_counter()
        target.forward(ids, batched, positions, attention_mask=mask)
        scored = time.perf_counter()
        for row in range(batch):
            scatter_row(batched, target.new_cache(), row, past, past, accepted)
        copies.append(1000 * (gathered - start + time.perf_counter() - scored))
        forwards.append(1000 * (scored - gathered))
    return {"copies_ms": statistics.median(copies[1:]), "forward_ms": statistics.median(forwards[1:])}


if __name__ == "__main__":  # python -m eagle_lab.serving.batch [target] : the copies vs the forward
    import sys

    from eagle_lab.target import TargetConfig, load_target

    loaded = load_target(TargetConfig(name=sys.argv[1] if len(sys.argv) > 1 else "smollm2_135m",
                                      source="tiny" if len(sys.argv) > 1 and "tiny" in sys.argv[1] else "embedded"))
    for b, p, n in ((2, 256, 13), (4, 256, 13), (8, 256, 13), (8, 1024, 13), (8, 256, 1)):
        costs = time_gather_and_forward(loaded, b, p, n)
        print(f"batch {b}, past {p}, {n} nodes/row: gather+scatter {costs['copies_ms']:.1f} ms, "
              f"forward {costs['forward_ms']:.1f} ms", flush=True)
