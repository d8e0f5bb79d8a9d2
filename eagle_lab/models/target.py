"""The target LLM: any unmodified Hugging Face causal LM, scored with tree attention.

Tree attention goes through the model's own 4-D additive attention mask and `position_ids`
over its own DynamicCache, so no modeling file is copied. The target never samples: it
returns features (the LM-head input) and logits, and the loop decides.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from eagle_lab.errors import EagleLabError
from eagle_lab.models.attention import use_cpu_attention
from eagle_lab.models.device import integer_dot_products, resolve_device, resolve_dtype
from eagle_lab.models.embedded import embedded_dir, embedded_model, gguf_path
from eagle_lab.models.gguf_weights import FILE_WEIGHTS, file_layers, is_gguf_path, load_gguf
from eagle_lab.models.masks import FULL, AttentionLayout, Mask, cache_config, tree_attention_mask
from eagle_lab.models.model_shape import ModelShape
from eagle_lab.models.stable_linear import StableLinear, convert_linears
from eagle_lab.models.tiny import TinyModelConfig, build_tiny_model, byte_tokenizer

log = logging.getLogger(__name__)
SOURCES = ("embedded", "pretrained", "tiny")


@dataclass
class TargetConfig:
    name: str = "smollm2_135m"
    source: str = "embedded"  # embedded | pretrained | tiny
    path: str = ""  # pretrained: a local directory, a hub id, or a GGUF file (eagle_lab/models/gguf_weights.py)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    device: str = "auto"
    dtype: str = "auto"
    max_context: int = 0  # 0: the model's max_position_embeddings
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    # the linear weights on CPU (eagle_lab/models/stable_linear.py): fp32 | bf16 | int8 (GGUF Q8_0) | int4 (GGUF
    # Q4_1, LM head Q8_0) | gguf, gguf_a8: each layer at its GGUF file's type | auto: the precision the weights
    # ship in (the embedded GGUF's int4, a GGUF file's own types, else fp32)
    weights: str = "auto"
    chat: bool = True  # replies to chat turns (its chat template); false: a base model continuing raw text


class HeadRotary(nn.Module):
    """The target's rotary embedding as a draft head calls it: (x, positions [B, T]) -> (cos, sin) [B, T, D]. A
    model with a table per layer type (Gemma 3: local and global bases) gives the head its full-attention table."""

    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.rotary = rotary
        self.layer_type = FULL if "layer_type" in inspect.signature(type(rotary).forward).parameters else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_type is None:
            return self.rotary(x, positions)
        return self.rotary(x, positions, self.layer_type)


@dataclass
class TargetOutput:
    features: torch.Tensor  # [B, K, H] top hidden state, the LM-head input
    layer_features: torch.Tensor | None = None  # [B, K, n*H] chosen layers (EAGLE-3)


class Target(ModelShape):
    """A frozen causal LM plus its tokenizer, with the few operations decoding needs."""

    def __init__(self, model, tokenizer, name: str, max_context: int = 0, weights: str = "fp32"):
        self.model = model.eval().requires_grad_(False)
        self.weights = weights  # how the linear weights are stored (eagle_lab.models.stable_linear)
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        self.backbone = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.embed_tokens = model.get_input_embeddings()
        model_limit = getattr(self.config, "max_position_embeddings", 0) or 1 << 30
        self.max_context = min(max_context, model_limit) if max_context > 0 else model_limit
        params = inspect.signature(self.backbone.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.rotary = HeadRotary(self.backbone.rotary_emb)  # (x, positions) -> cos, sin: what draft heads rotate by
        self.layout = AttentionLayout.of(self.config)  # full or sliding-window layers (eagle_lab/models/masks.py)
        self.cache_config = cache_config(self.config)  # what the caches are built from: every layer keeps all

    @property
    def linear_kernel(self) -> str:
        """"stable" where the linear layers run eagle_lab's row-stable CPU kernel, else "torch"."""
        return "stable" if isinstance(self.model.get_output_embeddings(), StableLinear) else "torch"

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]  # the LM head's rows (configs may round up)

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.config):
            eos = getattr(source, "eos_token_id", None)
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.cache_config)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: DynamicCache | None = None,
        position_ids: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        layer_ids: tuple[int, ...] = (),
        attention_mask: Mask | None = None,
    ) -> TargetOutput:
        """Score `input_ids` [B, K] after the cached prefix.

        tree_mask: [K, K] bool, True where node i may attend to node j (ancestors and
        itself); None means plain causal attention.
        attention_mask: a prepared additive [B, 1, K, past + K] mask instead, per layer type where they mix (a
        draft model's frontier, eagle_lab/drafters/draft_model/drafter.py); it overrides tree_mask.
        layer_ids: also return the hidden states entering these decoder layers (Hugging Face
        `hidden_states[i]`, where 0 is the embedding output; the convention EAGLE-3, vLLM and
        SGLang use for their auxiliary layers), concatenated on the last dim.
        """
        kwargs = {self._cache_kwarg: cache, "use_cache": cache is not None}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        elif tree_mask is not None:
            past = cache.get_seq_length() if cache is not None else 0
            kwargs["attention_mask"] = tree_attention_mask(tree_mask, past, position_ids, self.layout, self.dtype)
        if layer_ids:
            kwargs["output_hidden_states"] = True
        out = self.backbone(input_ids=input_ids, position_ids=position_ids, **kwargs)
        layer_features = None
        if layer_ids:
            layer_features = torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1)  # [B, K, n*H]
        return TargetOutput(features=out.last_hidden_state, layer_features=layer_features)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] in float32 (sampling and acceptance need full precision)."""
        return self.lm_head(features).float()


def load_target(cfg: TargetConfig, trainable_layers: bool = False) -> Target:
    """trainable_layers: keep torch's own linear layers (their weights readable, autograd through them), for
    training, which copies target layers into heads and captures features in its own dtype."""
    if cfg.source not in SOURCES:
        raise EagleLabError(f"unknown target source '{cfg.source}' (choose from {', '.join(SOURCES)})")
    if cfg.weights in FILE_WEIGHTS and not _typed_gguf(cfg):
        raise EagleLabError(f"target.weights={cfg.weights} keeps a GGUF file's own types: give target.path=FILE.gguf")
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.source == "tiny":
        model, tokenizer = build_tiny_model(cfg.tiny), byte_tokenizer()
    else:
        path = cfg.path
        if cfg.source == "embedded":
            path = str(embedded_dir(cfg.name))
        if not path:
            raise EagleLabError(f"target '{cfg.name}' has source=pretrained but no target.path")
        model, tokenizer = _load_pretrained(path, dtype, cfg)
    model = model.to(device=device, dtype=dtype)
    if not trainable_layers:
        use_cpu_attention(model)  # row-stable steps and trees on CPU (no autograd through it)
    weights = "fp32" if trainable_layers else shipped_weights(cfg)
    if trainable_layers and cfg.weights not in ("auto", "fp32"):
        raise EagleLabError(f"training reads the target's float weights; target.weights={cfg.weights} is for decoding")
    layers = file_layers(model, str(_typed_gguf(cfg)), weights) if weights in FILE_WEIGHTS else None
    replaced = 0 if trainable_layers else convert_linears(model, weights, layers)
    if replaced:
        log.info("target weights: %d linear layers in %s through eagle_lab's row-stable CPU kernel", replaced, weights)
    log.info("target %s: %s, %d layers, hidden %d, vocab %d on %s/%s", cfg.name, model.config.model_type,
             model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size, device, dtype)
    if dtype in (torch.bfloat16, torch.float16):
        log.info("target in %s: a position's logits move with the number of tokens its forward scores (the dtype's "
                 "rounding; measure it with python -m eagle_lab.benchmark.numerics dtype=...), so greedy speculative "
                 "output can part from plain decoding's at near-ties; float32 keeps them equal", dtype)
    return Target(model, tokenizer, cfg.name, cfg.max_context, weights)


def _typed_gguf(cfg: TargetConfig) -> Path | None:
    """The GGUF file whose tensor types a target's layers can keep (target.weights=gguf|gguf_a8), if any: its
    target.path, or an embedded model's file (SmolLM2's Q4_1 has its own storages, int4 and w4a8)."""
    if cfg.source == "pretrained" and is_gguf_path(cfg.path):
        return Path(cfg.path).expanduser()
    if cfg.source == "embedded" and embedded_model(cfg.name).weights == "gguf":
        return gguf_path(cfg.name)
    return None


def shipped_weights(cfg: TargetConfig) -> str:
    """target.weights with `auto` resolved. A GGUF target on CPU runs at its file's precision: the embedded SmolLM2
    (Q4_1 with a Q8_0 LM head) as w4a8, any other file's layers (Gemma 3 270M's included) at their own types as
    gguf_a8, where the CPU has integer dot products (AVX512-VNNI or AVX2: int8 activations, as llama.cpp computes
    such files; the fastest lossless choice at every row count on both, docs/benchmarks.md), else as int4 and gguf
    (the same weights over float32 activations, bitwise the numbers the file holds). Other targets: fp32."""
    if cfg.weights != "auto":
        return cfg.weights
    device = resolve_device(cfg.device)
    on_cpu = device.type == "cpu" and resolve_dtype(cfg.dtype, device) == torch.float32
    int8_activations = integer_dot_products()
    shipped = embedded_model(cfg.name).weights if cfg.source == "embedded" else "fp32"
    if on_cpu and shipped == "int4":
        return "w4a8" if int8_activations else "int4"
    if on_cpu and _typed_gguf(cfg):
        return "gguf_a8" if int8_activations else "gguf"
    return "fp32"


def _load_pretrained(path: str, dtype: torch.dtype, cfg: TargetConfig):
    if is_gguf_path(path):
        return load_gguf(path, dtype, cfg.attn_implementation)
    local = Path(path).expanduser()
    if (path.startswith((".", "/", "~")) or local.exists()) and not (local / "config.json").is_file():
        raise EagleLabError(f"target path '{path}' is not a model directory (no config.json there)")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(local) if local.exists() else path, dtype=dtype,
            attn_implementation=cfg.attn_implementation, trust_remote_code=cfg.trust_remote_code,
        )
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.exists() else path,
                                                  trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EagleLabError(f"could not load target '{path}': {first_line}") from exc
    return model, tokenizer


@contextlib.contextmanager
def grouped_query_sdpa() -> Iterator[None]:
    """Hugging Face's SDPA attention with grouped-query heads read in place (`enable_gqa`) even under a
    mask. By default it copies each key/value head to every query head it serves first, which on CPU
    makes attention over many rows and positions several times slower. Same result up to the kernels' rounding."""
    name = "TRANSFORMERS_SDPA_FORCE_GQA"
    before = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
