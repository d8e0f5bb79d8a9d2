"""One target forward over the draft trees of several sequences (batch > 1).

Each sequence owns a KV cache (a DynamicCache of length past_i). When a batch forms, the
caches are gathered into one right-padded cache, and every round pads the trees:

  keys/values   (B, kvH, P + N, D)   P = max past_i, N = max tree size; row i holds its past in
                                     [0, past_i), padding up to P, its tree in [P, P + n_i)
  input_ids     (B, N)               padded with the root token
  position_ids  (B, N)               past_i + depth of each node (row i's own positions)
  mask          (B, 1, N, P + N)     additive: a real node sees row i's valid past and its
                                     ancestors (the tree mask); padding is never seen; a
                                     padded query sees only itself (no empty softmax row)

After verification each row keeps its past and then its accepted nodes, moved in place (the
per-row equivalent of eagle_lab.decoding.cache.keep_accepted), and the padded cache is kept for the next
round while the same sequences share the forward (continuous batching changes membership only
between rounds, and mostly not every round). Batch 1 runs on the sequence's own cache, untouched.

Why a kept padded cache rather than gathering each round and scattering back: measured with
`python -m eagle_lab.serving.batch` on SmolLM2 (2-core CPU shared with other jobs, one thread;
8 rows of 256 cached tokens), the gather costs 40 ms and gather + scatter 65-110 ms, which a
gather/scatter design pays every round, against a forward of 324-403 ms for 8 x 13 tree tokens
and 155-174 ms for 8 single tokens (vanilla): 20-70 % on top. Kept, a round pays only the
in-place move of its accepted entries, 6-8 ms; the gather is paid when membership changes.
A DynamicCache layer still appends by torch.cat, so each
forward copies the cache once either way; avoiding that too would need a cache class writing
in place at per-row offsets, which Hugging Face's caches do not offer (StaticCache writes every
row at the same positions).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from eagle_lab.decoding.cache import move_row_entries
from eagle_lab.decoding.generate import _head_features
from eagle_lab.serving.sequence import Scored, Sequence
from eagle_lab.models.target import Target, TargetConfig, additive_mask, load_target
from eagle_lab.decoding.tree import DraftTree, build_tree


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
    return additive_mask(allowed, dtype)[:, None]  # (B, 1, N, P + N)


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


class PaddedBatch:
    """The batched cache, kept between rounds while the same sequences share the forward.

    Rows hold each member's cache right-padded to the longest (width = max past_i). After a
    round a row keeps its accepted nodes by moving them, in place, right after its past; the
    cache is then cut to the new longest row. Members' own caches are stale meanwhile: when
    the membership changes (a sequence joins, leaves, or is alone) `release` hands every
    remaining member its row back (a view), and the next round gathers the new batch.
    """

    def __init__(self, target: Target):
        self.target = target
        self.members: list[Sequence] = []
        self.cache = None  # DynamicCache (B, kvH, width, D) per layer, or None
        self.gathers = 0  # how often the batch was (re)built: once per change of membership

    def release(self) -> None:
        """Every live member gets its row back as its own cache (1, kvH, past_i, D); the batch empties."""
        for row, sequence in enumerate(self.members):
            if sequence.done:  # finished or cancelled: its row is dropped
                continue
            for source, own in zip(self.cache.layers, sequence.cache.layers):
                own.keys = source.keys[row: row + 1, :, :sequence.past]
                own.values = source.values[row: row + 1, :, :sequence.past]
        self.members, self.cache = [], None

    def drop(self) -> None:
        """Forget the batch without handing rows back (its forward failed: every member failed with it)."""
        self.members, self.cache = [], None

    @torch.no_grad()
    def score(self, sequences: list[Sequence]) -> list[Scored]:
        """One forward over every sequence's drafted tree; one Scored per sequence, in order."""
        target, device = self.target, self.target.device
        if [id(s) for s in sequences] != [id(m) for m in self.members]:
            self.release()
            self.cache = gather_caches(target, [s.cache for s in sequences], max(s.past for s in sequences))
            self.members = list(sequences)
            self.gathers += 1
        trees, pasts = [s.tree for s in sequences], [s.past for s in sequences]
        width, nodes = max(pasts), max(t.size for t in trees)
        for layer in self.cache.layers:  # cut to the longest row: (B, kvH, width, D)
            layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]
        tokens = torch.stack([torch.cat([t.tokens, t.tokens[:1].expand(nodes - t.size)]) for t in trees])  # (B, N)
        positions = torch.stack([torch.cat([past + t.depths, t.depths.new_full((nodes - t.size,), past)])
                                 for past, t in zip(pasts, trees)]).to(device)  # (B, N)
        mask = padded_mask(pasts, trees, target.dtype, device)  # (B, 1, N, width + N)
        out = target.forward(tokens.to(device), self.cache, positions, layer_ids=sequences[0].layer_ids,
                             attention_mask=mask)
        head = _head_features(out)  # (B, N, F)
        return [Scored(out.features[row, :tree.size], head[row, :tree.size],
                       lambda accepted, row=row, past=past: self._keep(row, past, width, accepted))
                for row, (past, tree) in enumerate(zip(pasts, trees))]  # (n_i, H), (n_i, F)

    def _keep(self, row: int, past: int, width: int, accepted: torch.Tensor) -> None:
        """Row `row` keeps its past and then its accepted nodes (L,), moved in place to [past, past + L)."""
        index = accepted.to(self.target.device) + width
        for layer in self.cache.layers:
            move_row_entries((layer.keys, layer.values), row, index, past)  # (B, kvH, width + N, D)


@torch.no_grad()
def time_gather_and_forward(target: Target, batch: int, past: int, nodes: int, reps: int = 3) -> dict[str, float]:
    """ms of a gather (what a padded batch pays when its membership changes; gathering every round
    and scattering back would pay it and as much again every round), of the in-place compaction
    a kept batch pays every round, and of the forward, for `batch` rows of `past` cached tokens
    scoring `nodes`-token chains (the comparison the module docstring makes)."""
    g = torch.Generator().manual_seed(0)
    cache = target.new_cache()
    target.forward(torch.randint(0, target.vocab_size, (1, past), generator=g).to(target.device), cache)
    ids = torch.randint(0, target.vocab_size, (batch, nodes), generator=g).to(target.device)  # (B, N)
    chain = build_tree(ids[0], torch.arange(-1, nodes - 1, device=target.device))
    mask = padded_mask([past] * batch, [chain] * batch, target.dtype, target.device)  # (B, 1, N, P + N)
    positions = (past + chain.depths).expand(batch, nodes)  # (B, N)
    accepted = torch.arange(min(nodes, 3), device=target.device) + past
    times: dict[str, list[float]] = {"gather_ms": [], "compact_ms": [], "forward_ms": []}
    for _ in range(reps + 1):  # the first is a warm-up
        start = time.perf_counter()
        batched = gather_caches(target, [cache] * batch, past)
        gathered = time.perf_counter()
        target.forward(ids, batched, positions, attention_mask=mask)
        scored = time.perf_counter()
        for row in range(batch):
            for layer in batched.layers:
                move_row_entries((layer.keys, layer.values), row, accepted, past)
        for name, ms in (("gather_ms", gathered - start), ("forward_ms", scored - gathered),
                         ("compact_ms", time.perf_counter() - scored)):
            times[name].append(1000 * ms)
    return {name: statistics.median(values[1:]) for name, values in times.items()}


if __name__ == "__main__":  # python -m eagle_lab.serving.batch [target] : the copies vs the forward
    loaded = load_target(TargetConfig(name=sys.argv[1] if len(sys.argv) > 1 else "smollm2_135m",
                                      source="tiny" if len(sys.argv) > 1 and "tiny" in sys.argv[1] else "embedded"))
    for b, p, n in ((2, 256, 13), (4, 256, 13), (8, 256, 13), (8, 1024, 13), (8, 256, 1)):
        costs = time_gather_and_forward(loaded, b, p, n)
        print(f"batch {b}, past {p}, {n} nodes/row: gather {costs['gather_ms']:.1f} ms, in-place compaction "
              f"{costs['compact_ms']:.1f} ms, forward {costs['forward_ms']:.1f} ms", flush=True)
