"""Two versions of the row-stable linear kernel side by side, in one process:
python -m eagle_lab.benchmark.kernel_ab [against=GIT_REV|FILE.cpp] [march=native] [kernels=q4_1x8,q8_0x8]
    [rows=1,2,4,8] [layers=30] [passes=25]

`against` (default HEAD) is built under an op namespace of its own (models/native.load_variant) beside the working
tree's kernel, and the two run the target's linear stack (benchmark/gemm_rows.py) in turns, pass after pass, so that
a drift in the machine's speed falls on both alike: on a small shared VM separate processes drift by more than
the effects measured.
`march` builds `against` for another instruction set (`x86-64-v3`: AVX2 and FMA; `x86-64-v4`: AVX-512 without
VNNI): against=WORKTREE's own file then times the code an older CPU runs, on this one, and checks that it computes
bitwise what this CPU's code does.
Before timing, each layer's outputs must be bitwise equal between the two (a kernel change that moves a result
is a numerics change, not a speed-up). Prints the median ms per pass and the ratio working tree / against.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from eagle_lab.benchmark.gemm_rows import KERNELS, SHAPES, linear_stack
from eagle_lab.errors import EagleLabError, key_values
from eagle_lab.models.native import NATIVE, SOURCE_DIR, load_variant
from eagle_lab.models.stable_linear import load_kernels


def source_of(against: str) -> str:
    """The kernel's source at a git revision of this checkout, or in a file."""
    if against.endswith(".cpp"):
        path = Path(against).expanduser()
        if not path.is_file():
            raise EagleLabError(f"no such file {path}")
        return path.read_text()
    relative = (SOURCE_DIR / "stable_linear.cpp").relative_to(SOURCE_DIR.parents[2])
    try:
        done = subprocess.run(["git", "show", f"{against}:{relative.as_posix()}"], cwd=SOURCE_DIR,
                              capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise EagleLabError(f"cannot read '{against}': no git on PATH (give a .cpp file instead)") from None
    if done.returncode != 0:
        raise EagleLabError(f"cannot read {relative} at '{against}' (a git revision of this checkout, or a .cpp "
                            f"file): {done.stderr.strip()}")
    return done.stdout


@torch.no_grad()
def compare(ours, theirs, kernel: str, rows: int, layers: int, passes: int) -> tuple[float, float]:
    """-> median ms per pass over the stack with `rows` rows: (working tree, against)."""
    stack = linear_stack(layers, kernel)
    inputs = {576: torch.randn(rows, 576), 1536: torch.randn(rows, 1536)}
    for layer in stack:
        x = inputs[layer.in_features]
        if not torch.equal(layer.run(ours, x), layer.run(theirs, x)):
            raise EagleLabError(f"{kernel}, {rows} rows: the two kernels' outputs differ; not a like-for-like timing")
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for _ in range(passes):
        for name, ops in (("ours", ours), ("theirs", theirs)):
            start = time.perf_counter()
            for layer in stack:
                layer.run(ops, inputs[layer.in_features])
            times[name].append(1000 * (time.perf_counter() - start))
    return statistics.median(times["ours"]), statistics.median(times["theirs"])


def main(argv: list[str]) -> None:
    args = key_values("kernel_ab", argv, ("against", "march", "kernels", "rows", "layers", "passes"))
    try:
        kernels = args.get("kernels", "q4_1x8,q8_0x8").split(",")
        unknown = [k for k in kernels if k not in KERNELS or k == "torch"]
        if unknown:
            raise EagleLabError(f"unknown kernel {unknown[0]} (choose from {', '.join(KERNELS[1:])})")
        row_counts = [int(r) for r in args.get("rows", "1,2,4,8").split(",")]
        layers, passes = int(args.get("layers", 30)), int(args.get("passes", 25))
        against, march = args.get("against", "HEAD"), args.get("march", NATIVE)
        load_kernels()
        ours, theirs = torch.ops.eagle_lab_kernels, load_variant("stable_linear", source_of(against), march)
        print(f"ms per pass over {layers} layers x {len(SHAPES)} linears + the LM head, "
              f"{torch.get_num_threads()} threads, {passes} passes in turns; working tree against {against} "
              f"(-march={march})")
        print("| kernel | rows | working tree | against | ratio |")
        print("|---|---:|---:|---:|---:|")
        for kernel in kernels:
            for rows in row_counts:
                mine, other = compare(ours, theirs, kernel, rows, layers, passes)
                print(f"| {kernel} | {rows} | {mine:.2f} | {other:.2f} | {mine / other:.3f} |", flush=True)
    except (ValueError, EagleLabError) as err:
        raise SystemExit(f"kernel_ab: {err}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
