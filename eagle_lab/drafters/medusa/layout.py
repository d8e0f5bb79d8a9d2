"""Medusa heads in the layout of the Medusa project (Cai et al.), which its own code, TGI and
TensorRT-LLM's converter read:

  config.json                  {"medusa_num_heads": K, "medusa_num_layers": 1, "base_model_name_or_path": ...}
  medusa_lm_head.safetensors   head i: "{i}.0.linear.weight" [H, H], "{i}.0.linear.bias" [H] (the residual
                               block, h + SiLU(W h + b)), "{i}.1.weight" [V, H] (its vocabulary projection)

eagle_lab's heads share the target's LM head, so an export writes the target's LM head as every
head's projection (the full vocabulary: a reduced draft vocabulary is not expressible there).
An import keeps each head's own projection when it differs from the target's (Medusa-1 heads
train it), and shares the target's when they are equal. Heads with more than one residual
block per head are refused: eagle_lab's heads have one.

  python -m eagle_lab.drafters.medusa.layout export head_path=DIR out=DIR [target=smollm2_135m | a model directory]
  python -m eagle_lab.drafters.medusa.layout import head_path=DIR out=DIR [target=...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle_lab.drafters.medusa.heads import MedusaArch, MedusaHeads, load_medusa, save_medusa
from eagle_lab.errors import EagleLabError

CONFIG, WEIGHTS, WEIGHTS_PT = "config.json", "medusa_lm_head.safetensors", "medusa_lm_head.pt"


def is_medusa_layout(directory: str | Path) -> bool:
    directory = Path(directory).expanduser()
    return (directory / WEIGHTS).is_file() or (directory / WEIGHTS_PT).is_file()


def load_any_medusa(directory: str | Path, target) -> MedusaHeads:
    """Heads in either layout: the Medusa project's, or eagle_lab's (eagle_lab.drafters.medusa.heads.load_medusa)."""
    return import_medusa_layout(directory, target) if is_medusa_layout(directory) else load_medusa(directory, target)


def export_medusa_layout(heads: MedusaHeads, target, out: str | Path) -> Path:
    """eagle_lab heads -> the Medusa layout in `out` (the target's LM head as every projection)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for index, block in enumerate(heads.blocks):
        state[f"{index}.0.linear.weight"] = block.weight.detach().float().cpu().contiguous()
        state[f"{index}.0.linear.bias"] = block.bias.detach().float().cpu().contiguous()
        rows = heads.projections[index] if heads.arch.own_projections else target.lm_head.weight
        state[f"{index}.1.weight"] = rows.detach().float().cpu().clone()  # one copy per head, as the layout has
    save_file(state, str(out / WEIGHTS))
    (out / CONFIG).write_text(json.dumps({"medusa_num_heads": heads.arch.num_heads, "medusa_num_layers": 1,
                                          "base_model_name_or_path": target.name,
                                          "hidden_size": heads.arch.hidden_size,
                                          "vocab_size": heads.arch.vocab_size}, indent=2))
    return out


def import_medusa_layout(directory: str | Path, target) -> MedusaHeads:
    """A Medusa-layout directory -> heads for `target` (EagleLabError when they cannot be served on it)."""
    directory = Path(directory).expanduser()
    try:
        config = json.loads((directory / CONFIG).read_text())
        state = load_file(str(directory / WEIGHTS)) if (directory / WEIGHTS).is_file() \
            else torch.load(directory / WEIGHTS_PT, map_location="cpu", weights_only=True)
        count = int(config["medusa_num_heads"])
        layers = int(config.get("medusa_num_layers", 1))
    except (OSError, KeyError, ValueError, RuntimeError, json.JSONDecodeError) as err:
        raise EagleLabError(f"'{directory}' is not a Medusa-layout directory ({CONFIG} with medusa_num_heads, "
                            f"{WEIGHTS}): {err}") from err
    if layers != 1:
        raise EagleLabError(f"the Medusa heads in '{directory}' have {layers} residual blocks each; "
                            "eagle_lab's have one")
    missing = [key for i in range(count) for key in (f"{i}.0.linear.weight", f"{i}.0.linear.bias", f"{i}.1.weight")
               if key not in state]
    if missing:
        raise EagleLabError(f"'{directory}' lacks Medusa weights {missing[:3]}")
    hidden, vocab = state["0.1.weight"].shape[1], state["0.1.weight"].shape[0]
    if (hidden, vocab) != (target.hidden_size, target.vocab_size):
        raise EagleLabError(f"the Medusa heads in '{directory}' have hidden size {hidden} and vocabulary {vocab}; "
                            f"target '{target.name}' has {target.hidden_size} and {target.vocab_size}")
    lm_head = target.lm_head.weight.detach().float().cpu()
    own = any(not torch.allclose(state[f"{i}.1.weight"].float(), lm_head, atol=1e-3, rtol=1e-3) for i in range(count))
    heads = MedusaHeads(MedusaArch(hidden, vocab, count, own_projections=own))
    with torch.no_grad():
        for index, block in enumerate(heads.blocks):
            block.weight.copy_(state[f"{index}.0.linear.weight"].float())
            block.bias.copy_(state[f"{index}.0.linear.bias"].float())
            if own:
                heads.projections[index].copy_(state[f"{index}.1.weight"].float())
    return heads.to(target.device).eval()


def main(argv: list[str]) -> int:
    from eagle_lab.models.target import TargetConfig, load_target

    usage = ("usage: python -m eagle_lab.drafters.medusa.layout export|import head_path=DIR out=DIR "
             "[target=smollm2_135m]")
    args = dict(arg.split("=", 1) for arg in argv[1:] if "=" in arg)
    if not argv or argv[0] not in ("export", "import") or not {"head_path", "out"} <= set(args):
        print(usage, file=sys.stderr)
        return 2
    try:
        name = args.get("target", "smollm2_135m")
        source = "embedded" if name == "smollm2_135m" else "pretrained"
        target = load_target(TargetConfig(name=name, source=source, path="" if source == "embedded" else name))
        if argv[0] == "export":
            out = export_medusa_layout(load_medusa(args["head_path"], target), target, args["out"])
        else:
            out = save_medusa(import_medusa_layout(args["head_path"], target), args["out"])
    except EagleLabError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
