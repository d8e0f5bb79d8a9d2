"""Heads in the layouts serving engines load (vLLM, SGLang, the official EAGLE code), both ways.

EAGLE-3 (`architectures: ["LlamaForCausalLMEagle3"]`): a one-layer Llama config plus
`draft_vocab_size`, and weights
    fc.weight [H, n*H]                      (no bias)
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight
    midlayer.self_attn.{q,k,v,o}_proj.weight (q/k/v take the 2H-wide [embed; hidden] input)
    midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight, lm_head.weight [Vd, H]
    d2t [Vd] int64 (target id - draft id), t2d [V] bool (target ids in the draft vocabulary)
EAGLE-1/2 (`architectures: ["LlamaForCausalLM"]`, one layer): `fc.weight` [H, 2H] over
[embed; feature], `fc.bias`, and `layers.0.*` without an input norm; the full vocabulary.
Neither carries the token embedding (the target's is used); one found on import is skipped.
Targets with attention bias (Qwen2) add `{midlayer,layers.0}.self_attn.{q,k,v}_proj.bias`.

Which target layers an EAGLE-3 head fuses: engines default to (2, L//2, L-3) as Hugging
Face `hidden_states` indices, our convention too. Other choices are written both ways the
engines read them: top-level `eagle_aux_hidden_state_layer_ids` (vLLM: hidden-state indices)
and `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang/SpecForge: indices of the layers
whose *output* is taken, one less).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle_lab.drafters.eagle.eagle3 import eagle3_layer_ids
from eagle_lab.drafters.eagle.head import CONFIG_NAME, WEIGHTS_NAME, EagleHead, HeadArchitecture
from eagle_lab.drafters.eagle.kinds import head_class, load_native_head
from eagle_lab.errors import EagleLabError

log = logging.getLogger(__name__)

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
EAGLE2_ARCHITECTURE = "LlamaForCausalLM"
FORMATS = {"eagle3": "eagle3", "eagle": "eagle2", "eagle2": "eagle2", "eagle1": "eagle2"}  # format -> head kind
LAYER_PREFIX = {"eagle3": "midlayer.", "eagle2": "layers.0."}  # published name of our `layer.`
IGNORED_ON_IMPORT = ("embed_tokens.weight",)  # we draft with the target's embeddings
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # saved by old transformers; we use the target's rotary
BIN_NAME = "pytorch_model.bin"
AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"


# ---------------------------------------------------------------- export


def format_kind(fmt: str) -> str:
    if fmt not in FORMATS:
        raise EagleLabError(f"unknown export format '{fmt}' (choose eagle3 or eagle)")
    return FORMATS[fmt]


def _config_dict(target_or_config) -> dict:
    """A Target, a transformers config or a plain dict -> the target's config as a dict."""
    config = getattr(target_or_config, "config", target_or_config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if isinstance(config, dict):
        return dict(config)
    raise EagleLabError(f"need a target or its config to export a head, got {type(target_or_config).__name__}")


def _rope(tcfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a transformers v4 (`rope_theta`, `rope_scaling`) or v5
    (`rope_parameters`) config dict."""
    params = tcfg.get("rope_parameters")
    params = params if isinstance(params, dict) and "rope_theta" in params else {}
    theta = float(params.get("rope_theta", tcfg.get("rope_theta", 10000.0)))
    scaling = tcfg.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return theta, scaling


def published_config(arch: HeadArchitecture, target_or_config, dtype: torch.dtype) -> dict:
    """The config.json engines read for this head: a one-layer Llama plus draft fields."""
    tcfg = _config_dict(target_or_config)
    eagle3 = arch.kind == "eagle3"
    theta, scaling = _rope(tcfg)
    config = {
        "architectures": [EAGLE3_ARCHITECTURE if eagle3 else EAGLE2_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": theta,
        # at least the target's context: the engines size the draft's rotary table from it
        "max_position_embeddings": int(tcfg.get("max_position_embeddings") or 4096),
        "vocab_size": arch.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": arch.attention_bias,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if scaling is not None:
        config["rope_scaling"] = scaling
    if eagle3 or arch.draft_vocab_size != arch.vocab_size:
        config["draft_vocab_size"] = arch.draft_vocab_size
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if tcfg.get(key) is not None:
            config[key] = tcfg[key]
    if eagle3:  # always written: engines derive a default of their own where it is missing, which can differ
        layers = [int(i) for i in arch.feature_layers]
        config[AUX_LAYERS_KEY] = layers
        config["eagle_config"] = {AUX_LAYERS_KEY: [i - 1 for i in layers]}
    return config


def published_state_dict(head: EagleHead, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Our parameter names -> the engines' (`layer.` -> `midlayer.` / `layers.0.`), plus d2t/t2d."""
    arch = head.arch
    prefix = LAYER_PREFIX[arch.kind]
    out = {}
    for name, value in head.state_dict().items():
        if name == "draft_to_target":
            continue
        if name.startswith("layer."):
            name = prefix + name[len("layer."):]
        value = value.detach().cpu()
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        out[name] = value.contiguous().clone()
    if arch.kind == "eagle3" or head.reduced_vocab:
        ids = head.draft_to_target.detach().cpu().long()  # [Vd] target ids
        out["d2t"] = ids - torch.arange(ids.numel(), dtype=torch.long)  # target = draft + d2t[draft]
        t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
    return out


def export_head(head: EagleHead, target_or_config, out_dir: str | Path, fmt: str,
                dtype: torch.dtype | None = None) -> Path:
    """Write `head` as `config.json` + `model.safetensors` in the engines' layout.

    fmt: eagle3 (LlamaForCausalLMEagle3) or eagle (EAGLE-1/2); dtype: None keeps the head's.
    """
    kind = format_kind(fmt)
    arch = head.arch
    if arch.kind != kind:
        other = "eagle3" if arch.kind == "eagle3" else "eagle"
        raise EagleLabError(f"format={fmt} writes {kind} heads but this head is {arch.kind}: use format={other}")
    tcfg = _config_dict(target_or_config)
    if tcfg.get("hidden_size") not in (None, arch.hidden_size):
        raise EagleLabError(f"head hidden size {arch.hidden_size} != target's {tcfg['hidden_size']}: "
                            f"wrong target for this head")
    if kind == "eagle2" and head.reduced_vocab:
        log.warning("this EAGLE-2 head drafts over %d of %d tokens: the export adds d2t/t2d and "
                    "draft_vocab_size, which eagle_lab reads but EAGLE-1/2 engines do not expect",
                    arch.draft_vocab_size, arch.vocab_size)
    dtype = dtype or next(p.dtype for p in head.parameters())
    state = published_state_dict(head, dtype)
    config = published_config(arch, tcfg, dtype)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / (WEIGHTS_NAME + ".tmp")), metadata={"format": "pt"})
    (out / (CONFIG_NAME + ".tmp")).write_text(json.dumps(config, indent=2) + "\n")
    (out / (WEIGHTS_NAME + ".tmp")).replace(out / WEIGHTS_NAME)
    (out / (CONFIG_NAME + ".tmp")).replace(out / CONFIG_NAME)
    if (out / BIN_NAME).exists():
        log.warning("%s also holds an older %s; loaders prefer %s", out, BIN_NAME, WEIGHTS_NAME)
    return out


# ---------------------------------------------------------------- import


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_eagle_lab_config(config: dict) -> bool:
    return "kind" in config and "target_model_type" in config


def is_published_layout(directory: str | Path) -> bool:
    """A config.json that is a model config (has hidden_size) but not an eagle_lab head config."""
    config = _read_json(Path(directory).expanduser() / CONFIG_NAME)
    return config is not None and not is_eagle_lab_config(config) and "hidden_size" in config


def weight_files(directory: Path) -> list[Path]:
    """model.safetensors, else pytorch_model.bin, else the shards an index names, else any."""
    for name in (WEIGHTS_NAME, BIN_NAME):
        if (directory / name).is_file():
            return [directory / name]
    for index_name in (WEIGHTS_NAME + ".index.json", BIN_NAME + ".index.json"):
        index = _read_json(directory / index_name)
        if index and isinstance(index.get("weight_map"), dict):
            return [directory / f for f in sorted(set(index["weight_map"].values()))]
    return sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))


def _load_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            if path.suffix == ".safetensors":
                part = load_file(str(path))
            else:
                part = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as exc:  # corrupt file, pickle with code in it, ...
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise EagleLabError(f"could not read head weights {path}: {first}") from exc
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise EagleLabError(f"head weights {path} are not a flat name -> tensor dict")
        state.update(part)
    return state


def stored_dtype(directory: str | Path) -> torch.dtype | None:
    """The dtype a head's fc weight is stored in (to export it without changing precision)."""
    directory = Path(directory).expanduser()
    files = weight_files(directory)
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as handle:
                if "fc.weight" in handle.keys():  # noqa: SIM118 (safe_open handles have no __contains__)
                    return handle.get_slice("fc.weight")[:1].dtype
        else:
            state = _load_weights([path])
            if "fc.weight" in state:
                return state["fc.weight"].dtype
    return None


def _aux_layers(config: dict, num_layers: int) -> list[int]:
    """Fused target layers as hidden_states indices (see the module docstring)."""

    top = config.get(AUX_LAYERS_KEY)
    if isinstance(top, list) and top:
        return [int(i) for i in top]
    nested = config.get("eagle_config")
    if isinstance(nested, dict) and isinstance(nested.get(AUX_LAYERS_KEY), list) and nested[AUX_LAYERS_KEY]:
        return [int(i) + 1 for i in nested[AUX_LAYERS_KEY]]
    return list(eagle3_layer_ids(num_layers))


def _published_name(ours: str, kind: str) -> str:
    if ours == "draft_to_target":
        return "d2t"
    return LAYER_PREFIX[kind] + ours[len("layer."):] if ours.startswith("layer.") else ours


def import_published(directory: str | Path, target) -> EagleHead:
    """Load a head in the vLLM/SGLang/EAGLE layout (e.g. a downloaded EAGLE3-LLaMA3.1-Instruct-8B)
    for `target`; returns it on the target's device and dtype, in eval mode."""
    directory = Path(directory).expanduser()
    where = f"head path '{directory}'"
    if not directory.is_dir():
        raise EagleLabError(f"{where} does not exist or is not a directory")
    config = _read_json(directory / CONFIG_NAME)
    if config is None:
        raise EagleLabError(f"{where} has no readable {CONFIG_NAME}")
    layers = config.get("num_hidden_layers", 1)
    if layers != 1:
        raise EagleLabError(f"{where} holds a {layers}-layer model, not an EAGLE head (one layer)")
    files = weight_files(directory)
    if not files:
        raise EagleLabError(f"{where} has no weights ({WEIGHTS_NAME} or {BIN_NAME})")
    state = _load_weights(files)

    architectures = config.get("architectures") or []
    kind = "eagle3" if EAGLE3_ARCHITECTURE in architectures or any(k.startswith("midlayer.") for k in state) \
        else "eagle2"
    prefix = LAYER_PREFIX[kind]
    ours: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if name in IGNORED_ON_IMPORT or name.endswith(IGNORED_SUFFIXES) or name in ("d2t", "t2d"):
            continue
        ours["layer." + name[len(prefix):] if name.startswith(prefix) else name] = value

    if "fc.weight" not in ours:
        raise EagleLabError(f"{where}: weights have no fc.weight; not an EAGLE head")
    hidden = config.get("hidden_size")
    heads = config.get("num_attention_heads")
    if not isinstance(hidden, int) or not isinstance(heads, int):
        raise EagleLabError(f"{where}: {CONFIG_NAME} needs hidden_size and num_attention_heads")
    if config.get("target_hidden_size") not in (None, hidden):
        raise EagleLabError(f"{where}: draft hidden size {hidden} differs from target_hidden_size "
                            f"{config['target_hidden_size']}; eagle_lab heads use the target's hidden size")
    vocab = config.get("vocab_size") or target.vocab_size
    if kind == "eagle3":
        draft_vocab = ours["lm_head.weight"].shape[0] if "lm_head.weight" in ours else \
            int(config.get("draft_vocab_size") or vocab)
        feature_layers = _aux_layers(config, target.num_layers)
    else:
        draft_vocab = state["d2t"].numel() if "d2t" in state else int(config.get("draft_vocab_size") or vocab)
        feature_layers = []
    reference = HeadArchitecture.for_target(target)
    arch = HeadArchitecture(
        kind=kind,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        intermediate_size=int(config.get("intermediate_size") or _rows(ours, "layer.mlp.gate_proj.weight", where)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        attention_bias="layer.self_attn.q_proj.bias" in ours,
        vocab_size=int(vocab),
        draft_vocab_size=int(draft_vocab),
        target_model_type=target.model_type,  # published configs say "llama" whatever the target
        feature_layers=feature_layers,
    )
    arch.check_matches(target)
    if arch.head_dim != reference.head_dim:
        raise EagleLabError(f"{where}: head_dim {arch.head_dim} != target's {reference.head_dim} "
                            f"(the head uses the target's rotary tables)")
    if any(not 0 <= i <= target.num_layers for i in feature_layers):
        raise EagleLabError(f"{where}: fused layers {feature_layers} outside the target's "
                            f"0..{target.num_layers} hidden states")
    fc_in = ours["fc.weight"].shape[-1]
    expected_in = hidden * (len(feature_layers) if kind == "eagle3" else 2)
    if fc_in != expected_in:
        what = f"{len(feature_layers)} fused layers {feature_layers}" if kind == "eagle3" else "[embed; feature]"
        raise EagleLabError(f"{where}: fc takes {fc_in} inputs but {what} give {expected_in}")
    _check_rope(config, target, where)

    ours["draft_to_target"] = _draft_to_target(state, arch, where)
    if kind == "eagle2" and "fc.bias" not in ours:  # a bias-free fc is a zero bias
        ours["fc.bias"] = torch.zeros(hidden)
    head = head_class(kind)(arch)
    expected = set(head.state_dict())
    missing, extra = sorted(expected - set(ours)), sorted(set(ours) - expected)
    if missing or extra:
        parts = ([f"missing {', '.join(_published_name(k, kind) for k in missing)}"] if missing else []) + \
                ([f"unexpected {', '.join(_published_name(k, kind) for k in extra)}"] if extra else [])
        raise EagleLabError(f"{where}: weights do not fit a {kind} head: " + "; ".join(parts))
    try:
        head.load_state_dict(ours)
    except RuntimeError as exc:
        lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
        raise EagleLabError(f"{where}: weights do not fit its config: {lines[-1] if lines else exc}") from exc
    log.info("imported %s head from %s (draft vocab %d, fused layers %s)", kind, directory,
             arch.draft_vocab_size, feature_layers or "top")
    return head.to(device=target.device, dtype=target.dtype).eval()


def _rows(state: dict, name: str, where: str) -> int:
    if name not in state:
        raise EagleLabError(f"{where}: no intermediate_size in the config and no {name} to read it from")
    return state[name].shape[0]


def _draft_to_target(state: dict, arch: HeadArchitecture, where: str) -> torch.Tensor:
    vd, v = arch.draft_vocab_size, arch.vocab_size
    if "d2t" not in state:
        if vd != v:
            raise EagleLabError(f"{where}: draft vocabulary {vd} < {v} but no d2t map in the weights")
        return torch.arange(vd)
    d2t = state["d2t"].long().flatten()
    if d2t.numel() != vd:
        raise EagleLabError(f"{where}: d2t has {d2t.numel()} entries, draft vocabulary is {vd}")
    ids = torch.arange(vd) + d2t
    if vd and (int(ids.min()) < 0 or int(ids.max()) >= v or ids.unique().numel() != vd):
        raise EagleLabError(f"{where}: d2t maps draft ids outside the {v}-token vocabulary or twice")
    t2d = state.get("t2d")
    if t2d is not None and t2d.numel() != v:
        raise EagleLabError(f"{where}: t2d covers {t2d.numel()} tokens, the target has {v}")
    return ids


def _check_rope(config: dict, target, where: str) -> None:
    theirs, _ = _rope(config)
    ours, _ = _rope(_config_dict(target))
    if ("rope_theta" in config or "rope_parameters" in config) and abs(theirs - ours) > 1e-6 * max(abs(ours), 1.0):
        log.warning("%s: rope_theta %g != target's %g; drafting uses the target's", where, theirs, ours)


def load_head(directory: str | Path, target) -> EagleHead:
    """Our own head directory or a published layout (vLLM / SGLang / EAGLE, e.g. a downloaded EAGLE-3
    head), whichever `directory` holds."""
    if Path(directory).expanduser().is_dir() and is_published_layout(directory):
        return import_published(directory, target)
    return load_native_head(directory, target)
