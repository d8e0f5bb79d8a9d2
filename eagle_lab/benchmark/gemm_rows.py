"""What the target's linear layers cost per forward, by rows (tokens scored) and dtype, on this CPU:
python -m eagle_lab.benchmark.gemm_rows [dtypes=float32,bfloat16] [rows=1,4,8,16] [layers=30] [compile=true]

A stack of SmolLM2-135M's decoder linear shapes (7 per layer), eager and compiled with the same
inductor settings as the decoding core (C++ GEMM template over frozen weights). The curve says
how many tree tokens a forward can score for the price of one, which is what `tree=auto` then
finds for the whole target: on an AMX CPU, bf16 rows up to 16 cost no more than one, while fp32
cost grows with the rows.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from eagle_lab.benchmark.tool_args import key_values
from eagle_lab.decoding.compiled import CPU_OPTIONS, inductor_cache_dir, inductor_settings
from eagle_lab.models.device import resolve_dtype
from eagle_lab.errors import EagleLabError
from eagle_lab.tree_search.costs import timed

SHAPES = [(576, 576)] * 2 + [(192, 576)] * 2 + [(1536, 576)] * 2 + [(576, 1536)]  # (out, in): q o k v gate up down


class LinearStack(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(k, n, bias=False) for _ in range(layers) for n, k in SHAPES)

    def forward(self, x_hidden: torch.Tensor, x_mlp: torch.Tensor) -> list[torch.Tensor]:
        """x_hidden: [M, 576], x_mlp: [M, 1536] -> one [M, out] per layer."""
        return [lin(x_mlp if lin.in_features == 1536 else x_hidden) for lin in self.linears]


@torch.no_grad()
def measure(dtype: torch.dtype, rows: int, layers: int, compile: bool) -> tuple[float, float | None]:
    """-> (eager ms, compiled ms or None) for one pass over the stack with `rows` rows."""
    stack = LinearStack(layers).eval().to(dtype)
    x_hidden, x_mlp = torch.randn(rows, 576, dtype=dtype), torch.randn(rows, 1536, dtype=dtype)
    eager = timed(lambda: stack(x_hidden, x_mlp), reps=9)
    if not compile:
        return eager, None
    torch._dynamo.reset()
    inductor_cache_dir()
    with inductor_settings(CPU_OPTIONS):
        compiled = torch.compile(stack, dynamic=False)
        compiled(x_hidden, x_mlp)
        return eager, timed(lambda: compiled(x_hidden, x_mlp), reps=9)


def main(argv: list[str]) -> None:
    args = key_values("gemm_rows", argv, ("dtypes", "rows", "layers", "compile"))
    try:
        cpu = torch.device("cpu")
        dtypes = [resolve_dtype(name, cpu) for name in args.get("dtypes", "float32,bfloat16").split(",")]
        row_counts = [int(r) for r in args.get("rows", "1,4,8,16").split(",")]
        layers = int(args.get("layers", 30))
        compile = args.get("compile", "true") == "true"
    except (ValueError, EagleLabError) as err:
        raise SystemExit(f"gemm_rows: {err}") from None
    print(f"| dtype | rows | eager ms | compiled ms | ({layers} layers x {len(SHAPES)} linears, "
          f"{torch.get_num_threads()} threads)")
    print("|---|---:|---:|---:|")
    for dtype in dtypes:
        for rows in row_counts:
            eager, compiled = measure(dtype, rows, layers, compile)
            shown = "-" if compiled is None else f"{compiled:.1f}"
            print(f"| {str(dtype).removeprefix('torch.')} | {rows} | {eager:.1f} | {shown} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
