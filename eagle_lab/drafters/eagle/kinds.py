"""Head kinds (eagle2, eagle3): the class each names, fresh heads, and heads saved by eagle_lab."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle_lab.drafters.eagle.eagle3 import Eagle3Head
from eagle_lab.drafters.eagle.head import CONFIG_NAME, WEIGHTS_NAME, EagleHead, HeadArchitecture
from eagle_lab.errors import EagleLabError

log = logging.getLogger(__name__)


def head_class(kind: str) -> type[EagleHead]:
    classes = {"eagle2": EagleHead, "eagle3": Eagle3Head}
    if kind not in classes:
        raise EagleLabError(f"unknown head kind '{kind}' (choose from {', '.join(classes)})")
    return classes[kind]


def new_head(target, kind: str = "eagle2", draft_vocab_ids: torch.Tensor | None = None, seed: int = 0,
             feature_layers: tuple[int, ...] = (), layer_from_target: bool = False,
             intermediate_size: int = 0) -> EagleHead:
    """A freshly initialised head for `target`; feature_layers overrides the kind's default
    (EAGLE-3: hidden_states indices (2, L//2, L-3)); layer_from_target starts an EAGLE-2
    head's decoder layer from the target's last layer; intermediate_size > 0 sets the width of
    the head's MLP (default: the target's)."""
    cls = head_class(kind)
    size = 0 if draft_vocab_ids is None else draft_vocab_ids.numel()
    layers = tuple(feature_layers) or cls.default_feature_layers(target.num_layers)
    if kind == "eagle2" and feature_layers:
        raise EagleLabError("head.feature_layers applies to eagle3 heads only (EAGLE-2 reads the top feature)")
    bad = [i for i in layers if not 0 <= i <= target.num_layers]
    if bad:
        raise EagleLabError(f"head.feature_layers {bad} outside 0..{target.num_layers} for target '{target.name}'")
    arch = HeadArchitecture.for_target(target, kind=kind, draft_vocab_size=size, feature_layers=layers)
    if intermediate_size < 0:
        raise EagleLabError(f"head.intermediate_size must be >= 0 (0 = the target's), got {intermediate_size}")
    if intermediate_size:
        if layer_from_target and intermediate_size != arch.intermediate_size:
            raise EagleLabError("head.init_layer_from_target copies the target's MLP: "
                                "leave head.intermediate_size at 0")
        arch.intermediate_size = intermediate_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = cls(arch)
    if draft_vocab_ids is not None:
        head.draft_to_target.copy_(draft_vocab_ids.sort().values)
    head.init_from_target(target)
    if layer_from_target:
        if kind != "eagle2":
            raise EagleLabError("head.init_layer_from_target applies to eagle2 heads only")
        head.init_layer_from_target(target)
    return head.to(device=target.device, dtype=target.dtype)


def load_native_head(directory: str | Path, target) -> EagleHead:
    """A head saved by eagle_lab (config.json + model.safetensors)."""
    directory = Path(directory).expanduser()
    config_file, weights_file = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    if not directory.is_dir():
        raise EagleLabError(f"head path '{directory}' does not exist or is not a directory")
    if not config_file.is_file() or not weights_file.is_file():
        raise EagleLabError(f"head path '{directory}' needs {CONFIG_NAME} and {WEIGHTS_NAME}")
    try:
        arch = HeadArchitecture(**json.loads(config_file.read_text()))
    except (json.JSONDecodeError, TypeError) as exc:
        raise EagleLabError(f"head config {config_file} is not an eagle_lab head config: {exc}") from exc
    arch.check_matches(target)
    head = head_class(arch.kind)(arch)
    try:
        head.load_state_dict(load_file(str(weights_file)))
    except (RuntimeError, OSError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise EagleLabError(f"head weights {weights_file} do not fit its config: {first}") from exc
    return head.to(device=target.device, dtype=target.dtype).eval()
