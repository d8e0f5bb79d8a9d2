"""Several sequences on one static cache, scored together by one fixed-shape forward (the server's
compiled path).

Each sequence owns a row of a preallocated cache [R, kvH, capacity, D] (R = the server's
max_batch). A round over b sequences runs the backend's step (compiled or eager) over the
first `bucket(b)` rows, the view that `StaticKVCache.view` gives, so a few graphs serve every
batch size. Rows hold their own pasts; a forward writes every row's new tokens at the same
positions (what `StaticCache` does), after the longest committed row:

  keys/values  rows [0, B), positions [0, P + K)   P = max past_i over the rows in use, K = bucket of the
                                                  largest tree; row i: its past in [0, past_i), stale
                                                  entries up to P, its tree at [P, P + n_i)
  input_ids    (B, K)      padded with token 0
  positions    (B, K)      past_i + depth of each node (padding: P + its column)
  mask         (B, 1, K, L) additive, L = StaticBackend.attended_length of P + K: a node sees row i's past
                           and its ancestors; a padded query (or a row not in this round) sees only itself

Verification then moves row i's accepted entries from P + node to past_i + j, in place. Rows
in use are kept at the front: when a sequence leaves, the last row in use moves into its slot
(`pack`), so b sequences always fit the first bucket(b) rows. Attention reads only the first
L positions, so a round's cost follows the longest sequence, not the cache's capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from eagle_lab.decoding.scoring import Scored
from eagle_lab.decoding.static_cache import StaticKVCache
from eagle_lab.decoding.tree import DraftTree
from eagle_lab.errors import EagleLabError
from eagle_lab.models.masks import causal_mask, visibility
from eagle_lab.models.target import Target


class StepBackend(Protocol):
    """What the rows need of eagle_lab.decoding.backend.StaticBackend: its target, cache sizing, and the eager
    prefill and fixed-shape step over a cache view."""

    target: Target
    compiled: bool
    cache_block: int
    slack: int

    def bucket(self, count: int) -> int: ...

    def attended_length(self, needed: int, capacity: int, rows: int, tokens: int,
                        layer_ids: tuple[int, ...] = ()) -> int: ...

    def prefill(self, cache: StaticKVCache, row: int, prompt_ids: torch.Tensor, layer_ids: tuple[int, ...]): ...

    def step(self, cache: StaticKVCache, start: int, length: int, input_ids, positions, mask, layer_ids): ...


@dataclass
class Row:
    """A sequence's place in the shared cache: its row (moved by packing) and committed length."""

    index: int
    past: int = 0
    attached: bool = True


@dataclass
class RowScore:
    features: torch.Tensor  # (n, H) top features at the tree's nodes
    head_features: torch.Tensor  # (n, F) what the drafter reads there
    logits: torch.Tensor  # (n, V) float32: every node's logits from the step's one LM-head matmul
    scored_at: int  # where the tree's K/V was written (P)


def rows_capacity(backend: StepBackend, context: int) -> int:
    """Positions per row of a cache whose sequences hold up to `context` tokens: the context, the backend's
    slack, in whole blocks."""
    context = min(context, backend.target.max_context)
    return -(-(context + backend.slack) // backend.cache_block) * backend.cache_block


def row_buckets(rows: int) -> list[int]:
    """Powers of two below `rows`, then `rows`: the row counts a forward runs at."""
    sizes, size = [], 1
    while size < rows:
        sizes.append(size)
        size *= 2
    return sizes + [rows]


class StaticRows:
    def __init__(self, backend: StepBackend, rows: int, context: int, token_buckets: list[int] | None = None,
                 row_counts: list[int] | None = None, cache: StaticKVCache | None = None):
        """context: the most tokens (prompt + generated) one sequence may hold.
        row_counts: the row counts a forward may run at (default: powers of two, then `rows`).
        cache: an existing cache of `rows` rows to decode in (the backend's one-sequence caches); context is
        then what its capacity holds."""
        if rows < 1:
            raise EagleLabError(f"a static batch needs at least one row, got {rows}")
        self.backend, self.target = backend, backend.target
        if cache is not None:
            self.capacity, self.cache = cache.capacity, cache
            self.context = min(context, self.capacity - backend.slack, self.target.max_context)
        else:
            self.context = min(context, self.target.max_context)
            self.capacity = rows_capacity(backend, context)
            self.cache = StaticKVCache(self.target.config, self.capacity, self.target.device, self.target.dtype,
                                       rows=rows)
        if row_counts is not None and not all(0 < count <= rows for count in row_counts):
            raise EagleLabError(f"row counts must lie in [1, {rows}], got {list(row_counts)}")
        self.buckets = row_buckets(rows) if row_counts is None else sorted(set(row_counts) | {rows})
        self.token_buckets = sorted(token_buckets) if token_buckets else None
        self.rows: list[Row | None] = [None] * rows

    # ---- membership ----

    def attach(self) -> Row:
        for index, row in enumerate(self.rows):
            if row is None:
                self.rows[index] = Row(index)
                return self.rows[index]
        raise EagleLabError(f"all {len(self.rows)} rows of the static batch are in use")

    def detach(self, row: Row) -> None:
        if row.attached:
            self.rows[row.index], row.attached = None, False

    def pack(self) -> int:
        """Move rows in use to the front; -> how many are in use."""
        used = [row for row in self.rows if row is not None]
        for slot, row in enumerate(used):
            if row.index != slot:
                self.cache.move_row(row.index, slot, row.past)
                self.rows[slot], self.rows[row.index] = row, None
                row.index = slot
        return len(used)

    # ---- forwards ----

    @torch.no_grad()
    def prefill(self, row: Row, prompt_ids: torch.Tensor, layer_ids: tuple[int, ...] = ()):
        """prompt_ids: [T] into this row alone, eagerly (prompt lengths vary)
        -> hidden [T, H], layers [T, F] or None."""
        count = prompt_ids.numel()
        if count > self.context:
            raise EagleLabError(f"the prompt has {count} tokens, more than a sequence may hold here ({self.context})")
        hidden, layers = self.backend.prefill(self.cache, row.index, prompt_ids, layer_ids)
        row.past = count
        return hidden[0], None if layers is None else layers[0]

    @torch.no_grad()
    def score(self, rows: list[Row], trees: list[DraftTree], layer_ids: tuple[int, ...] = ()) -> list[RowScore]:
        """One forward over every row's tree (rows: attached, in any order) -> one RowScore per row."""
        return self.score_nodes(rows, [(tree.tokens, tree.depths, tree.mask) for tree in trees], layer_ids)

    @torch.no_grad()
    def score_nodes(self, rows: list[Row], nodes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                    layer_ids: tuple[int, ...] = ()) -> list[RowScore]:
        """score() for nodes given as (tokens [n], depths [n], ancestor-or-self mask [n, n]) per row."""
        in_use = self.pack()
        device, dtype = self.target.device, self.target.dtype
        batch = next(size for size in self.buckets if size >= in_use)
        width = max(row.past for row in self.rows[:in_use])  # P: no row's committed entries lie past it
        tokens_per_row = self._token_bucket(max(tokens.numel() for tokens, _, _ in nodes))
        if width + tokens_per_row > self.capacity:
            raise EagleLabError(f"the static batch cache ({self.capacity}) cannot hold {tokens_per_row} more tokens "
                                f"after {width}")
        length = self.backend.attended_length(width + tokens_per_row, self.capacity, batch, tokens_per_row, layer_ids)
        input_ids = torch.zeros(batch, tokens_per_row, dtype=torch.long, device=device)  # (B, K)
        positions = torch.arange(width, width + tokens_per_row, device=device).repeat(batch, 1)  # (B, K)
        pasts, trees = [0] * batch, [None] * batch  # by row index: rows not in this round see only themselves
        for row, (tokens, depths, tree_mask) in zip(rows, nodes):
            n, i = tokens.numel(), row.index
            input_ids[i, :n] = tokens
            positions[i, :n] = row.past + depths
            pasts[i], trees[i] = row.past, tree_mask.to(device)
        allowed = visibility(pasts, trees, tokens_per_row, length, width)  # (B, K, L)
        mask = self.target.layout.masks(allowed, positions, width, dtype)  # (B, 1, K, L), per layer type if mixed
        hidden, layers, logits = self.backend.step(self.cache, width, length, input_ids, positions, mask, layer_ids)
        out = []
        for row, (tokens, _, _) in zip(rows, nodes):
            n, i = tokens.numel(), row.index
            top = hidden[i, :n]  # (n, H)
            out.append(RowScore(top, top if layers is None else layers[i, :n], logits[i, :n], width))
        return out

    def keep(self, row: Row, scored: RowScore, accepted: torch.Tensor) -> None:
        """After verification: the row keeps its past and then its accepted nodes (L,)."""
        self.cache.keep_accepted(row.past, accepted, row=row.index, scored_at=scored.scored_at)
        row.past += accepted.numel()

    def keep_roots(self, rows: list[Row], scored_at: int) -> None:
        """After a plain round (every row scored its root alone at `scored_at`): each row keeps that entry,
        moved to its own past by one copy per layer tensor for all rows."""
        device = self.target.device
        indices = torch.tensor([row.index for row in rows], device=device)  # [n]
        targets = torch.tensor([row.past for row in rows], device=device)  # [n]
        self.cache.move_entries(indices, torch.full_like(targets, scored_at), targets)
        for row in rows:
            row.past += 1

    def _token_bucket(self, count: int) -> int:
        """Tokens per row a forward of `count` runs at: a bucket (graphs are shared by shape), or `count` itself
        on an eager backend, which has no graphs to share."""
        if not self.backend.compiled:
            return count
        if self.token_buckets:
            for size in self.token_buckets:
                if size >= count:
                    return size
        return self.backend.bucket(count)


class RowScorer:
    """One sequence on a row of static rows: the Scorer contract (eagle_lab/decoding/scoring.py) over StaticRows,
    so a single sequence is scored by the step that scores a batch (a one-row cache of the backend's)."""

    def __init__(self, rows: StaticRows, layer_ids: tuple[int, ...] = ()):
        self.rows, self.layer_ids = rows, layer_ids
        self.row = rows.attach()
        self.max_context = rows.context
        self.scored: RowScore | None = None  # the last score (its own, or score_rows'), which commit() keeps from

    @property
    def past(self) -> int:
        return self.row.past

    def prefill(self, prompt_ids: torch.Tensor) -> Scored:
        """prompt_ids: [T] -> features [T, H], logits of the last token [1, V]."""
        hidden, layers = self.rows.prefill(self.row, prompt_ids, self.layer_ids)  # [T, H], [T, F] or None
        return Scored(hidden, hidden if layers is None else layers, self.rows.target.logits(hidden[-1:]))

    def score(self, tokens: torch.Tensor, depths: torch.Tensor | None = None,
              tree_mask: torch.Tensor | None = None) -> Scored:
        """tokens: [N] after `past`; depths [N] and tree_mask [N, N] for a tree, None for a chain."""
        if tree_mask is None:
            count = tokens.numel()
            tree_mask = causal_mask(count, tokens.device)  # a chain
            depths = torch.arange(count, device=tokens.device)
        self.scored = self.rows.score_nodes([self.row], [(tokens, depths, tree_mask)], self.layer_ids)[0]
        return Scored(self.scored.features, self.scored.head_features, self.scored.logits)

    def commit(self, accepted: torch.Tensor) -> None:
        self.rows.keep(self.row, self.scored, accepted)

    def rewind(self) -> None:
        """Nothing to undo: the row's committed length did not move, and the next forward writes over what was
        scored after it."""

    def release(self) -> None:
        self.rows.detach(self.row)
