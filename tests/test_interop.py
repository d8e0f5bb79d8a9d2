"""Export to and import from the layouts vLLM, SGLang and the official EAGLE code load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from eagle_lab.drafters.card import HeadCard, read_card, write_card
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.eagle3 import Eagle3Head
from eagle_lab.drafters.eagle.head import EagleHead, HeadArchitecture, save_head
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.eagle.layouts import export_head, import_published, is_published_layout, load_head
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.errors import EagleLabError
from eagle_lab.export import main as export_main

REPO = Path(__file__).resolve().parent.parent


def expected_shapes(arch: HeadArchitecture) -> dict[str, tuple[int, ...]]:
    """The published key set and shapes for a head of this architecture."""
    h, q, kv, i = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, \
        arch.intermediate_size
    eagle3 = arch.kind == "eagle3"
    attn_in = 2 * h if eagle3 else h
    prefix = "midlayer." if eagle3 else "layers.0."
    layer = {"self_attn.q_proj.weight": (q, attn_in), "self_attn.k_proj.weight": (kv, attn_in),
             "self_attn.v_proj.weight": (kv, attn_in), "self_attn.o_proj.weight": (h, q),
             "post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (i, h),
             "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    if arch.attention_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if eagle3:
        layer.update({"input_layernorm.weight": (h,), "hidden_norm.weight": (h,)})
    shapes = {prefix + k: v for k, v in layer.items()}
    if eagle3:
        shapes.update({"fc.weight": (h, len(arch.feature_layers) * h), "norm.weight": (h,),
                       "lm_head.weight": (arch.draft_vocab_size, h), "d2t": (arch.draft_vocab_size,),
                       "t2d": (arch.vocab_size,)})
    else:
        shapes.update({"fc.weight": (h, 2 * h), "fc.bias": (h,)})
    return shapes


def drafts(head: EagleHead, target, seeds=(0, 1, 2)) -> list[tuple[list[int], list[int]]]:
    """Draft trees (tokens, parents) after a prefill of a few random sequences."""
    drafter = EagleDrafter(head, target, TreeShape(4, 3, 10))
    out = []
    for seed in seeds:
        ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(seed))
        drafter.reset()
        scored = target.forward(ids[None], layer_ids=tuple(head.arch.feature_layers))
        features = scored.layer_features if head.arch.feature_layers else scored.features  # [1, T, F]
        tree = drafter.draft(ids, features[0, :-1], max_depth=4)
        out.append((tree.tokens.tolist(), tree.parents.tolist()))
    return out


def assert_same_head(a: EagleHead, b: EagleHead) -> None:
    assert type(a) is type(b) and a.arch == b.arch
    state_b = b.state_dict()
    assert set(a.state_dict()) == set(state_b)
    for key, value in a.state_dict().items():
        assert torch.equal(value, state_b[key]), key


def test_export_eagle3_layout_and_round_trip(tiny_target, tmp_path):
    draft_ids = torch.arange(3, 259, 3)  # a reduced draft vocabulary that skips token 0
    head = new_head(tiny_target, kind="eagle3", draft_vocab_ids=draft_ids, seed=4)
    out = export_head(head, tiny_target, tmp_path / "e3", "eagle3")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    state = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_shapes(head.arch)
    assert not any("embed" in k for k in state)
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(draft_ids.numel()) + state["d2t"], draft_ids)
    assert torch.equal(state["t2d"].nonzero().flatten(), draft_ids)
    assert torch.equal(state["lm_head.weight"], head.lm_head.weight)

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == draft_ids.numel()
    assert config["vocab_size"] == tiny_target.vocab_size and config["hidden_size"] == tiny_target.hidden_size
    assert config["max_position_embeddings"] >= tiny_target.max_context
    assert config["attention_bias"] == (tiny_target.model_type == "qwen2")
    for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "rope_theta", "hidden_act", "tie_word_embeddings", "torch_dtype"):
        assert key in config, key
    hf = AutoConfig.from_pretrained(out)  # a valid Llama config for the engines' loaders
    assert hf.model_type == "llama" and hf.draft_vocab_size == draft_ids.numel()

    assert is_published_layout(out)
    imported = import_published(out, tiny_target)
    assert isinstance(imported, Eagle3Head) and not imported.training
    assert_same_head(head, imported)
    assert drafts(imported, tiny_target) == drafts(head, tiny_target)


def test_export_eagle2_layout_and_round_trip(tiny_target, tmp_path):
    head = new_head(tiny_target, kind="eagle2", seed=6)
    out = export_head(head, tiny_target, tmp_path / "e2", "eagle")
    state = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_shapes(head.arch)
    assert not any(k.startswith("layers.0.input_layernorm") or "embed" in k for k in state)
    assert torch.equal(state["fc.bias"], head.fc.bias)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert "draft_vocab_size" not in config  # EAGLE-1/2 draft over the full vocabulary
    imported = load_head(out, tiny_target)
    assert type(imported) is EagleHead
    assert_same_head(head, imported)
    assert drafts(imported, tiny_target) == drafts(head, tiny_target)


def test_export_keeps_rope_scaling_aux_layers_and_dtype(tiny_llama, tmp_path):
    arch = HeadArchitecture.for_target(tiny_llama, kind="eagle3", draft_vocab_size=50, feature_layers=(0, 1, 2))
    torch.manual_seed(0)
    head = Eagle3Head(arch)
    head.draft_to_target.copy_(torch.arange(0, 250, 5))
    target_config = tiny_llama.config.to_dict()
    target_config["max_position_embeddings"] = 131072
    target_config["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                        "rope_theta": 500000.0}
    out = export_head(head, target_config, tmp_path / "e3", "eagle3", dtype=torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 500000.0 and config["rope_scaling"]["rope_type"] == "llama3"
    assert config["max_position_embeddings"] == 131072 and config["torch_dtype"] == "bfloat16"
    # non-default fused layers, written as vLLM (hidden_states indices) and SGLang (layer outputs) read them
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 0, 1]
    assert AutoConfig.from_pretrained(out).rope_parameters["rope_type"] == "llama3"
    state = load_file(str(out / "model.safetensors"))
    assert state["fc.weight"].dtype == torch.bfloat16 and state["d2t"].dtype == torch.int64
    assert import_published(out, tiny_llama).arch.feature_layers == [0, 1, 2]
    del config["eagle_aux_hidden_state_layer_ids"]  # SGLang/SpecForge style only
    (out / "config.json").write_text(json.dumps(config))
    assert import_published(out, tiny_llama).arch.feature_layers == [0, 1, 2]


def test_export_refuses_the_other_format(tiny_llama, tmp_path):
    with pytest.raises(EagleLabError, match="use format=eagle3"):
        export_head(new_head(tiny_llama, kind="eagle3"), tiny_llama, tmp_path / "a", "eagle")
    with pytest.raises(EagleLabError, match="use format=eagle$"):
        export_head(new_head(tiny_llama, kind="eagle2"), tiny_llama, tmp_path / "b", "eagle3")


# ---------------------------------------------------------------- hand-made published checkpoints


def published_eagle3(target, vocab_ids: torch.Tensor, hidden: int | None = None, seed: int = 0) -> tuple[dict, dict]:
    """(config, tensors) in the layout of e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, random weights."""
    g = torch.Generator().manual_seed(seed)
    c = target.config
    h = hidden or c.hidden_size
    heads, kv_heads, inter = c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    d = h // heads
    v, vd = target.vocab_size, vocab_ids.numel()

    def w(*shape, scale=0.15):
        return torch.randn(*shape, generator=g) * scale

    tensors = {
        "fc.weight": w(h, 3 * h, scale=0.01), "norm.weight": 1 + w(h), "lm_head.weight": w(vd, h, scale=0.5),
        "embed_tokens.weight": w(v, h),  # some published heads carry it; the target's is used
        "midlayer.input_layernorm.weight": 1 + w(h), "midlayer.hidden_norm.weight": 1 + w(h),
        "midlayer.post_attention_layernorm.weight": 1 + w(h),
        "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * d),
        "midlayer.mlp.gate_proj.weight": w(inter, h), "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "d2t": vocab_ids - torch.arange(vd), "t2d": torch.zeros(v, dtype=torch.bool).index_fill(0, vocab_ids, True),
    }
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "bos_token_id": 128000,
              "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": h, "initializer_range": 0.02,
              "intermediate_size": inter, "max_position_embeddings": 2048, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1",
              "use_cache": True, "vocab_size": v, "draft_vocab_size": vd}
    return config, tensors


def write_checkpoint(directory: Path, config: dict, tensors: dict, weights: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if weights.endswith(".bin"):
        torch.save(tensors, directory / weights)
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / weights))
    return directory


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_first_logits(tensors: dict, config: dict, target, ids: torch.Tensor, features: torch.Tensor):
    """The published EAGLE-3 forward written from the checkpoint alone: draft logits [Vd] after
    the prefill pairs (features[t], ids[t + 1])."""
    eps, h = config["rms_norm_eps"], config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = h // heads
    p = features.shape[0]
    embeds = target.embed_tokens(ids[1:])  # [P, H]
    fused = features @ tensors["fc.weight"].T  # [P, H]
    x = torch.cat([rms(embeds, tensors["midlayer.input_layernorm.weight"], eps),
                   rms(fused, tensors["midlayer.hidden_norm.weight"], eps)], dim=-1)  # [P, 2H]
    cos, sin = target.backbone.rotary_emb(embeds[None], torch.arange(p)[None])  # [1, P, D]

    def rotate(t):  # [n, P, D]
        first, second = t.chunk(2, dim=-1)
        return t * cos + torch.cat([-second, first], dim=-1) * sin

    q = rotate((x @ tensors["midlayer.self_attn.q_proj.weight"].T).view(p, heads, d).transpose(0, 1))
    k = rotate((x @ tensors["midlayer.self_attn.k_proj.weight"].T).view(p, kv_heads, d).transpose(0, 1))
    v = (x @ tensors["midlayer.self_attn.v_proj.weight"].T).view(p, kv_heads, d).transpose(0, 1)
    k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(p, -1)
    hidden = fused + attn @ tensors["midlayer.self_attn.o_proj.weight"].T
    post = rms(hidden, tensors["midlayer.post_attention_layernorm.weight"], eps)
    mlp = F.silu(post @ tensors["midlayer.mlp.gate_proj.weight"].T) * (post @ tensors["midlayer.mlp.up_proj.weight"].T)
    hidden = hidden + mlp @ tensors["midlayer.mlp.down_proj.weight"].T
    return rms(hidden[-1], tensors["norm.weight"], eps) @ tensors["lm_head.weight"].T  # [Vd]


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_published_eagle3_checkpoint_loads_and_drafts(tiny_llama, tmp_path, weights):
    vocab_ids = torch.randperm(259, generator=torch.Generator().manual_seed(1))[:90].sort().values
    config, tensors = published_eagle3(tiny_llama, vocab_ids)
    directory = write_checkpoint(tmp_path / "EAGLE3-tiny", config, tensors, weights)
    assert is_published_layout(directory)
    head = import_published(directory, tiny_llama)
    assert isinstance(head, Eagle3Head) and head.arch.kind == "eagle3"
    assert head.arch.feature_layers == [1, 1, 0]  # the engines' default (2, L // 2, L - 3) for L = 2
    assert head.arch.target_model_type == tiny_llama.model_type
    assert torch.equal(head.draft_to_target, vocab_ids)

    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(7))
    features = tiny_llama.forward(ids[None], layer_ids=tuple(head.arch.feature_layers)).layer_features[0, :-1]
    tree = EagleDrafter(head, tiny_llama, TreeShape(4, 3, 10)).draft(ids, features, max_depth=4)
    assert tree.size == 11 and set(tree.tokens[1:].tolist()) <= set(vocab_ids.tolist())
    # the root's children are the top 3 of the published forward, mapped through d2t
    logits = reference_first_logits(tensors, config, tiny_llama, ids, features)
    top = vocab_ids[logits.topk(3).indices]
    first_level = EagleDrafter(head, tiny_llama, TreeShape(1, 3, 3)).draft(ids, features, max_depth=1)
    assert set(first_level.tokens[1:].tolist()) == set(top.tolist())


def test_published_eagle2_checkpoint_loads_and_drafts(tiny_llama, tmp_path):
    reference = new_head(tiny_llama, kind="eagle2", seed=9)
    tensors = {("layers.0." + k[len("layer."):] if k.startswith("layer.") else k): v.clone()
               for k, v in reference.state_dict().items() if k != "draft_to_target"}
    tensors["embed_tokens.weight"] = torch.randn(tiny_llama.vocab_size, tiny_llama.hidden_size)
    tensors["layers.0.self_attn.rotary_emb.inv_freq"] = torch.rand(8)  # as transformers 4.28 saved it
    c = tiny_llama.config
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
              "vocab_size": tiny_llama.vocab_size, "max_position_embeddings": 2048, "torch_dtype": "float16"}
    directory = write_checkpoint(tmp_path / "EAGLE-tiny", config, tensors, "pytorch_model.bin")
    head = import_published(directory, tiny_llama)
    assert type(head) is EagleHead
    assert_same_head(reference, head)
    assert drafts(head, tiny_llama) == drafts(reference, tiny_llama)


def test_mismatched_published_heads_are_refused(tiny_llama, tmp_path):
    vocab_ids = torch.arange(0, 259, 2)
    config, tensors = published_eagle3(tiny_llama, vocab_ids, hidden=32)
    wrong = write_checkpoint(tmp_path / "wrong_hidden", config, tensors, "model.safetensors")
    with pytest.raises(EagleLabError, match="hidden size 32 != target's 64"):
        import_published(wrong, tiny_llama)

    config, tensors = published_eagle3(tiny_llama, vocab_ids)
    missing = dict(tensors)
    del missing["midlayer.hidden_norm.weight"]
    with pytest.raises(EagleLabError, match="missing midlayer.hidden_norm.weight"):
        import_published(write_checkpoint(tmp_path / "missing", config, missing, "model.safetensors"), tiny_llama)
    extra = dict(tensors, **{"midlayer.extra.weight": torch.zeros(3)})
    with pytest.raises(EagleLabError, match="unexpected midlayer.extra.weight"):
        import_published(write_checkpoint(tmp_path / "extra", config, extra, "model.safetensors"), tiny_llama)
    with pytest.raises(EagleLabError, match="no weights"):
        import_published(write_checkpoint(tmp_path / "noweights", config, {}, "x.txt"), tiny_llama)
    full = dict(config, num_hidden_layers=32, architectures=["LlamaForCausalLM"])
    with pytest.raises(EagleLabError, match="32-layer model, not an EAGLE head"):
        import_published(write_checkpoint(tmp_path / "full", full, tensors, "model.safetensors"), tiny_llama)
    # our own head directories are not published layouts
    assert not is_published_layout(save_head(new_head(tiny_llama), tmp_path / "ours"))


# ---------------------------------------------------------------- the CLI


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "eagle_lab.export", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_cli_exports_and_refuses_with_one_line(tiny_llama, tmp_path):
    head = new_head(tiny_llama, kind="eagle3", draft_vocab_ids=torch.arange(0, 259, 4), seed=3)
    head_dir = save_head(head, tmp_path / "run" / "head")
    write_card(head_dir, HeadCard(target="tiny_llama", kind="eagle3", steps=7))
    done = run_cli(f"head_path={head_dir}", "format=eagle3", f"out={tmp_path / 'exported'}", "target=tiny_llama")
    assert done.returncode == 0, done.stderr
    assert "exported eagle3 head" in done.stdout
    assert read_card(tmp_path / "exported").steps == 7  # the card travels with the head
    imported = import_published(tmp_path / "exported", tiny_llama)
    assert_same_head(head, imported)

    refused = run_cli(f"head_path={head_dir}", "format=eagle", f"out={tmp_path / 'no'}", "target=tiny_llama")
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "format=eagle3" in lines[0], refused.stderr
    assert not (tmp_path / "no").exists()


def test_cli_argument_errors_and_target_from_run(tiny_llama, tmp_path, capsys):
    assert export_main(["head_path=x", "format=eagle3"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: missing out=")
    assert export_main(["head_path=x", "format=eagle3", "out=y", "colour=blue"]) == 2
    assert "unknown argument 'colour'" in capsys.readouterr().err
    assert export_main(["head_path=x", "format=onnx", "out=y"]) == 2
    assert "unknown export format 'onnx'" in capsys.readouterr().err

    head = new_head(tiny_llama, kind="eagle2", seed=2)
    head_dir = save_head(head, tmp_path / "run" / "head")
    assert export_main([f"head_path={head_dir}", "format=eagle", "out=y", "target=nope"]) == 2
    assert "unknown target 'nope' (choose from" in capsys.readouterr().err
    # no target=: taken from the training run's resolved_config.yaml next to the head
    (tmp_path / "run" / "resolved_config.yaml").write_text("target:\n  name: tiny_llama\n  source: tiny\n")
    assert export_main([f"head_path={head_dir}", "format=eagle", f"out={tmp_path / 'e2'}"]) == 0
    assert "for target tiny_llama" in capsys.readouterr().out
    assert_same_head(head, import_published(tmp_path / "e2", tiny_llama))


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_a_wider_head_mlp_round_trips_and_drafts_losslessly(tiny_llama, tmp_path, kind):
    from eagle_lab.decoding.generate import Stopper, generate, speculative_decode, vanilla_decode
    from eagle_lab.decoding.sampling import SamplingParams

    width = 2 * tiny_llama.config.intermediate_size
    head = new_head(tiny_llama, kind=kind, seed=4, intermediate_size=width)
    assert head.arch.intermediate_size == width and head.layer.mlp.gate_proj.weight.shape[0] == width
    for saved in (save_head(head, tmp_path / "native"), export_head(head, tiny_llama, tmp_path / "published",
                                                                     "eagle3" if kind == "eagle3" else "eagle")):
        loaded = load_head(saved, tiny_llama)
        assert loaded.arch.intermediate_size == width
        assert_same_head(head, loaded)
    prompt = torch.arange(3, 19)
    stop = Stopper(tiny_llama.tokenizer, 24, set())
    plain = generate(vanilla_decode(tiny_llama, prompt, SamplingParams(), stop))
    drafter = EagleDrafter(head, tiny_llama, TreeShape(depth=3, topk=2, total_tokens=6))
    spec = generate(speculative_decode(tiny_llama, drafter, prompt, SamplingParams(), Stopper(tiny_llama.tokenizer, 24,
                                                                                              set())))
    assert spec.token_ids == plain.token_ids
    with pytest.raises(EagleLabError, match="intermediate_size must be >= 0"):
        new_head(tiny_llama, kind=kind, intermediate_size=-1)
