"""The EAGLE-3 draft head: fuses low, middle and high target features.

  fused  = fc([h_low; h_mid; h_high])                      [B, T, 3H] -> [B, T, H]
  attn   = self_attn([input_layernorm(embed); hidden_norm(fused)])   (2H wide input)
  hidden = fused + attn;  hidden += mlp(post_attention_layernorm(hidden))
  logits = lm_head(norm(hidden))                           over the draft vocabulary
From the second draft step on, the head's own `hidden` replaces `fused` (no fc): the
training-time-test unroll teaches it to read its own outputs. Module names follow the
layout that vLLM and SGLang load (`midlayer.*`, `fc`, `norm`, `lm_head`).
"""

from __future__ import annotations

import torch
from torch import nn

from eagle_lab.drafters.eagle.head import MLP, Attention, EagleHead, HeadArchitecture, RMSNorm


class Eagle3Layer(nn.Module):
    def __init__(self, arch: HeadArchitecture):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, 2 * arch.hidden_size)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch.hidden_size, arch.intermediate_size)

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = residual + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(EagleHead):
    reads_target_lm_rows = False  # its own normalised LM head

    def __init__(self, arch: HeadArchitecture):
        nn.Module.__init__(self)
        self.arch = arch
        fused_width = arch.hidden_size * max(len(arch.feature_layers), 1)
        self.fc = nn.Linear(fused_width, arch.hidden_size, bias=False)
        self.layer = Eagle3Layer(arch)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.draft_vocab_size, bias=False)
        self.register_buffer("draft_to_target", torch.arange(arch.draft_vocab_size), persistent=True)

    @staticmethod
    def default_feature_layers(num_layers: int) -> tuple[int, ...]:
        return eagle3_layer_ids(num_layers)

    def init_from_target(self, target) -> None:
        """Start the draft LM head from the target's rows of the draft vocabulary."""
        with torch.no_grad():
            rows = target.lm_head.weight.index_select(0, self.draft_to_target.to(target.lm_head.weight.device))
            self.lm_head.weight.copy_(rows.to(self.lm_head.weight.dtype))

    def inputs(self, token_embeds: torch.Tensor, features: torch.Tensor, from_draft: bool = False):
        fused = features if from_draft else self.fc(features)  # [B, T, H]
        attn_in = torch.cat([self.layer.input_layernorm(token_embeds), self.layer.hidden_norm(fused)], dim=-1)
        return attn_in, fused  # [B, T, 2H], [B, T, H]

    def draft_logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Its own normalised LM head; the target rows argument is unused."""
        return self.lm_head(self.norm(hidden))


def eagle3_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default low, middle and high layers: (2, L // 2, L - 3), as hidden_states indices."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))
