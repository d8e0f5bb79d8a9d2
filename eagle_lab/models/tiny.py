"""Tiny random-weight targets (Llama, Qwen2, Mistral shapes) and a byte-level tokenizer.

They exercise every code path of a real target in milliseconds; weights come from a fixed
seed, so two loads give the same model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedTokenizerFast, Qwen2Config

from eagle_lab.errors import EagleLabError

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
_FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}


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
    extra = {"sliding_window": None} if cfg.family == "mistral" else {}
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
