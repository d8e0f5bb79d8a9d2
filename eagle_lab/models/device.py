"""Device and dtype choice (`auto` means CUDA when present, else CPU), and timing work on a device."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from eagle_lab.errors import EagleLabError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise EagleLabError(f"unknown device '{name}' (use auto, cpu, cuda, cuda:N)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EagleLabError(f"device '{name}' asked for but CUDA is not available here")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on CUDA (what large targets are trained in), fp32 on CPU (exact, fast)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise EagleLabError(f"unknown dtype '{name}' (use auto, {', '.join(sorted(_DTYPES))})")
    return _DTYPES[name]


def cpu_has_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls natively here (AVX512-BF16/AMX); emulated bf16 is slower."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def drafting_dtype(choice: str, target_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """head.draft_dtype: "auto" is bf16 beside an fp32 target on a CPU with native bf16 matmuls (a head
    step reads half the bytes, and drafting is memory-bound), else the
    target's dtype; a dtype name is taken as it is."""
    if choice == "auto":
        native = device.type == "cpu" and target_dtype == torch.float32 and cpu_has_bf16()
        return torch.bfloat16 if native else target_dtype
    if choice not in _DTYPES:
        raise EagleLabError(f"head.draft_dtype must be auto or a dtype ({', '.join(sorted(_DTYPES))}), got '{choice}'")
    return _DTYPES[choice]


def training_dtype(choice: str, target) -> str:
    """The target's dtype while training (trainer.capture_dtype; target: a TargetConfig).
    "target" keeps target.dtype; "auto" picks bf16 where its matmuls are native (CUDA, AMX CPUs:
    a faster capture than fp32, with a relative feature error below the feature noise the loss adds),
    unless target.dtype is set explicitly. Serving keeps target.dtype."""
    if choice == "target":
        return target.dtype
    if choice in _DTYPES:
        return choice
    if choice != "auto":
        raise EagleLabError(f"trainer.capture_dtype must be target, auto or a dtype "
                            f"({', '.join(sorted(_DTYPES))}), got '{choice}'")
    if target.dtype != "auto":
        return target.dtype
    native = resolve_device(target.device).type == "cuda" or cpu_has_bf16()
    return "bfloat16" if native else "auto"


_CPU_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16",
              "amx_int8", "fma", "f16c")


def cpu_flags() -> frozenset[str]:
    """Every instruction-set flag /proc/cpuinfo lists (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def integer_dot_products() -> bool:
    """Whether this CPU runs the row-stable kernel's int8-activation formats (w4a8, w8a8) fast: AVX512-VNNI's
    vpdpbusd, or AVX2's vpmaddubsw (AVX-512 without VNNI has it too). Every instruction set computes the same
    integer sums; without either they run in plain vector code (the same bits, slower than the float formats)."""
    return "avx2" in cpu_flags() or "avx512_vnni" in cpu_flags()


def cpu_features() -> str:
    """The instruction sets generated code may use here (inductor compiles for the host's ISA)."""
    present = [flag for flag in _CPU_FLAGS if flag in cpu_flags()]
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{platform.machine()}:{capability}:{'+'.join(present)}"


def timed_call(fn: Callable[[], Any], device: torch.device | None = None) -> tuple[Any, float]:
    """(fn(), its wall seconds), queued GPU work waited for before and after (device None: any CUDA device
    present), so that the interval holds what it times. The one timer: every other timing goes through it."""
    cuda = torch.cuda.is_available() if device is None else device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if cuda:
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


def median_ms(fn: Callable[[], Any], reps: int = 3, before: Callable[[], Any] | None = None, warmup: int = 0,
              device: torch.device | None = None) -> float:
    """Median ms of `reps` calls of fn, after `warmup` untimed ones; before() runs untimed ahead of each call
    (rewinding a cache a call writes into)."""
    times = []
    for index in range(warmup + reps):
        if before is not None:
            before()
        _, seconds = timed_call(fn, device)
        if index >= warmup:
            times.append(1000 * seconds)
    return statistics.median(times)
