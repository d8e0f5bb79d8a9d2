"""A draft LM stored without what it shares with its target.

A draft LM trained with `head=draft_lm` keeps the target's embeddings and LM head, frozen: for
SmolLM2 they are 28M of its 32M parameters (113 MB in fp32), the same bytes the target already
holds. The layers-only layout keeps the rest:

  draft_lm.json        {"kind": "draft_lm", "target": <name>}: what to take from which target
  config.json          the draft model's Hugging Face config (its decoder layers)
  layers.safetensors   every weight but the input embeddings and the output LM head
  draft_vocab.safetensors  the draft vocabulary it was trained on ([Vd] target ids; it drafts from
                       those LM-head rows only, as EAGLE heads do), when that is reduced

`load_layers_only` rebuilds the model and takes the embeddings and LM head from the target
(checked to have the shape the draft was trained on). A full Hugging Face directory (what the
trainer exports, and any other draft model) loads as any causal LM does.

  python -m eagle_lab.drafters.draft_model.store head_path=runs/NAME/head out=DIR [target=smollm2_135m]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from eagle_lab.errors import EagleLabError
from eagle_lab.models.target import Target

MARKER, LAYERS, VOCAB = "draft_lm.json", "layers.safetensors", "draft_vocab.safetensors"
SHARED = ("embed_tokens", "lm_head")  # parameter-name fragments of what comes from the target


def is_layers_only(directory: str | Path) -> bool:
    return (Path(directory).expanduser() / MARKER).is_file()


def save_draft_vocab(ids: torch.Tensor, directory: str | Path) -> None:
    save_file({"draft_to_target": ids.detach().long().cpu().contiguous()}, str(Path(directory) / VOCAB))


def load_draft_vocab(directory: str | Path) -> torch.Tensor | None:
    """[Vd] target ids of a draft LM's draft vocabulary, or None (it drafts from the whole vocabulary)."""
    path = Path(directory).expanduser() / VOCAB
    return load_file(str(path))["draft_to_target"] if path.is_file() else None


def _shared(name: str) -> bool:
    return any(part in name for part in SHARED)


def save_layers_only(model_dir: str | Path, target_name: str, out: str | Path, dtype: torch.dtype = torch.bfloat16
                     ) -> Path:
    """A full draft-LM directory (the trainer's export) -> the layers-only layout in `out`.
    dtype: how the kept weights are stored (they are read back in the target's dtype)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    kept = {name: tensor.detach().to(dtype).contiguous() for name, tensor in model.state_dict().items()
            if not _shared(name)}
    save_file(kept, str(out / LAYERS))
    model.config.save_pretrained(out)
    vocab = load_draft_vocab(model_dir)
    if vocab is not None:
        save_draft_vocab(vocab, out)
    (out / MARKER).write_text(json.dumps({"kind": "draft_lm", "target": target_name}, indent=2))
    return out


def load_layers_only(directory: str | Path, target: Target, name: str = "draft_lm") -> Target:
    """The draft LM in `directory`, completed with `target`'s embeddings and LM head, on its device."""
    directory = Path(directory).expanduser()
    try:
        meta = json.loads((directory / MARKER).read_text())
        config = AutoConfig.from_pretrained(str(directory))
        state = load_file(str(directory / LAYERS))
    except (OSError, ValueError) as err:
        raise EagleLabError(f"'{directory}' is not a layers-only draft LM ({MARKER}, config.json, {LAYERS}): "
                            f"{err}") from err
    if (config.hidden_size, config.vocab_size) != (target.hidden_size, target.config.vocab_size):
        raise EagleLabError(f"the draft LM in '{directory}' was trained for target '{meta.get('target')}' (hidden "
                            f"{config.hidden_size}, vocabulary {config.vocab_size}); target '{target.name}' has "
                            f"{target.hidden_size} and {target.config.vocab_size}")
    model = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    missing, unexpected = model.load_state_dict({k: v.to(target.dtype) for k, v in state.items()}, strict=False)
    if unexpected or any(not _shared(key) for key in missing):
        raise EagleLabError(f"the draft LM in '{directory}' does not match its config: missing "
                            f"{[k for k in missing if not _shared(k)]}, unexpected {unexpected}")
    model.get_input_embeddings().weight = target.embed_tokens.weight  # shared with the target, not copied
    model.get_output_embeddings().weight = target.lm_head.weight
    return Target(model.to(target.device), target.tokenizer, name, target.max_context)


def main(argv: list[str]) -> int:
    args = dict(arg.split("=", 1) for arg in argv if "=" in arg)
    if not {"head_path", "out"} <= set(args):
        print("usage: python -m eagle_lab.drafters.draft_model.store head_path=DIR out=DIR [target=smollm2_135m]",
              file=sys.stderr)
        return 2
    source = Path(args["head_path"]).expanduser()
    if not (source / "config.json").is_file():
        print(f"error: '{source}' is not a draft LM directory (no config.json)", file=sys.stderr)
        return 2
    out = save_layers_only(source, args.get("target", "smollm2_135m"), args["out"])
    if (source / "card.json").is_file():
        shutil.copy(source / "card.json", out / "card.json")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
