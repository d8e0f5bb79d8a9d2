"""A llama.cpp GGUF file as the target (`target.path=FILE.gguf`), each linear layer at its own precision.

transformers reads the file's config, tokenizer and weights (dequantized to float32). Then each linear layer
goes to the row-stable kernel (stable_linear.py: a forward over N tokens gives every token bitwise what a
one-token forward gives, so tree verification stays lossless) at the precision its GGUF tensor has, its
blocks taken from the file rather than fitted again:
  Q8_0        -> q8_0 (q8_0x8 with int8 activations): each block's float16 scale and 32 int8 values
  Q4_1        -> q4_1 (q4_1x8): each block's float16 scale and minimum and 32 nibbles
  Q4_0        -> q4_1 (q4_1x8) with minimum -8 * scale: d * (q - 8) is q * d + (-8 * d), exactly
  BF16        -> bf16; F32 and F16 -> f32 (exact)
  other types -> f32, their values dequantized (Q5_0, Q4_K, Q5_K, Q6_K, ...: the kernel has no storage of
                 that type), named in one log line per load
Every block layer is checked against the float weight transformers loaded, so a name or row order taken
wrongly cannot pass: llama.cpp stores llama-family q and k rows interleaved per head, which transformers
undoes; the blocks run along K (the input dim), so the same row permutation moves whole rows of blocks.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from eagle_lab.errors import EagleLabError

log = logging.getLogger(__name__)
FILE_WEIGHTS = ("gguf", "gguf_a8")  # target.weights: the file's own types (gguf_a8: int8 activations)
STORAGE = {"gguf": {"Q8_0": "q8_0", "Q4_1": "q4_1", "Q4_0": "q4_1"},
           "gguf_a8": {"Q8_0": "q8_0x8", "Q4_1": "q4_1x8", "Q4_0": "q4_1x8"}}
FLOAT_STORAGE = {"F32": "f32", "F16": "f32", "BF16": "bf16"}  # exact: no rounding beyond the file's


def is_gguf_path(path: str) -> bool:
    """Whether target.path names a GGUF file (a *.gguf name, or any file) rather than a model directory."""
    local = Path(path).expanduser()
    return path.endswith(".gguf") or local.is_file()


def load_gguf(path: str, dtype: torch.dtype, attn_implementation: str):
    """(model, tokenizer) from a GGUF file through transformers, its weights dequantized to `dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    file = Path(path).expanduser()
    if not file.is_file():
        raise EagleLabError(f"target path '{path}' does not exist (a GGUF file was asked for)")
    with file.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise EagleLabError(f"target path '{path}' is not a GGUF file (no GGUF magic at its start)")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            file.parent, gguf_file=file.name, dtype=dtype, attn_implementation=attn_implementation,
            quantization_config=GgufConfig(dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except (OSError, ValueError, KeyError, NotImplementedError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EagleLabError(f"could not load GGUF target '{path}': {first_line}") from exc
    return model, tokenizer


def file_layers(model: nn.Module, path: str, weights: str) -> dict[nn.Linear, tuple[str, tuple | None]]:
    """Each nn.Linear of `model` (loaded from `path`) -> (storage, groups or None) for convert_linears: the
    blocks of its GGUF tensor where the kernel has a storage of that type, else the float weight as loaded."""
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    names = gguf.get_tensor_name_map(_architecture(reader), model.config.num_hidden_layers)
    embedding = model.get_input_embeddings()
    embedding_name = next(name for name, module in model.named_modules() if module is embedding)
    heads = {model.config.num_attention_heads, getattr(model.config, "num_key_value_heads", None) or 0} - {0}
    layers, seen = {}, Counter()
    for module_name, linear in model.named_modules():
        if type(linear) is not nn.Linear:
            continue
        if linear.weight is embedding.weight:  # an LM head tied to the token embedding
            module_name = embedding_name
        tensor = tensors.get(f"{names.get_name(module_name) or module_name}.weight")
        kind = "no tensor" if tensor is None else tensor.tensor_type.name
        layers[linear] = _storage(tensor, kind, linear.weight.detach(), weights, heads)
        exact = layers[linear][1] is not None or kind in FLOAT_STORAGE
        seen[f"{kind} -> {layers[linear][0]}" + ("" if exact else " (dequantized)")] += 1
    note = "; a dequantized type has no row-stable kernel of its own" if any("(" in what for what in seen) else ""
    log.info("GGUF target's linear layers: %s%s", ", ".join(f"{n} {what}" for what, n in sorted(seen.items())), note)
    return layers


def _architecture(reader):
    import gguf

    field = reader.fields["general.architecture"]
    name = bytes(field.parts[field.data[0]]).decode()
    arch = {value: key for key, value in gguf.MODEL_ARCH_NAMES.items()}.get(name)
    if arch is None:
        raise EagleLabError(f"GGUF architecture '{name}' is unknown to the gguf package")
    return arch


def _storage(tensor, kind: str, weight: torch.Tensor, weights: str, heads: set[int]):
    """(storage, groups or None) for one layer whose model weight is `weight` [N, K]."""
    if kind in FLOAT_STORAGE:
        return FLOAT_STORAGE[kind], None
    if kind not in STORAGE[weights]:
        return "f32", None
    groups = _blocks(tensor, kind)  # rows in the file's order
    first = _values(tuple(part[:, :1] for part in groups))  # [N, 32]: each row's first block, to try orders cheaply
    for order in _row_orders(weight.shape[0], heads):
        if torch.equal(first[order], weight[:, :first.shape[1]]):
            ordered = tuple(part[order] for part in groups)
            if torch.equal(_values(ordered), weight):
                return STORAGE[weights][kind], (ordered[0].flatten(1), *ordered[1:])  # q [N, K], scale [N, K/32]...
    log.warning("GGUF tensor %s: its blocks match no row order of the loaded weight; it runs as f32", tensor.name)
    return "f32", None


def _values(groups: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """(q [N, G, 32], scale [N, G][, minimum [N, G]]) -> the weight they hold [N, G * 32] float32."""
    values = groups[0].float() * groups[1][..., None]
    if len(groups) == 3:
        values = values + groups[2][..., None]
    return values.flatten(1)


def _row_orders(rows: int, heads: set[int]):
    """Candidate file rows for each model row: as stored, or llama.cpp's q/k interleave (rows of head h stored as
    (h, d/2, 2), held by the model as (h, 2, d/2)) for each head count that divides them."""
    yield torch.arange(rows)
    for count in sorted(heads):
        if rows % (2 * count) == 0:
            yield torch.arange(rows).view(count, rows // count // 2, 2).transpose(1, 2).reshape(rows)


def _blocks(tensor, kind: str) -> tuple[torch.Tensor, ...]:
    """A Q8_0, Q4_1 or Q4_0 tensor's blocks as (q [N, K/32, 32], scale [N, K/32]) for Q8_0 (w = q * scale) and
    (q, scale, minimum) for the others (w = q * scale + minimum; Q4_0: minimum = -8 * scale)."""
    data = np.asarray(tensor.data)  # [N, K/32 * block bytes] uint8
    rows = data.shape[0]
    size = {"Q8_0": 34, "Q4_1": 20, "Q4_0": 18}[kind]
    blocks = torch.from_numpy(data.reshape(rows, -1, size).copy())  # [N, K/32, block bytes]
    scale = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()  # [N, K/32]
    if kind == "Q8_0":
        return blocks[..., 2:].contiguous().view(torch.int8), scale
    packed = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]  # [N, K/32, 16]: k = j and j + 16 per byte
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1)  # [N, K/32, 32] uint8 in [0, 15]
    if kind == "Q4_1":
        return q, scale, blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    return q, scale, (-8 * scale.half()).float()  # exact but where it overflows float16 (then a mismatch: f32)
