"""What attention costs per layer on this CPU, by query rows and attended length: eagle_lab's row-stable kernel
against torch's SDPA (grouped heads read in place), the shapes of SmolLM2-135M (9 query heads over 3 key/value
heads of 64), a masked step or tree as decoding runs it:
python -m eagle_lab.benchmark.attention_rows [rows=1,4,8,16] [lengths=256,1024,2048]

The row-stable kernel gives each query bitwise the same output whatever the rows beside it and the masked keys
after it (eagle_lab/models/kernels/stable_attention.cpp); SDPA is what it replaced. Microseconds per call,
median of 9 passes of 50 calls.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
import torch.nn.functional as F

from eagle_lab.errors import key_values
from eagle_lab.models.attention import load_attention_kernel
from eagle_lab.tree_search.costs import timed

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
CALLS = 50


def main(argv: list[str]) -> None:
    args = key_values("attention_rows", argv, ("rows", "lengths"))
    try:
        row_counts = [int(r) for r in args.get("rows", "1,4,8,16").split(",")]
        lengths = [int(n) for n in args.get("lengths", "256,1024,2048").split(",")]
    except ValueError as err:
        raise SystemExit(f"attention_rows: {err}") from None
    load_attention_kernel()
    stable = torch.ops.eagle_lab_attention.stable_attention
    print(f"us per call (one layer), {torch.get_num_threads()} threads")
    print("| attended length | kernel | " + " | ".join(f"{r} rows" for r in row_counts) + " |")
    print("|---:|---|" + "---:|" * len(row_counts))
    for length in lengths:
        cells = {"row-stable": [], "sdpa": []}
        for rows in row_counts:
            query = torch.randn(1, HEADS, rows, HEAD_DIM)  # [B, H, T, D]
            key, value = torch.randn(1, KV_HEADS, length, HEAD_DIM), torch.randn(1, KV_HEADS, length, HEAD_DIM)
            allowed = torch.ones(1, 1, rows, length, dtype=torch.bool)
            allowed[..., length - rows + 1:] = torch.ones(rows, rows - 1, dtype=torch.bool).tril(-1)  # causal tail
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
            runs = {"row-stable": partial(stable, query, key, value, mask, HEAD_DIM ** -0.5),
                    "sdpa": partial(F.scaled_dot_product_attention, query, key, value, attn_mask=mask,
                                    enable_gqa=True)}
            for name, run in runs.items():
                run()
                ms = timed(lambda run=run: [run() for _ in range(CALLS)], reps=9)
                cells[name].append(f"{1000 * ms / CALLS:.0f}")
        for name, values in cells.items():
            print(f"| {length} | {name} | " + " | ".join(values) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
