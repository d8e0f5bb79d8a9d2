"""A standalone draft model, trained by the head pipeline (`head=draft_lm`).

A small causal LM of the target's family: `head.draft_layers` decoder layers, random, under the
target's own embeddings, final norm and LM head (copied and frozen). It reads tokens only. It is
trained on the same captured corpus with the same objective as an EAGLE head: its last hidden
state after reading x_0..x_t regresses the target's feature f_t (Smooth-L1), and the target's
LM head over that hidden state is distilled to the target's distribution over the draft
vocabulary (cross-entropy). Same data, same LM head, same loss: the only difference from an
EAGLE-2 head is the input (tokens alone against tokens plus the target's feature), which is the
token-level against feature-level comparison the EAGLE paper makes. The export is a plain
Hugging Face model directory that `method=draft_model draft_model.path=DIR` serves.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from eagle_lab.drafters.draft_model.store import save_draft_vocab
from eagle_lab.errors import EagleLabError
from eagle_lab.models.target import Target


class DraftLM(nn.Module):
    """The draft LM with what the trainer asks of a head: its draft vocabulary, draft logits and
    predicted features."""

    def __init__(self, model: nn.Module, vocab_size: int, draft_vocab_ids: torch.Tensor | None = None):
        super().__init__()
        self.model = model
        ids = draft_vocab_ids if draft_vocab_ids is not None else torch.arange(vocab_size)
        self.register_buffer("draft_to_target", ids.long(), persistent=False)
        self.reduced_vocab = ids.numel() < vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    def predictions(self, input_ids: torch.Tensor, valid: torch.Tensor) -> list[torch.Tensor]:
        """[B, T] tokens -> [[B, T-1, H]]: the hidden state after x_0..x_t for t = 1..T-1, the
        prediction of f_t (aligned with an EAGLE head's first step, which predicts f_{p+1} at p)."""
        out = self.model.base_model(input_ids=input_ids, attention_mask=valid.long())
        return [out.last_hidden_state[:, 1:]]

    def draft_logits(self, hidden: torch.Tensor, target_rows: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, target_rows)  # the target's LM-head rows: frozen, shared with the target


def new_draft_lm(target: Target, layers: int, seed: int, draft_vocab_ids: torch.Tensor | None = None) -> DraftLM:
    """`layers` random decoder layers of the target's architecture under its frozen embeddings, norm and LM head."""
    if not 1 <= layers <= target.num_layers:
        raise EagleLabError(f"head.draft_layers must be in 1..{target.num_layers}, got {layers}")
    config = copy.deepcopy(target.model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):  # per-layer attention kinds (Qwen2, Mistral): keep the first ones
        config.layer_types = list(config.layer_types)[:layers]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    source = target.model
    model.get_input_embeddings().weight.data.copy_(source.get_input_embeddings().weight.data.float())
    if not config.tie_word_embeddings:
        model.get_output_embeddings().weight.data.copy_(source.get_output_embeddings().weight.data.float())
    model.base_model.norm.load_state_dict({k: v.float() for k, v in source.base_model.norm.state_dict().items()})
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        module.weight.requires_grad_(False)
    return DraftLM(model, target.vocab_size, draft_vocab_ids)


def save_draft_lm(draft: DraftLM, target: Target, directory: Path) -> Path:
    """A Hugging Face model directory with the target's tokenizer (what method=draft_model loads), plus
    the draft vocabulary it was trained on (draft_vocab.safetensors) when that is reduced."""
    directory.mkdir(parents=True, exist_ok=True)
    draft.model.save_pretrained(directory)
    target.tokenizer.save_pretrained(directory)
    if draft.reduced_vocab:
        save_draft_vocab(draft.draft_to_target, directory)
    return directory

