"""Weight-only quantized linear layers for a CPU target (`target.weights=int8|int4`).

The decoder's linear layers keep their weights in 8 or 4 bits and run PyTorch's packed kernels
(`aten._weight_int8pack_mm`: int8 per output channel; `aten._weight_int4pack_mm_for_cpu`: 4-bit in
groups of 32 with a scale and a minimum each, the layout of GGUF's Q4_1). Activations enter those
kernels in bf16, which is where the kernels are fast (with fp32 activations both are 2-15x slower
than fp32 MKL), and the result returns to the model's dtype; norms, attention, residuals, the
embeddings and the LM head stay in fp32.

Lossless is against plain decoding of the same quantized target: both kernels compute every row on
its own (a forward over N tokens gives each row bitwise what N one-token forwards give; tested), so
a tree forward scores what single steps would, up to the fp32 rounding elsewhere in the model.

4-bit groups are fitted by their minimum and maximum: on weights that were dequantized from Q4_1
(the embedded SmolLM2), that recovers the GGUF's own grid, up to the bf16 rounding of each group's
scale and minimum.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from eagle_lab.errors import EagleLabError

log = logging.getLogger(__name__)
WEIGHTS = ("fp32", "int8", "int4")
GROUP = 32  # 4-bit weights per scale and minimum (GGUF Q4_1)
INNER_K_TILES = 2  # the CPU int4 packing's tile parameter
KERNEL_DTYPE = torch.bfloat16  # activations, scales and minimums as the kernels take them


@torch.library.custom_op("eagle_lab::int4_matmul", mutates_args=())
def int4_matmul(rows: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group: int) -> torch.Tensor:
    """rows [M, K] bf16 @ the packed 4-bit weight -> [M, N] bf16. An op of its own so that compiled graphs call
    the kernel as it is: inductor's own lowering turns the group size into a tensor constant per layer, which a
    package bound to the module's weights at load time would lack."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, group, scale_zero)


@int4_matmul.register_fake
def _int4_matmul_shape(rows, packed, scale_zero, group):
    return rows.new_empty(rows.shape[0], scale_zero.shape[1])


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + bias, q int8 per output channel [N, K]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()  # [N, K]
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)  # [N]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(KERNEL_DTYPE))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)  # [M, K]
        out = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scale).to(x.dtype)  # [M, N]
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def dequantized(self) -> torch.Tensor:
        """[N, K] fp32: the weight these kernels multiply by."""
        return self.qweight.float() * self.scale.float()[:, None]


class Int4Linear(nn.Module):
    """y = x @ W.T + bias with W = scale * q + minimum per group of 32 along K, q in [0, 15]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()  # [N, K]
        n, k = weight.shape
        if k % GROUP:
            raise EagleLabError(f"int4 weights need in_features divisible by {GROUP}, got {k}")
        groups = weight.view(n, k // GROUP, GROUP)  # [N, G, 32]
        low, high = groups.amin(-1), groups.amax(-1)  # [N, G]
        scale = ((high - low) / 15).clamp(min=1e-12)
        # the kernel's scales and minimums are bf16: quantize against the rounded values it will use
        scale_k, low_k = scale.to(KERNEL_DTYPE), low.to(KERNEL_DTYPE)
        q = ((groups - low_k.float()[..., None]) / scale_k.float()[..., None]).round().clamp(0, 15)
        q = q.to(torch.int32).view(n, k)
        self.in_features, self.out_features = k, n
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES))
        # the kernel computes (q - 8) * scale + zero: zero = minimum + 8 * scale  [G, N, 2]
        zero = (low_k.float() + 8 * scale_k.float()).to(KERNEL_DTYPE)
        self.register_buffer("scale_zero", torch.stack([scale_k.t(), zero.t()], dim=-1).contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)  # [M, K]
        out = int4_matmul(rows, self.packed, self.scale_zero, GROUP)  # [M, N]
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def dequantized(self) -> torch.Tensor:
        """[N, K] fp32: the weight this kernel multiplies by (through an identity input)."""
        eye = torch.eye(self.in_features, dtype=KERNEL_DTYPE, device=self.packed.device)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scale_zero).float().t()


def quantize_decoder(model: nn.Module, weights: str) -> int:
    """Replace every linear layer of the decoder layers in place (embeddings and the LM head stay); returns
    how many were replaced. weights: fp32 (nothing changes) | int8 | int4."""
    if weights not in WEIGHTS:
        raise EagleLabError(f"target.weights must be one of {', '.join(WEIGHTS)}, got '{weights}'")
    if weights == "fp32":
        return 0
    device = next(model.parameters()).device
    if device.type != "cpu" or next(model.parameters()).dtype != torch.float32:
        raise EagleLabError(f"target.weights={weights} runs on CPU over an fp32 model (target.device=cpu "
                            "target.dtype=float32)")
    layer_class = Int8Linear if weights == "int8" else Int4Linear
    layers = model.get_decoder().layers
    replaced = 0
    for layer in layers:
        for name, child in list(layer.named_modules()):
            if not isinstance(child, nn.Linear):
                continue
            parent = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
            setattr(parent, name.rsplit(".", 1)[-1], layer_class(child))
            replaced += 1
    return replaced
