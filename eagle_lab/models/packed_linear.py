"""Linear layers over weights prepacked for a few-row GEMM (CPU, float32, MKL).

A tree forward multiplies 4-16 rows by every weight. Unpacked, MKL's sgemm repacks the whole weight
on each call for more than one row, so on a 2-core Xeon the 210 decoder linears of SmolLM2 plus its
LM head cost 1.75x a 1-row pass at 4 rows and 2.35x at 8 (one thread: 41.6 ms at 1 row, 72.9 / 97.8 ms
at 4 / 8). With the weight packed once per row count (`cblas_sgemm_pack`, PyTorch's
`mkl._mkl_reorder_linear_weight`), the same passes cost 50.5 / 60.7 ms: 1.2x and 1.45x. That flatter
curve is what makes a draft tree pay for itself on CPU.

A pack holds a copy of the weight laid out for one row count, so it is made only for the row counts
of the static step buckets (4, 8, 16 tokens), lazily, the first time a forward of that size runs;
other sizes and single rows run the plain linear. Packs live on the weight tensor itself and are
remade when the weight changes in place. The kernel is reached through a custom op so that compiled
packages call it as it is, with the module's own weight bound at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_PACKS = "_eagle_lab_packs"  # attribute of a weight tensor: {rows: (weight version, packed weight)}


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed float32 GEMMs exist here (PyTorch built with MKL, CPU, float32)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()


def _packed(weight: torch.Tensor, rows: int) -> torch.Tensor:
    packs = weight.__dict__.setdefault(_PACKS, {})
    version, pack = packs.get(rows, (None, None))
    if version != weight._version:
        pack = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)
        packs[rows] = (weight._version, pack)
    return pack


_LIBRARY = torch.library.Library("eagle_lab", "FRAGMENT")  # noqa: the op lives as long as the module
_LIBRARY.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] (rows = all leading dims together) @ weight [N, K].T + bias -> [..., N], through the pack made
    for that many rows. A plain library kernel rather than `torch.library.custom_op`, whose Python wrapper
    doubles the cost of a call (about 10 us more, 211 calls a forward)."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1]).contiguous()  # [rows, K]
    out = torch.ops.mkl._mkl_linear(flat, _packed(weight, rows), weight, bias, rows)  # [rows, N]
    return out.view(*x.shape[:-1], weight.shape[0])


_LIBRARY.impl("packed_linear", _packed_linear, "CPU")


@torch.library.register_fake("eagle_lab::packed_linear")
def _packed_linear_shape(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.eagle_lab.packed_linear(x, weight, bias)


class PackedLinear(nn.Linear):
    """An nn.Linear (same parameters, same state dict) whose forwards over `pack_rows` rows use packed weights."""

    pack_rows: frozenset[int]

    @classmethod
    def wrap(cls, linear: nn.Linear, pack_rows: frozenset[int]) -> "PackedLinear":
        packed = cls.__new__(cls)
        packed.__dict__.update(linear.__dict__)  # the same Parameter objects: ties and optimiser state hold
        packed.pack_rows = pack_rows
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows in self.pack_rows:
            return packed_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module, pack_rows: set[int]) -> int:
    """Make every nn.Linear of `model` (decoder layers and LM head) a PackedLinear for `pack_rows` row counts, in
    place; returns how many. Rows of one are never packed (MKL's matrix-vector kernel reads the weight once)."""
    rows = frozenset(r for r in pack_rows if r > 1)
    replaced = 0
    for name, child in list(model.named_modules()):
        if type(child) is nn.Linear:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, PackedLinear.wrap(child, rows))
            replaced += 1
        elif isinstance(child, PackedLinear):
            child.pack_rows = child.pack_rows | rows
    return replaced
