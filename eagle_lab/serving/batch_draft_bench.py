"""Micro-benchmark: one round's drafting, batched (batch_draft.BatchDrafter) against per sequence.

  python -m eagle_lab.serving.batch_draft_bench [target] [past]

For B = 1, 2, 4, 8 sequences of about `past` committed tokens (ragged by a few), it times the
drafting of a round for all B: each sequence's own drafter one after another (what the server
does with batched drafting off), then one batched call (the padded head cache gathered once, in
the warm-up). Each timed round feeds the head one new pair per row, as a round that accepts
nothing would; the target is not run between rounds (drafting alone is measured). Not a test:
slow on a busy CPU.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from eagle_lab.builders import packaged_head_dir
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.decoding.generate import Stopper
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.eagle.layouts import load_head
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.serving.batch_draft import BatchDrafter
from eagle_lab.serving.drafters import fork_eagle
from eagle_lab.serving.sequence import Sequence
from eagle_lab.models.target import Target, TargetConfig, load_target


def _next_round(sequences: list[Sequence], features: list[torch.Tensor]) -> None:
    """After drafting: commit the root's first child (or the root) and one unseen feature per row."""
    for sequence, feature in zip(sequences, features):
        token = sequence.tree.tokens[min(1, sequence.tree.size - 1)]
        sequence.sequence = torch.cat([sequence.sequence, token[None]])
        sequence.unseen, sequence.tree = feature, None  # (1, F)


@torch.no_grad()
def time_drafting(target: Target, prototype: EagleDrafter, batches=(1, 2, 4, 8), past: int = 128,
                  reps: int = 3) -> dict[int, dict[str, float]]:
    """batch size -> {"alone_ms", "batched_ms"}: median ms of one round's drafting for all rows."""
    g = torch.Generator().manual_seed(0)
    results = {}
    for batch in batches:
        sequences = []
        for row in range(batch):
            prompt = torch.randint(0, target.vocab_size, (past + 3 * row,), generator=g).to(target.device)
            sequence = Sequence(target, fork_eagle(prototype), prompt, SamplingParams(),
                                Stopper(target.tokenizer, 10 ** 6, set()), None)
            sequence.prefill()
            sequences.append(sequence)
        features = [s.unseen[-1:].clone() for s in sequences]  # (1, F) each
        for s in sequences:  # fill the heads' caches with the prompts (not timed)
            s.draft()
        _next_round(sequences, features)
        times: dict[str, list[float]] = {"alone_ms": [], "batched_ms": []}
        drafting = BatchDrafter()
        for name in times:
            for _ in range(reps + 1):  # the first is a warm-up (and, batched, the gather)
                start = time.perf_counter()
                if name == "batched_ms" and batch > 1:
                    drafting.draft(sequences)
                else:
                    for s in sequences:
                        s.draft()
                times[name].append(1000 * (time.perf_counter() - start))
                _next_round(sequences, features)
        drafting.release()
        results[batch] = {name: statistics.median(values[1:]) for name, values in times.items()}
    return results


if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else "smollm2_135m"
    loaded = load_target(TargetConfig(name=name, source="tiny" if "tiny" in name else "embedded"))
    packaged = packaged_head_dir(loaded.name)
    head = load_head(packaged, loaded) if packaged else new_head(loaded)
    drafter = EagleDrafter(head, loaded, TreeShape(4, 4, 12))  # tree=cpu
    for size, row in time_drafting(loaded, drafter, past=int(sys.argv[2]) if len(sys.argv) > 2 else 128).items():
        print(f"batch {size}: drafting a round {row['alone_ms']:.1f} ms per sequence, {row['batched_ms']:.1f} ms "
              f"batched ({row['alone_ms'] / row['batched_ms']:.2f}x)", flush=True)
