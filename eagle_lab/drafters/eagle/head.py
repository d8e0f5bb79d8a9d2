"""The EAGLE draft head: fc over [embed(next token); feature], then one decoder layer.

It predicts the target's next top-layer feature. It owns no embeddings: token embeddings
and rotary tables come from the frozen target, and with the full vocabulary the target's
LM head turns predicted features into draft logits. With a reduced draft vocabulary
(`draft_vocab_size`), the LM head is the target's rows for the kept tokens, stored as a
draft-to-target id map only (the rows themselves are read from the target at load time).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from eagle_lab.errors import EagleLabError

log = logging.getLogger(__name__)
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


@dataclass
class HeadArchitecture:
    """Everything needed to rebuild a head, saved as config.json next to the weights."""

    kind: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    attention_bias: bool
    vocab_size: int  # the target's
    draft_vocab_size: int  # == vocab_size when the draft uses the full vocabulary
    target_model_type: str
    feature_layers: list[int] = field(default_factory=list)  # target layers fused (EAGLE-3); [] = top only

    @classmethod
    def for_target(cls, target, kind: str = "eagle2", draft_vocab_size: int = 0,
                   feature_layers: tuple[int, ...] = ()) -> HeadArchitecture:
        c = target.config
        heads = c.num_attention_heads
        return cls(
            feature_layers=list(feature_layers),
            kind=kind,
            hidden_size=c.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            intermediate_size=c.intermediate_size,
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
            attention_bias=bool(getattr(c, "attention_bias", False)) or c.model_type == "qwen2",
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size or target.vocab_size,
            target_model_type=c.model_type,
        )

    def check_matches(self, target) -> None:
        """Refuse a head trained for a different target, with the reason."""
        problems = []
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden size {self.hidden_size} != target's {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocabulary {self.vocab_size} != target's {target.vocab_size}")
        if self.target_model_type != target.model_type:
            problems.append(f"family '{self.target_model_type}' != target's '{target.model_type}'")
        if problems:
            raise EagleLabError(f"head does not fit target '{target.name}': " + "; ".join(problems))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class HeadKVCache:
    """The head's own key/value cache: preallocated [B, kvH, capacity, D] buffers filled up to `length`.

    Appends write in place; when full, the buffers grow by whole blocks (one copy). Cropping only
    moves the length, so a round's draft entries past the committed pairs cost nothing to forget.
    """

    def __init__(self, block: int = 512, min_capacity: int = 0):
        self.key_buffer: torch.Tensor | None = None  # [B, kvH, capacity, D]
        self.value_buffer: torch.Tensor | None = None
        self.length = 0
        self.block, self.min_capacity = block, min_capacity

    @property
    def capacity(self) -> int:
        return 0 if self.key_buffer is None else self.key_buffer.shape[2]

    @property
    def keys(self) -> torch.Tensor | None:
        """[B, kvH, length, D], a view of the buffer."""
        return None if self.key_buffer is None else self.key_buffer[:, :, :self.length]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.value_buffer is None else self.value_buffer[:, :, :self.length]

    def reserve(self, slots: int, like: torch.Tensor, arch: HeadArchitecture, batch: int = 1) -> None:
        """Room for `slots` entries per row (buffers of like's dtype and device)."""
        self._grow(slots, (batch, arch.num_kv_heads, arch.head_dim), like)

    def _grow(self, slots: int, shape: tuple[int, int, int], like: torch.Tensor) -> None:
        """Reallocate in whole blocks (at least min_capacity) when `slots` do not fit; shape: (B, kvH, D)."""
        if slots <= self.capacity:
            return
        capacity = max(-(-slots // self.block) * self.block, self.min_capacity)
        keys, values = (like.new_zeros((shape[0], shape[1], capacity, shape[2])) for _ in range(2))
        if self.length:
            keys[:, :, :self.length], values[:, :, :self.length] = self.keys, self.values
        self.key_buffer, self.value_buffer = keys, values

    def load(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Take [B, kvH, S, D] keys and values as the whole cache (S entries, no free room)."""
        self.key_buffer, self.value_buffer, self.length = keys, values, keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, kvH, T, D] each -> every cached entry, these included: [B, kvH, length + T, D] each."""
        count = keys.shape[2]
        self._grow(self.length + count, (keys.shape[0], keys.shape[1], keys.shape[3]), keys)
        self.key_buffer[:, :, self.length:self.length + count] = keys
        self.value_buffer[:, :, self.length:self.length + count] = values
        self.length += count
        return self.keys, self.values

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)


class Attention(nn.Module):
    def __init__(self, arch: HeadArchitecture, input_size: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        bias = arch.attention_bias
        self.q_proj = nn.Linear(input_size, arch.num_heads * arch.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, arch.num_kv_heads * arch.head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, arch.num_kv_heads * arch.head_dim, bias=bias)
        self.o_proj = nn.Linear(arch.num_heads * arch.head_dim, arch.hidden_size, bias=False)

    def project(self, x, cos, sin):
        """x [B, T, In] -> rotated q [B, nH, T, D], k and v [B, kvH, T, D]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nH, T, D]
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, kvH, T, D]
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, kvH, T, D]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def expand_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """[B, kvH, S, D] -> [B, nH, S, D] (grouped-query attention)."""
        return kv.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)

    def forward(self, x, cos, sin, cache: HeadKVCache | None, mask: torch.Tensor | None):
        b, t, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)  # [B, kvH, S, D]
        k, v = self.expand_kv(k), self.expand_kv(v)  # [B, nH, S, D]
        causal = mask is None and t > 1 and k.shape[2] == t
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)  # [B, nH, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # [B, T, H]


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer without input norm (EAGLE-1/2: fc output goes in raw)."""

    def __init__(self, arch: HeadArchitecture):
        super().__init__()
        self.self_attn = Attention(arch, arch.hidden_size)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch.hidden_size, arch.intermediate_size)

    def forward(self, x, cos, sin, cache, mask):
        return self.finish(x, self.self_attn(x, cos, sin, cache, mask))

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Everything after attention: residual add, then the MLP block."""
        x = residual + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """features [B, T, H] + next-token embeddings [B, T, H] -> predicted next features [B, T, H]."""

    reads_target_lm_rows = True  # draft_logits multiplies by the target's LM-head rows (EAGLE-3 has its own)

    def __init__(self, arch: HeadArchitecture):
        super().__init__()
        self.arch = arch
        self.fc = nn.Linear(2 * arch.hidden_size, arch.hidden_size, bias=True)
        self.layer = DecoderLayer(arch)
        # draft id -> target id; identity when the draft uses the full vocabulary
        self.register_buffer("draft_to_target", torch.arange(arch.draft_vocab_size), persistent=True)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the head computes in (head.draft_dtype when drafting); its inputs are cast to it."""
        return self.fc.weight.dtype

    @property
    def reduced_vocab(self) -> bool:
        return self.arch.draft_vocab_size != self.arch.vocab_size

    @staticmethod
    def default_feature_layers(num_layers: int) -> tuple[int, ...]:
        return ()  # EAGLE-2 reads only the top feature

    def init_from_target(self, target) -> None:
        """Hook for heads with weights best started from the target's (EAGLE-3's LM head)."""

    def init_layer_from_target(self, target) -> None:
        """Start the decoder layer from the target's last one (a recipe option: the head then
        begins as the target's own top layer). The target's input norm has no counterpart here
        (EAGLE-2 feeds the fc output raw), so only its gain is folded into q, k and v."""
        source = target.backbone.layers[-1]
        with torch.no_grad():
            gain = source.input_layernorm.weight.float()  # [H]
            for name in ("q_proj", "k_proj", "v_proj"):
                ours, theirs = getattr(self.layer.self_attn, name), getattr(source.self_attn, name)
                ours.weight.copy_((theirs.weight.float() * gain).to(ours.weight.dtype))  # [out, H] * [H]
                if ours.bias is not None and theirs.bias is not None:
                    ours.bias.copy_(theirs.bias)
            self.layer.self_attn.o_proj.weight.copy_(source.self_attn.o_proj.weight)
            self.layer.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(self.layer.mlp, name).weight.copy_(getattr(source.mlp, name).weight)

    def inputs(self, token_embeds: torch.Tensor, features: torch.Tensor, from_draft: bool = False):
        """-> (attention input [B, T, In], residual stream [B, T, H]).

        from_draft: the features are this head's own earlier outputs, not the target's
        (the same for EAGLE-2; EAGLE-3 projects only target features).
        """
        x = self.fc(torch.cat([token_embeds, features], dim=-1))  # [B, T, 2H] -> [B, T, H]
        return x, x

    def forward(self, token_embeds, features, cos, sin, cache: HeadKVCache | None = None, mask=None,
                from_draft: bool = False):
        """mask: None (causal) or additive float [1 or B, 1, T, S] over cached + new keys."""
        attn_in, residual = self.inputs(token_embeds, features, from_draft)  # [B, T, In], [B, T, H]
        return self.layer.finish(residual, self.layer.self_attn(attn_in, cos, sin, cache, mask))

    def draft_logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., Vd] using the target's LM-head rows of the draft vocabulary."""
        return F.linear(hidden, lm_head_weight)


def draft_lm_head_weight(head: EagleHead, target) -> torch.Tensor:
    """[Vd, H]: the target's LM-head rows for the draft vocabulary (a view when full)."""
    weight = target.lm_head.weight
    return weight.index_select(0, head.draft_to_target) if head.reduced_vocab else weight


def save_head(head: EagleHead, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """config.json + model.safetensors; dtype casts floating weights (bf16 halves a packaged head)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
             for k, v in head.state_dict().items()}
    save_file(state, str(directory / (WEIGHTS_NAME + ".tmp")))
    (directory / (CONFIG_NAME + ".tmp")).write_text(json.dumps(asdict(head.arch), indent=2))
    (directory / (WEIGHTS_NAME + ".tmp")).replace(directory / WEIGHTS_NAME)
    (directory / (CONFIG_NAME + ".tmp")).replace(directory / CONFIG_NAME)
    return directory
