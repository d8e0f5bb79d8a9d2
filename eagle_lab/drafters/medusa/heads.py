"""Medusa heads: K small heads on the target's top feature, head k guessing the token k+1 places
ahead (Cai et al., 2024). Head k is a residual block, h + SiLU(W_k h + b_k), read through the
target's own LM head (shared and frozen, like an EAGLE head's draft LM head); it sees only the
feature of the last committed token, never its draft parents. Weights are `config.json` (the
architecture, `kind: medusa`) and `model.safetensors`, as for EAGLE heads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from eagle_lab.errors import EagleLabError

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


@dataclass
class MedusaArch:
    hidden_size: int
    vocab_size: int  # the target's
    num_heads: int = 4
    draft_vocab_size: int = 0  # 0: the full vocabulary
    own_projections: bool = False  # each head its own [V, H] vocabulary projection (Medusa's layout, imported)
    kind: str = "medusa"


class MedusaHeads(nn.Module):
    def __init__(self, arch: MedusaArch, draft_vocab_ids: torch.Tensor | None = None):
        super().__init__()
        self.arch = arch
        self.blocks = nn.ModuleList(nn.Linear(arch.hidden_size, arch.hidden_size) for _ in range(arch.num_heads))
        for block in self.blocks:  # zero start, as Medusa: each head begins as the target's next-token guess
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        ids = draft_vocab_ids if draft_vocab_ids is not None else torch.arange(arch.vocab_size)
        self.register_buffer("draft_to_target", ids.long(), persistent=True)
        if arch.own_projections:  # [K, V, H]; else every head reads the target's LM head
            self.register_buffer("projections", torch.zeros(arch.num_heads, arch.vocab_size, arch.hidden_size))
        self.reduced_vocab = ids.numel() < arch.vocab_size
        arch.draft_vocab_size = ids.numel()

    def forward(self, features: torch.Tensor) -> list[torch.Tensor]:
        """[..., H] top features -> per head [..., H], the feature whose LM-head row scores its token."""
        return [features + F.silu(block(features)) for block in self.blocks]

    def draft_logits(self, hidden: torch.Tensor, target_rows: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, target_rows)

    def head_rows(self, index: int, target_rows: torch.Tensor) -> torch.Tensor:
        """[Vd, H]: the vocabulary rows head `index` scores with (its own, or the target's LM head's)."""
        if self.arch.own_projections:
            return self.projections[index].index_select(0, self.draft_to_target) if self.reduced_vocab \
                else self.projections[index]
        return target_rows


def save_medusa(heads: MedusaHeads, directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}, str(directory / WEIGHTS_NAME))
    (directory / CONFIG_NAME).write_text(json.dumps(asdict(heads.arch), indent=2))
    return directory


def load_medusa(directory: str | Path, target) -> MedusaHeads:
    """eagle_lab's layout (config.json kind medusa + model.safetensors); the Medusa project's is read by
    eagle_lab.drafters.medusa.layout.load_any_medusa."""
    directory = Path(directory).expanduser()
    try:
        arch = MedusaArch(**json.loads((directory / CONFIG_NAME).read_text()))
        state = load_file(str(directory / WEIGHTS_NAME))
    except (OSError, TypeError, json.JSONDecodeError) as err:
        raise EagleLabError(f"'{directory}' is not a Medusa head directory ({CONFIG_NAME} with kind medusa and "
                            f"{WEIGHTS_NAME}): {err}") from err
    if arch.kind != "medusa":
        raise EagleLabError(f"'{directory}' holds a '{arch.kind}' head, not Medusa heads")
    if (arch.hidden_size, arch.vocab_size) != (target.hidden_size, target.vocab_size):
        raise EagleLabError(f"Medusa heads in '{directory}' were trained for hidden size {arch.hidden_size} and "
                            f"vocabulary {arch.vocab_size}; target '{target.name}' has {target.hidden_size} and "
                            f"{target.vocab_size}")
    heads = MedusaHeads(arch, state["draft_to_target"])
    heads.load_state_dict(state)
    return heads.to(target.device).eval()
