"""What the target's linear layers cost per forward, by rows (tokens scored) and weight storage, on this CPU:
python -m eagle_lab.benchmark.gemm_rows [kernels=torch,f32,bf16,q8_0,q4_1,q8_0x8,q4_1x8] [rows=1,2,4,8,16] [layers=30]

A stack of SmolLM2-135M's linear shapes (7 per decoder layer, then the 49,152 x 576 LM head) with random
weights: `torch` is F.linear in float32 (MKL), the others eagle_lab's row-stable kernel over each storage
(eagle_lab/models/stable_linear.py). The curve says how many tree tokens a forward can score for the
price of one, which is what `tree=auto` then finds for the whole target.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from eagle_lab.errors import EagleLabError, key_values
from eagle_lab.models.stable_linear import StableLinear
from eagle_lab.tree_search.costs import timed

SHAPES = [(576, 576)] * 2 + [(192, 576)] * 2 + [(1536, 576)] * 2 + [(576, 1536)]  # (out, in): q o k v gate up down
LM_HEAD = (49152, 576)
KERNELS = ("torch", "f32", "bf16", "q8_0", "q4_1", "q8_0x8", "q4_1x8")


def linear_stack(layers: int, kernel: str) -> nn.ModuleList:
    torch.manual_seed(0)
    stack = []
    for n, k in [shape for _ in range(layers) for shape in SHAPES] + [LM_HEAD]:
        dense = nn.Linear(k, n, bias=False)
        nn.init.normal_(dense.weight, std=0.02)
        stack.append(dense if kernel == "torch" else StableLinear(dense, kernel))
    return nn.ModuleList(stack)


@torch.no_grad()
def measure(stack: nn.ModuleList, rows: int) -> float:
    """ms for one pass over the stack with `rows` rows (median of 9)."""
    inputs = {576: torch.randn(rows, 576), 1536: torch.randn(rows, 1536)}
    return timed(lambda: [linear(inputs[linear.in_features]) for linear in stack], reps=9)


def main(argv: list[str]) -> None:
    args = key_values("gemm_rows", argv, ("kernels", "rows", "layers"))
    try:
        kernels = args.get("kernels", ",".join(KERNELS)).split(",")
        unknown = [k for k in kernels if k not in KERNELS]
        if unknown:
            raise EagleLabError(f"unknown kernel {unknown[0]} (choose from {', '.join(KERNELS)})")
        row_counts = [int(r) for r in args.get("rows", "1,2,4,8,16").split(",")]
        layers = int(args.get("layers", 30))
    except (ValueError, EagleLabError) as err:
        raise SystemExit(f"gemm_rows: {err}") from None
    print(f"ms per pass over {layers} layers x {len(SHAPES)} linears + the LM head, {torch.get_num_threads()} threads")
    print("| kernel | " + " | ".join(f"{r} rows" for r in row_counts) + " |")
    print("|---|" + "---:|" * len(row_counts))
    for kernel in kernels:
        stack = linear_stack(layers, kernel)
        print(f"| {kernel} | " + " | ".join(f"{measure(stack, r):.1f}" for r in row_counts) + " |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
