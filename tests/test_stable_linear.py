"""The row-stable CPU kernel behind every target.weights precision: each layer multiplies by the weight it
claims to hold, every row on its own (a forward over N tokens gives each token bitwise what a one-token forward
gives), GGUF grids come back bitwise, and decoding over it is lossless against plain decoding of the same
weights: greedy token for token on every family and precision, sampling in distribution (chi-square), eager
and compiled."""

import pytest
import torch
from torch import nn

from eagle_lab.decoding.backend import EagerBackend, StaticBackend
from eagle_lab.decoding.generate import Stopper, generate, speculative_decode, vanilla_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.errors import EagleLabError
from eagle_lab.models.native import library_path
from eagle_lab.models.stable_linear import (
    FORMATS,
    GROUP,
    WEIGHTS,
    FusedProjections,
    ProjectionPart,
    StableLinear,
    convert_linears,
    fit_q4_1,
    fit_q8_0,
    kernels_available,
)
from eagle_lab.models.target import Target, TargetConfig, load_target
from eagle_lab.models.tiny import TinyModelConfig, build_tiny_model
from tests.conftest import FAMILIES, NoisyDrafter, OracleDrafter, small_vocab_target
from tests.test_sampling_lossless import ALPHA, chi_square_pvalue, exact_sequence_probs, sampled_sequences

pytestmark = pytest.mark.skipif(not kernels_available()[0], reason=f"no C++ kernels here: {kernels_available()[1]}")
STORAGES = ("f32", "bf16", "q8_0", "q4_1", "q8_0x8", "q4_1x8")
GREEDY = SamplingParams()
# how far each storage's weight may sit from the original, relative to the largest weight
STORAGE_ERROR = {"f32": 0.0, "bf16": 2.0 ** -8, "q8_0": 1 / 127, "q4_1": 1 / 15, "q8_0x8": 1 / 127, "q4_1x8": 1 / 15}
WEIGHT_OF = {"q8_0x8": "q8_0", "q4_1x8": "q4_1"}  # int8-activation storages hold the weights of these


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the int8-activation storages see it: each row's groups of 32 rounded to 255 levels
    (q = round(x / d), d = max|x| / 127), as float32 q * d."""
    groups = x.reshape(*x.shape[:-1], -1, GROUP)  # [..., K/32, 32]
    d = groups.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return ((groups * inverse).round() * d).reshape(x.shape)


def linear(out_features=100, in_features=128, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    nn.init.normal_(layer.weight, std=0.05)
    return layer


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("storage", STORAGES)
def test_a_layer_multiplies_by_the_weight_it_holds(storage, bias):
    dense = linear(bias=bias)  # 100 outputs: the last panel of 16 columns is partly padding
    layer = StableLinear(dense, storage)
    held = StableLinear(dense, WEIGHT_OF.get(storage, storage)).dequantized()  # [100, 128]
    x = torch.randn(5, 3, 128)
    seen = quantized_rows(x) if storage in WEIGHT_OF else x  # what the layer multiplies
    reference = seen @ held.t() + (dense.bias if bias else 0)  # [5, 3, 100]
    out = layer(x)
    assert out.shape == (5, 3, 100) and out.dtype == torch.float32
    assert (out - reference).abs().max() <= 1e-5 * reference.abs().max()  # float32 sums in another order
    error = (held - dense.weight).abs().max() / dense.weight.abs().max()
    assert error <= STORAGE_ERROR[storage] + 1e-7


@pytest.mark.parametrize("storage", STORAGES)
def test_every_row_is_computed_on_its_own(storage):
    """Bitwise: whatever the number of rows (one block of 8, or more), a row's sums are the same."""
    layer = StableLinear(linear(), storage)
    x = torch.randn(20, 128)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(20)])
    for rows in (2, 4, 5, 8, 9, 13, 16, 20):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    strided = torch.randn(128, 6).t()  # not contiguous
    assert torch.equal(layer(strided), layer(strided.contiguous()))


def test_gguf_grids_come_back_bitwise():
    """Weights that are q * d + m (Q4_1) or q * d (Q8_0) with float16 d and m, every group spanning its grid as
    GGUF's quantizer leaves it, are held exactly; off the grid they are not (negative control)."""
    torch.manual_seed(0)
    n, k = 64, 128
    q4 = torch.randint(0, 16, (n, k // GROUP, GROUP)).float()
    q4[..., 0], q4[..., 1] = 0, 15
    d = (torch.rand(n, k // GROUP, 1) * 0.01 + 1e-3).half().float()
    m = (torch.rand(n, k // GROUP, 1) * -0.1).half().float()
    grid = (q4 * d + m).view(n, k)
    q, scale, minimum = fit_q4_1(grid)
    assert torch.equal(q.view(n, k // GROUP, GROUP).float(), q4)
    assert torch.equal(scale, d[..., 0]) and torch.equal(minimum, m[..., 0])
    dense = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        dense.weight.copy_(grid)
    assert torch.equal(StableLinear(dense, "q4_1").dequantized(), grid)
    q8 = torch.randint(-127, 128, (n, k // GROUP, GROUP)).float()
    q8[..., 0] = 127
    grid8 = (q8 * d).view(n, k)
    with torch.no_grad():
        dense.weight.copy_(grid8)
    assert torch.equal(StableLinear(dense, "q8_0").dequantized(), grid8)
    assert torch.equal(fit_q8_0(grid8)[1], d[..., 0])
    with torch.no_grad():
        dense.weight.copy_(grid + 1e-4)
        dense.weight[:, ::GROUP] = grid[:, ::GROUP]
    assert not torch.equal(StableLinear(dense, "q4_1").dequantized(), dense.weight.detach())


def test_bad_weights_are_refused():
    model = build_tiny_model(TinyModelConfig())
    with pytest.raises(EagleLabError, match="target.weights"):
        convert_linears(model, "int3")
    with pytest.raises(EagleLabError, match="multiple of 32"):
        StableLinear(nn.Linear(40, 8), "q4_1")
    with pytest.raises(EagleLabError, match="runs on CPU over a float32 model"):
        convert_linears(build_tiny_model(TinyModelConfig()).to(torch.bfloat16), "int4")


def test_the_library_is_keyed_by_what_its_code_depends_on(monkeypatch):
    here = library_path("stable_linear")
    assert here.is_file()  # built (or found) by the first layer above
    monkeypatch.setattr("torch.__version__", "0.0.0-other")
    assert library_path("stable_linear") != here  # another torch builds its own
    monkeypatch.undo()
    monkeypatch.setattr("eagle_lab.models.native.cpu_flags", lambda: frozenset({"sse2"}))
    assert library_path("stable_linear") != here  # and so does another CPU
    monkeypatch.undo()
    monkeypatch.setenv("EAGLE_LAB_KERNEL_MARCH", "x86-64-v3")
    assert library_path("stable_linear") != here  # and another instruction set asked for


def test_the_library_key_reads_the_headers_its_source_includes(monkeypatch, tmp_path):
    import shutil

    from eagle_lab.models import native

    copy = tmp_path / "kernels"
    shutil.copytree(native.SOURCE_DIR, copy)
    monkeypatch.setattr(native, "SOURCE_DIR", copy)
    before = library_path("stable_linear")
    (copy / "simd.h").write_text((copy / "simd.h").read_text() + "\n// an edit\n")
    assert library_path("stable_linear") != before


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_give_bitwise_what_the_separate_layers_give(storage, bias):
    torch.manual_seed(0)
    widths = (96, 32, 40)  # the last width does not fill its panel of 16 columns
    linears = [nn.Linear(64, n, bias=bias) for n in widths]
    separate = [StableLinear(linear, storage) for linear in linears]
    fused = FusedProjections(linears, storage)
    parts = [ProjectionPart(fused, i) for i in range(len(widths))]
    x = torch.randn(3, 5, 64)
    for order in ((0, 1, 2), (2, 0, 1)):
        outs = {i: parts[i](x) for i in order}
        for i in order:
            assert outs[i].shape == (3, 5, widths[i])
            assert torch.equal(outs[i], separate[i](x))
    assert fused._input is None and fused._parts == ()  # nothing kept once every part was taken
    y = x + 1  # a new input recomputes, and so does a part asked twice for one input
    assert torch.equal(parts[1](y), separate[1](y)) and torch.equal(parts[1](y), separate[1](y))
    assert torch.equal(parts[2].dequantized(), separate[2].dequantized())


@pytest.mark.parametrize("weights", WEIGHTS)
def test_load_target_converts_every_linear_and_keeps_the_lm_head_tied(weights):
    target = load_target(TargetConfig(name="tiny_llama", source="tiny", device="cpu", weights=weights))
    layers = [m for m in target.model.modules() if isinstance(m, StableLinear)]
    # per decoder layer: q, k and v fused, o, gate and up fused, down; then the LM head
    assert len(layers) == 4 * target.config.num_hidden_layers + 1
    assert sum(isinstance(m, ProjectionPart) for m in target.model.modules()) == 5 * target.config.num_hidden_layers
    assert not any(type(m) is nn.Linear for m in target.model.modules())
    decoder, head = FORMATS[weights]
    assert target.lm_head.storage == head and layers[0].storage == decoder
    assert target.weights == weights and target.linear_kernel == "stable"
    if target.config.tie_word_embeddings:
        assert target.lm_head.weight is target.embed_tokens.weight


def test_auto_weights_are_the_embedded_ggufs_precision_and_fp32_otherwise(monkeypatch):
    from eagle_lab.models import device
    from eagle_lab.models.target import shipped_weights

    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_vnni"}))
    assert shipped_weights(TargetConfig(source="embedded", device="cpu")) == "w4a8"
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx2", "fma"}))  # vpmaddubsw: still w4a8
    assert shipped_weights(TargetConfig(source="embedded", device="cpu")) == "w4a8"
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"sse2"}))  # no integer dot products
    assert shipped_weights(TargetConfig(source="embedded", device="cpu")) == "int4"
    assert shipped_weights(TargetConfig(name="tiny_llama", source="tiny", device="cpu")) == "fp32"
    assert shipped_weights(TargetConfig(source="embedded", device="cpu", dtype="bfloat16")) == "fp32"
    assert shipped_weights(TargetConfig(source="embedded", device="cpu", weights="bf16")) == "bf16"


def tiny(family: str, weights: str) -> Target:
    return load_target(TargetConfig(name=f"tiny_{family}", source="tiny", tiny=TinyModelConfig(family=family),
                                    device="cpu", weights=weights))


def decode_all(target, prompt, backend=None, tokens=40) -> list[list[int]]:
    """Plain decoding, then an oracle drafter and an EAGLE head with a real tree, all greedy."""
    runs = [generate(vanilla_decode(target, prompt, GREEDY, Stopper(target.tokenizer, tokens, set()),
                                    backend=backend)).token_ids]
    for drafter in (OracleDrafter(target, depth=4),
                    EagleDrafter(new_head(target, seed=1), target, TreeShape(depth=3, topk=3, total_tokens=8))):
        runs.append(generate(speculative_decode(target, drafter, prompt, GREEDY,
                                                Stopper(target.tokenizer, tokens, set()), backend=backend)).token_ids)
    return runs


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_equals_plain_at_every_precision(family, weights):
    target = tiny(family, weights)
    generator = torch.Generator().manual_seed(7)
    for length in (12, 19):
        prompt = torch.randint(0, 256, (length,), generator=generator)
        plain, oracle, eagle = decode_all(target, prompt)
        assert oracle == plain and eagle == plain
    oracle = generate(speculative_decode(target, OracleDrafter(target, depth=4), prompt, GREEDY,
                                         Stopper(target.tokenizer, 40, set())))
    assert oracle.stats.accept_length > 3  # the trees were really verified, many tokens at a time


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_static_and_compiled_decoding_over_the_kernel_equal_eager_plain_decoding(compiled, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path))  # compiled packages built here, not reused
    target = tiny("llama", "int4")
    prompt = torch.tensor(target.tokenizer.encode("Stable rows change nothing but speed."))
    reference = decode_all(target, prompt, EagerBackend(target))
    backend = StaticBackend(target, [1, 4, 8], 64, compiled=compiled, min_attended_length=0)
    runs = decode_all(target, prompt, backend)
    assert runs[0] == runs[1] == runs[2] == reference[0]
    if compiled:
        assert backend.packages  # the steps ran as AOTInductor packages calling the kernel


@pytest.mark.slow
@pytest.mark.parametrize("weights", WEIGHTS)
def test_sampling_keeps_the_distribution_at_every_precision(weights):
    target = small_vocab_target()
    assert convert_linears(target.model, weights) > 0
    params = SamplingParams(temperature=1.0)
    prompt = torch.tensor([1, 4, 2, 0])
    length, samples = 3, 3000
    drafter = NoisyDrafter(target, depth=2, topk=2, noise=1.0, seed=5)
    counts, accepted_any = sampled_sequences(target, drafter, prompt, params, length, samples, seed=11)
    assert 0.2 * samples < accepted_any < samples
    expected = exact_sequence_probs(target, prompt, params, length)  # the converted target's own distribution
    assert chi_square_pvalue(counts, expected, samples) > ALPHA


@pytest.mark.slow
def test_the_embedded_targets_int4_gives_bitwise_its_fp32_logits():
    """SmolLM2's GGUF is Q4_1 + Q8_0: int4 storage holds exactly the fp32 checkpoint's numbers, so the same kernel
    order gives the same logits, bit for bit (and so the same tokens)."""
    prompt = torch.tensor([[1, 504, 3458, 314, 260, 1345, 28, 19, 437, 2012]])
    logits = {}
    for weights in ("fp32", "int4"):
        target = load_target(TargetConfig(device="cpu", weights=weights))
        assert target.weights == weights
        logits[weights] = target.logits(target.forward(prompt).features)  # [1, 10, V]
    assert torch.equal(logits["fp32"], logits["int4"])
