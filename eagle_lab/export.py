"""`python -m eagle_lab.export head_path=DIR format=eagle3|eagle|gguf out=DIR [target=NAME] [dtype=auto]`

Writes a trained head in the layout vLLM, SGLang and the official EAGLE code load
(see eagle_lab.drafters.eagle.layouts); format=gguf writes the pair llama.cpp serves an EAGLE-3 head with
(eagle_lab.models.llama_cpp): `target-<type>.gguf` and `head.gguf`, through llama.cpp's own converter.
The target is only read for its config (rotary settings, context length, special token ids) and to
check the head fits it; its weights are not loaded.

  target=NAME   a config under conf/target/ (or a .yaml path); default: the run's target
                (`resolved_config.yaml` next to the head directory), else smollm2_135m
  dtype=auto    keep the head's stored precision; or float32 | bfloat16 | float16
  llama_cpp=DIR llama.cpp's source (format=gguf; default $EAGLE_LAB_LLAMA_CPP)
  target_outtype=f32|bf16|f16|q8_0   the target GGUF's precision (format=gguf; default f32)
  target_dir=DIR  the target's Hugging Face directory (format=gguf; default: the target's own)
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from omegaconf import OmegaConf
from transformers import AutoConfig

from eagle_lab.drafters.card import read_card, write_card
from eagle_lab.drafters.eagle.layouts import export_head, format_kind, load_head, stored_dtype
from eagle_lab.errors import EagleLabError
from eagle_lab.models import llama_cpp
from eagle_lab.models.device import _DTYPES
from eagle_lab.models.embedded import embedded_dir
from eagle_lab.models.model_shape import ModelShape
from eagle_lab.models.target import SOURCES, TargetConfig
from eagle_lab.models.tiny import build_tiny_model

log = logging.getLogger("eagle_lab.export")
CONF_TARGETS = Path(__file__).resolve().parent / "conf" / "target"
PACKAGED_HEADS = Path(__file__).resolve().parent / "assets" / "heads"  # as in eagle_lab.builders
DEFAULT_TARGET = "smollm2_135m"
KEYS = ("head_path", "format", "out", "target", "dtype", "llama_cpp", "target_outtype", "target_dir")
REQUIRED = ("head_path", "format", "out")
USAGE = "usage: python -m eagle_lab.export head_path=DIR format=eagle3|eagle|gguf out=DIR [target=NAME] [dtype=auto]"


def parse_args(argv: list[str]) -> dict[str, str]:
    args: dict[str, str] = {}
    for item in argv:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key:
            raise EagleLabError(f"argument '{item}' is not key=value ({USAGE})")
        if key not in KEYS:
            raise EagleLabError(f"unknown argument '{key}' (known: {', '.join(KEYS)})")
        args[key] = value
    missing = [k for k in REQUIRED if not args.get(k)]
    if missing:
        raise EagleLabError(f"missing {', '.join(k + '=' for k in missing)} ({USAGE})")
    return args


def _target_from_yaml(path: Path, section: str | None = None):
    raw = OmegaConf.load(path)
    if section is not None:
        raw = raw.get(section)
        if raw is None:
            return None
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TargetConfig), raw))


def target_config(name: str, head_path: Path):
    """target=NAME (conf/target/NAME.yaml or a yaml path), else the head's run's; None if unknown."""
    if name:
        path = Path(name).expanduser()
        if path.suffix in (".yaml", ".yml") and path.is_file():
            return _target_from_yaml(path)
        path = CONF_TARGETS / f"{name}.yaml"
        if not path.is_file():
            known = sorted(p.stem for p in CONF_TARGETS.glob("*.yaml"))
            raise EagleLabError(f"unknown target '{name}' (choose from {', '.join(known) or 'none found'})")
        return _target_from_yaml(path)
    resolved = head_path.parent / "resolved_config.yaml"  # the training run the head came from
    if resolved.is_file():
        cfg = _target_from_yaml(resolved, "target")
        if cfg is not None:
            log.debug("target %s (from %s)", cfg.name, resolved)
            return cfg
    for target_dir in (head_path, head_path.parent):  # assets/heads/<target>/ and assets/heads/<target>/<kind>/
        if (target_dir.resolve().parent == PACKAGED_HEADS.resolve()
                and (CONF_TARGETS / f"{target_dir.name}.yaml").is_file()):
            return _target_from_yaml(CONF_TARGETS / f"{target_dir.name}.yaml")
    return None


class ConfigTarget(ModelShape):
    """What loading and exporting a head need from a target: its config, not its weights."""

    def __init__(self, config, name: str):
        import torch

        self.config, self.name = config, name
        self.device, self.dtype = torch.device("cpu"), torch.float32  # the head is cast back on export


def config_target(cfg) -> ConfigTarget:
    """The target's transformers config; a tiny target is built (milliseconds) for it."""
    if cfg.source not in SOURCES:
        raise EagleLabError(f"unknown target source '{cfg.source}' (choose from {', '.join(SOURCES)})")
    if cfg.source == "tiny":
        return ConfigTarget(build_tiny_model(cfg.tiny).config, cfg.name)
    path = cfg.path
    if cfg.source == "embedded":
        path = str(embedded_dir(cfg.name))
    if not path:
        raise EagleLabError(f"target '{cfg.name}' has source=pretrained but no path")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EagleLabError(f"could not read the config of target '{path}': {first}") from exc
    return ConfigTarget(getattr(config, "text_config", None) or config, cfg.name)


def export(args: dict[str, str]) -> Path:
    gguf = args["format"] == "gguf"
    source = llama_cpp.source_dir(args.get("llama_cpp", "")) if gguf else None
    if gguf and source is None:
        raise EagleLabError(f"format=gguf runs llama.cpp's converter: give llama_cpp=DIR (its source) or set "
                            f"${llama_cpp.ENV}")
    outtype = args.get("target_outtype", "f32") or "f32"
    if gguf and outtype not in llama_cpp.TARGET_OUTTYPES:
        raise EagleLabError(f"target_outtype must be one of {', '.join(llama_cpp.TARGET_OUTTYPES)}, got '{outtype}'")
    if not gguf:
        format_kind(args["format"])
    head_path = Path(args["head_path"]).expanduser()
    out = Path(args["out"]).expanduser()
    if not head_path.is_dir():
        raise EagleLabError(f"head_path '{head_path}' does not exist or is not a directory")
    if out.resolve() == head_path.resolve():
        raise EagleLabError("out= must differ from head_path= (the export would overwrite the head)")
    dtype_name = args.get("dtype", "auto") or "auto"
    if dtype_name != "auto" and dtype_name not in _DTYPES:
        raise EagleLabError(f"unknown dtype '{dtype_name}' (use auto, {', '.join(sorted(_DTYPES))})")
    cfg = target_config(args.get("target", ""), head_path)
    defaulted = cfg is None
    if defaulted:
        cfg = _target_from_yaml(CONF_TARGETS / f"{DEFAULT_TARGET}.yaml")
    target = config_target(cfg)
    try:
        head = load_head(head_path, target)
    except EagleLabError as exc:
        if not defaulted:
            raise
        raise EagleLabError(f"{exc} (no target= given and none recorded next to the head, so "
                            f"{DEFAULT_TARGET} was assumed: pass target=NAME)") from exc
    dtype = stored_dtype(head_path) if dtype_name == "auto" else _DTYPES[dtype_name]
    if gguf:
        return _export_gguf(head, target, cfg, out, dtype, source, outtype, args.get("target_dir", ""))
    written = export_head(head, target, out, args["format"], dtype=dtype)
    card = read_card(head_path)
    if card is not None:  # the card travels with the head, whatever the layout
        write_card(written, card)
    print(f"exported {head.arch.kind} head ({str(dtype).removeprefix('torch.')}) for target {target.name} "
          f"as format={args['format']} -> {written}")
    return written


def _export_gguf(head, target, cfg, out: Path, dtype, source: Path, outtype: str, target_dir: str) -> Path:
    """The head as llama.cpp's EAGLE-3 GGUF plus the target's GGUF, both through llama.cpp's converter."""
    if head.arch.kind != "eagle3":
        raise EagleLabError(f"llama.cpp drafts with EAGLE-3 heads (--spec-type draft-eagle3); this head is "
                            f"{head.arch.kind}: train one with head=eagle3")
    if target_dir:
        model_dir = Path(target_dir).expanduser()
    elif cfg.source == "embedded":
        model_dir = embedded_dir(cfg.name)
    elif cfg.source == "pretrained" and Path(cfg.path).expanduser().is_dir():
        model_dir = Path(cfg.path).expanduser()
    else:
        raise EagleLabError("format=gguf needs the target's Hugging Face directory: give target_dir=DIR")
    if not (model_dir / "config.json").is_file():
        raise EagleLabError(f"target_dir '{model_dir}' is not a model directory (no config.json there)")
    hf_dir = export_head(head, target, out / "head-eagle3", "eagle3", dtype=dtype)
    head_type = "f32" if str(dtype) == "torch.float32" else "bf16"
    head_file = llama_cpp.convert(source, hf_dir, out / "head.gguf", head_type, target_dir=model_dir)
    target_file = llama_cpp.convert(source, model_dir, out / f"target-{outtype}.gguf", outtype)
    print(f"exported eagle3 head for target {target.name} as llama.cpp GGUF -> {head_file} (with {target_file}); "
          f"run: llama-speculative-simple -m {target_file} -md {head_file} --spec-type draft-eagle3")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(__doc__.strip())
        return 0
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="[%(name)s] %(message)s")
    try:
        export(parse_args(argv))
    except EagleLabError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:  # an OmegaConf type check on a target yaml
        from omegaconf.errors import OmegaConfBaseException

        if not isinstance(exc, OmegaConfBaseException):
            raise
        first = str(exc).strip().splitlines()[0]
        print(f"error: bad target configuration: {first}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
