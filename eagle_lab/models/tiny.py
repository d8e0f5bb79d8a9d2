"""Tiny random-weight targets (Llama, Qwen2, Mistral, Gemma 3 shapes) and a byte-level tokenizer.

They exercise every code path of a real target in milliseconds; weights come from a fixed
seed, so two loads give the same model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from eagle_lab.errors import EagleLabError

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
_FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "gemma3": Gemma3TextConfig}


@dataclass
class TinyModelConfig:
    family: str = "llama"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 2048
    # A wide init makes the random model's next-token distributions peaked, as a trained
    # model's are, so greedy argmax is far from ties and sampling tests see real structure.
    init_std: float = 0.3
    seed: int = 0
    # tokens a sliding-window layer attends over (0: none). Mistral and Qwen2 then slide in every layer, Gemma 3
    # in every layer but each `global_every`-th (its own default is 6; one full layer in two here)
    sliding_window: int = 0
    global_every: int = 2


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 259-token byte-level tokenizer with a ChatML template; needs no files."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_model(cfg: TinyModelConfig, vocab_size: int = BYTE_VOCAB_SIZE) -> torch.nn.Module:
    if cfg.family not in _FAMILIES:
        raise EagleLabError(f"unknown tiny family '{cfg.family}' (choose from {', '.join(_FAMILIES)})")
    extra = _window_options(cfg)
    eos, pad = 256 + SPECIAL_TOKENS.index("<|im_end|>"), 256
    if vocab_size <= eos:  # a toy vocabulary without the tokenizer's special tokens
        eos = pad = None
    config = _FAMILIES[cfg.family](
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.init_std,
        tie_word_embeddings=False,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        **extra,
    )
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def _window_options(cfg: TinyModelConfig) -> dict:
    """The family's config options that give it `cfg.sliding_window` (or none)."""
    window = cfg.sliding_window or None
    if cfg.family == "mistral":
        return {"sliding_window": window}
    if cfg.family == "qwen2":
        return {"use_sliding_window": window is not None, "sliding_window": window, "max_window_layers": 0}
    if cfg.family == "gemma3":
        kinds = ["full_attention" if (i + 1) % cfg.global_every == 0 else "sliding_attention"
                 for i in range(cfg.num_layers)]
        return {"sliding_window": window or cfg.max_position_embeddings,
                "layer_types": kinds if window else ["full_attention"] * cfg.num_layers,
                "head_dim": cfg.hidden_size // cfg.num_heads, "query_pre_attn_scalar": cfg.hidden_size // cfg.num_heads}
    if window is not None:
        raise EagleLabError(f"tiny family '{cfg.family}' has no sliding-window layers (mistral, qwen2 and gemma3 do)")
    return {}
