"""Batched drafting: one head forward per tree level serves every sequence of a batch.

At batch B, per-sequence drafting runs B x depth small head forwards a round. Here the rows
that share a head (the server's forks of one prototype) draft together, in a padded head cache
kept between rounds while the same sequences share it:

  keys/values  (B, kvH, W + ..., D)  W = max c_i; row i holds its c_i committed pairs in [0, c_i)
  step 1       (B, P) tokens, (B, P, F) unseen features, right-padded; positions c_i + j; mask
               (B, 1, P, W + P): row i's past and its new pairs causally. Then each row's new
               entries move, in place, to [c_i, c_i + P_i), c_i += P_i, and the cache is cut to
               the new W (the per-row equivalent of EagleDrafter._commit).
  level l      (B, K) frontier tokens, K = max k_i, (B, K, H) parent features; positions
               c_i + l - 1; mask (B, 1, K, W + E + K): row i's past, then the draft entries E
               of earlier levels (K slots a level) it descends from, and itself. Padded queries
               (k_i < K, or a row whose tree is shallower) see only themselves.
Candidate selection (drafters.growth.TreeGrowth, the n-gram merge) runs per row, exactly as
EagleDrafter.draft does, so each row gets the tree its drafter builds alone, up
to the float rounding of a padded forward. Frontier entries are cut at the next round.

Each drafter's `committed` stays current; its own HeadKVCache is stale while it is a member and
is handed back (a view of its row) when the membership changes, so drafting alone continues
exactly. EAGLE-3 heads batch the same way (the head's own `inputs`/`draft_logits` are used).
Rows that do not run the head (plain rounds, vanilla, drafting off, a non-EAGLE drafter) or
whose head no other row shares draft alone, as at batch 1.
"""

from __future__ import annotations

import torch

from eagle_lab.decoding.cache import move_row_entries
from eagle_lab.decoding.sequence import Sequence
from eagle_lab.decoding.tree import DraftTree, root_only_tree
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.head import EagleHead, HeadKVCache
from eagle_lab.drafters.growth import TreeGrowth
from eagle_lab.models.masks import additive_mask, causal_mask, visibility


def runs_head(sequence: Sequence) -> bool:
    """After prepare_draft: will this sequence's drafter run its head (EagleDrafter, drafting on)?"""
    drafter = sequence.drafter
    if not isinstance(drafter, EagleDrafter) or drafter.has_backlog:  # a backlog is fed by drafting alone
        return False
    shape = drafter.planned_shape(sequence.plan)
    return shape.depth >= 1 and shape.topk >= 1 and shape.total_tokens >= 1


class Row:
    """One sequence's tree growth during a batched round (the TreeGrowth that EagleDrafter.draft's loop grows)."""

    def __init__(self, sequence: Sequence, max_depth: int):
        self.sequence, self.drafter, self.max_depth = sequence, sequence.drafter, max_depth
        shape = self.drafter.planned_shape(sequence.plan)
        self.depth = min(shape.depth, max_depth)  # levels drafted; < 1: commit only, the tree is the root
        self.k = min(shape.topk, self.drafter.head.arch.draft_vocab_size)
        self.growth: TreeGrowth | None = None

    def start(self, hidden: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor) -> None:
        """hidden [H] at the root; scores, tokens [k]: the root's children."""
        self.growth = TreeGrowth(scores, tokens)
        self.parent_hidden = hidden[None].expand(self.k, -1)  # [k, H]

    def grow(self, out: torch.Tensor, child_logp: torch.Tensor, child_tokens: torch.Tensor, width: int) -> None:
        """out [k, H] head outputs at the frontier; child_logp, child_tokens [k, k]; width: the level's slots."""
        self.parent_hidden = out[self.growth.grow(child_logp, child_tokens, width)]

    def tree(self) -> DraftTree:
        """The kept candidates as a tree, with the n-gram chain merged (EagleDrafter.draft)."""
        sequence, drafter = self.sequence.sequence, self.drafter
        if self.depth < 1:
            return drafter.merge_ngram_chain(root_only_tree(int(sequence[-1]), sequence.device), sequence,
                                             self.max_depth)
        return drafter.tree_from(self.growth, sequence, self.max_depth, self.sequence.plan)


class HeadBatch:
    """The padded head cache of the sequences sharing one head, kept while they stay the same."""

    def __init__(self, head: EagleHead):
        self.head = head
        self.members: list[Sequence] = []
        self.cache: HeadKVCache | None = None  # (B, kvH, W + draft entries, D)
        self.gathers = 0  # how often the batch was (re)built

    def release(self) -> None:
        """Every live member gets its row back as its own cache (1, kvH, c_i, D); the batch empties."""
        for row, sequence in enumerate(self.members):
            if sequence.done:
                continue
            drafter = sequence.drafter
            own = drafter.new_cache()
            if drafter.committed:
                own.load(self.cache.keys[row: row + 1, :, :drafter.committed],
                         self.cache.values[row: row + 1, :, :drafter.committed])
            drafter.adopt_cache(own, drafter.committed)
        self.drop()

    def drop(self) -> None:
        """Forget the batch without handing rows back (its draft failed with every member)."""
        self.members, self.cache = [], None

    def _gather(self, sequences: list[Sequence]) -> None:
        """Members' own caches (1, kvH, c_i (+ frontier), D) -> (B, kvH, W, D), right-padded."""
        drafters = [s.drafter for s in sequences]
        arch, weight = self.head.arch, self.head.fc.weight
        shape = (len(drafters), arch.num_kv_heads, max(d.committed for d in drafters), arch.head_dim)
        keys, values = weight.new_zeros(shape), weight.new_zeros(shape)  # (B, kvH, W, D)
        for row, drafter in enumerate(drafters):
            if drafter.committed:
                keys[row, :, :drafter.committed] = drafter.cache.keys[0, :, :drafter.committed]
                values[row, :, :drafter.committed] = drafter.cache.values[0, :, :drafter.committed]
        self.cache = HeadKVCache()
        self.cache.load(keys, values)
        self.members = list(sequences)
        self.gathers += 1

    @torch.no_grad()
    def draft(self, rows: list[Row]) -> list[DraftTree]:
        """One tree per row (every row's drafter shares self.head), in order."""
        sequences = [row.sequence for row in rows]
        if [id(s) for s in sequences] != [id(m) for m in self.members]:
            self.release()
            self._gather(sequences)
        hidden = self._commit(rows)  # [B, H] predicted feature at each root
        growing = [i for i, row in enumerate(rows) if row.depth >= 1]
        if growing:
            children = self._top_children([hidden[i: i + 1] for i in growing], [rows[i] for i in growing])
            for i, (scores, tokens) in zip(growing, children):
                rows[i].start(hidden[i], scores.flatten(), tokens.flatten())
            self._levels(rows)
        return [row.tree() for row in rows]

    def _forward(self, drafter: EagleDrafter, tokens, features, positions, allowed, from_draft: bool):
        """tokens, positions [B, T], features [B, T, F], allowed [B, T, S] bool -> hidden [B, T, H]."""
        dtype = self.head.dtype  # head.draft_dtype; features come in it, the target's embeddings are cast
        embeds = drafter.target.embed_tokens(tokens).to(dtype)  # [B, T, H]
        cos, sin = drafter.rotary(embeds, positions)  # [B, T, D] each
        mask = additive_mask(allowed, dtype)
        return self.head(embeds, features, cos, sin, self.cache, mask[:, None], from_draft)  # mask [B, 1, T, S]

    def _commit(self, rows: list[Row]) -> torch.Tensor:
        """Step 1: every row's unseen pairs (feature_t, token_{t+1}) in one forward -> hidden [B, H]."""
        drafters = [row.drafter for row in rows]
        pasts = [d.committed for d in drafters]
        counts = [row.sequence.unseen.shape[0] for row in rows]
        width, length = max(pasts), max(counts)
        self.cache.crop(width)  # forget last round's frontier entries
        device = rows[0].sequence.sequence.device
        tokens = torch.zeros(len(rows), length, dtype=torch.long, device=device)  # [B, P]
        unseen = [row.sequence.unseen for row in rows]
        features = unseen[0].new_zeros(len(rows), length, unseen[0].shape[-1], dtype=self.head.dtype)  # [B, P, F]
        steps = torch.arange(length, device=device)
        for i, (row, count) in enumerate(zip(rows, counts)):
            tokens[i, :count] = row.sequence.sequence[row.sequence.sequence.numel() - count:]
            features[i, :count] = unseen[i]
        causal = [causal_mask(count, device) for count in counts]  # row i's new pairs, causally
        allowed = visibility(pasts, causal, length, width + length, width)  # [B, P, W + P]
        positions = torch.tensor(pasts, device=device)[:, None] + steps  # [B, P]
        out = self._forward(drafters[0], tokens, features, positions, allowed, False)  # [B, P, H]
        for i, (drafter, past, count) in enumerate(zip(drafters, pasts, counts)):
            moved = steps[:count] + width  # row i's new entries, moved to [past, past + count)
            move_row_entries((self.cache.keys, self.cache.values), i, moved, past)  # (B, kvH, W + P, D)
            drafter.count_committed(past + count)
        self.cache.crop(max(d.committed for d in drafters))  # (B, kvH, W', D)
        last = torch.tensor([max(count - 1, 0) for count in counts], device=device)
        return out[torch.arange(len(rows), device=device), last]  # [B, H]

    def _levels(self, rows: list[Row]) -> None:
        """Levels 1 .. depth - 1: each one forward over every row's frontier (B x K nodes)."""
        drafter, device = rows[0].drafter, rows[0].sequence.sequence.device
        width = self.cache.length  # W: every row's committed pairs
        slots = max(row.k for row in rows if row.depth >= 1)  # K
        hidden_size = self.head.arch.hidden_size
        for level in range(1, max(row.depth for row in rows)):
            live = [i for i, row in enumerate(rows) if row.depth > level]
            entries = self.cache.length - width  # E: K slots per earlier level
            tokens = torch.zeros(len(rows), slots, dtype=torch.long, device=device)  # [B, K]
            features = self.head.fc.weight.new_zeros(len(rows), slots, hidden_size)  # [B, K, H]
            positions = torch.zeros(len(rows), slots, dtype=torch.long, device=device)  # [B, K]
            pasts, trees = [0] * len(rows), [None] * len(rows)  # a row whose tree is shallower sees only itself
            for i in live:
                row = rows[i]
                tokens[i, :row.k], features[i, :row.k] = row.growth.frontier_tokens, row.parent_hidden
                positions[i] = row.drafter.committed + level - 1
                pasts[i], trees[i] = row.drafter.committed, row.growth.visible(slots)  # [k_i, E + K]
            allowed = visibility(pasts, trees, slots, width + entries + slots, width, width + entries)  # [B, K, W+E+K]
            out = self._forward(drafter, tokens, features, positions, allowed, True)  # [B, K, H]
            outs = [out[i, :rows[i].k] for i in live]  # [k_i, H] each
            for i, hidden, (logp, child_tokens) in zip(live, outs, self._top_children(outs, [rows[i] for i in live])):
                rows[i].grow(hidden, logp, child_tokens, slots)

    def _top_children(self, hidden: list[torch.Tensor], rows: list[Row]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """hidden: [n_i, H] per row -> per row (log-probs [n_i, k_i], target ids [n_i, k_i]) of each node's
        top-k_i (what EagleDrafter.runner returns for one sequence; draft logits for all rows at once)."""
        drafter = rows[0].drafter
        logits = self.head.draft_logits(torch.cat(hidden), drafter.lm_weight)  # [sum n_i, Vd]
        logp = logits.float().log_softmax(-1).split([h.shape[0] for h in hidden])
        picked = []
        for row_logp, row in zip(logp, rows):
            top = row_logp.topk(row.k, dim=-1)
            picked.append((top.values, self.head.draft_to_target[top.indices]))
        return picked


class BatchDrafter:
    """Drafts a round's trees: rows sharing a head together (one HeadBatch per head), the rest alone."""

    def __init__(self):
        self.batches: dict[int, HeadBatch] = {}  # id(head) -> its padded cache (empty while unused)

    @property
    def gathers(self) -> int:
        """How often a head batch was (re)built: once per change of its membership."""
        return sum(batch.gathers for batch in self.batches.values())

    def release(self) -> None:
        """Every member drafts alone from now on (batch 1)."""
        for batch in self.batches.values():
            batch.release()

    @torch.no_grad()
    def draft(self, sequences: list[Sequence], plain: list[bool] | None = None) -> list[Exception | None]:
        """Set every sequence's tree for this round (plain: per sequence, whether it decodes plainly this round;
        None: each drafts its own); -> per sequence None, or the exception that failed it (a failed batched draft
        fails every row in it)."""
        plain = plain if plain is not None else [False] * len(sequences)
        errors: list[Exception | None] = [None] * len(sequences)
        alone: list[tuple[int, int]] = []  # (index, max_depth) of rows drafting on their own
        groups: dict[int, list[tuple[int, int]]] = {}  # id(head) -> rows sharing it
        for index, (sequence, plain_row) in enumerate(zip(sequences, plain)):
            try:
                max_depth = sequence.prepare_draft(plain_row)
                if max_depth is not None:
                    batched = runs_head(sequence) and not sequence.samples_drafts
                    group = groups.setdefault(id(sequence.drafter.head), []) if batched else alone
                    group.append((index, max_depth))
            except Exception as exc:  # noqa: BLE001 - one sequence's failure fails that sequence
                errors[index] = exc
        for key in list(groups):
            if len(groups[key]) < 2:  # alone with its head: the batch-1 path
                alone += groups.pop(key)
        for key in list(self.batches):  # a batch whose rows changed hands them back before anyone drafts
            members = [id(sequences[i]) for i, _ in groups.get(key, [])]
            if members != [id(m) for m in self.batches[key].members]:
                self.batches[key].release()
        for index, max_depth in alone:
            sequence = sequences[index]
            try:
                sequence.set_tree(sequence.drafter.draft(sequence.sequence, sequence.unseen, max_depth,
                                                         **sequence.draft_arguments))
            except Exception as exc:  # noqa: BLE001
                errors[index] = exc
        for key, rows in groups.items():
            batch = self.batches.setdefault(key, HeadBatch(sequences[rows[0][0]].drafter.head))
            try:
                trees = batch.draft([Row(sequences[i], max_depth) for i, max_depth in rows])
            except Exception as exc:  # noqa: BLE001 - a failed batched draft fails its rows, as a failed forward does
                batch.drop()
                for index, _ in rows:
                    errors[index] = exc
                continue
            for (index, _), tree in zip(rows, trees):
                sequences[index].set_tree(tree)
        return errors
