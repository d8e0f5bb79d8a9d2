"""The bridge to llama.cpp: where its source and tools are, and its converter run on eagle_lab's files.

llama.cpp serves EAGLE-3 heads (`--spec-type draft-eagle3`) from a pair of GGUF files: the target,
and the head converted with `convert_hf_to_gguf.py HEAD --target-model-dir TARGET`, which reads the
SpecForge `LlamaForCausalLMEagle3` layout that `eagle_lab.export format=eagle3` writes (its
`target_layers` are Hugging Face hidden-state indices, as eagle_lab's `head.feature_layers`; d2t maps
the draft vocabulary). The source is found at `llama_cpp=DIR` or `$EAGLE_LAB_LLAMA_CPP`: a llama.cpp
checkout, or the copy vendored in the `llama-cpp-python` sdist; its tools under `DIR/build/bin`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from eagle_lab.errors import EagleLabError

ENV = "EAGLE_LAB_LLAMA_CPP"
CONVERTER = "convert_hf_to_gguf.py"
TARGET_OUTTYPES = ("f32", "bf16", "f16", "q8_0")


def source_dir(given: str = "") -> Path | None:
    """llama.cpp's source directory (holding convert_hf_to_gguf.py), from `given` or $EAGLE_LAB_LLAMA_CPP;
    None when neither names one."""
    raw = given or os.environ.get(ENV, "")
    if not raw:
        return None
    path = Path(raw).expanduser()
    vendored = path / "vendor" / "llama.cpp"  # the llama-cpp-python sdist
    if not (path / CONVERTER).is_file() and (vendored / CONVERTER).is_file():
        path = vendored
    if not (path / CONVERTER).is_file():
        raise EagleLabError(f"'{raw}' is not a llama.cpp source directory (no {CONVERTER} there)")
    return path


def tool(source: Path, name: str) -> Path | None:
    """A built llama.cpp tool (llama-bench, llama-speculative-simple, ...) or None."""
    path = source / "build" / "bin" / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def convert(source: Path, model_dir: Path, outfile: Path, outtype: str, target_dir: Path | None = None) -> Path:
    """Run llama.cpp's converter on a Hugging Face directory (a head when target_dir is given)."""
    command = [sys.executable, str(source / CONVERTER), str(model_dir), "--outtype", outtype, "--outfile", str(outfile)]
    if target_dir is not None:
        command += ["--target-model-dir", str(target_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(source / "gguf-py"),
                                                                      os.environ.get("PYTHONPATH", "")]))}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise EagleLabError(f"llama.cpp's converter failed on {model_dir}: {' | '.join(tail)}")
    return outfile
