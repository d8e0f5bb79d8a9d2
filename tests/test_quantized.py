"""Weight-only quantized targets (target.weights=int8|int4): the layers multiply by the weights they claim
to hold, every row on its own (so a tree forward scores what single steps score), and speculative decoding
of a quantized target is lossless against plain decoding of the same quantized target: greedy token for
token on every family, sampling in distribution (chi-square)."""

import pytest
import torch
from torch import nn

from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.errors import EagleLabError
from eagle_lab.decoding.generate import Stopper, generate, speculative_decode, vanilla_decode
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.models.quantized import GROUP, KERNEL_DTYPE, Int4Linear, Int8Linear, quantize_decoder
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.models.target import Target, TargetConfig, load_target
from eagle_lab.models.tiny import TinyModelConfig, build_tiny_model, byte_tokenizer
from tests.conftest import FAMILIES, NoisyDrafter, OracleDrafter, small_vocab_target
from tests.test_sampling_lossless import ALPHA, chi_square_pvalue, exact_sequence_probs, sampled_sequences

LAYERS = {"int8": Int8Linear, "int4": Int4Linear}


def linear(out_features=96, in_features=128, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    nn.init.normal_(layer.weight, std=0.05)
    return layer


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_quantized_layer_multiplies_by_its_dequantized_weight(weights):
    dense = linear()
    layer = LAYERS[weights](dense)
    x = torch.randn(5, 3, 128)
    reference = x.to(KERNEL_DTYPE).float() @ layer.dequantized().t() + dense.bias  # [5, 3, 96]
    out = layer(x)
    assert out.shape == (5, 3, 96) and out.dtype == torch.float32
    # the kernels return bf16: within a few bf16 ulps of the exact product with the weight they hold
    assert (out - reference).abs().max() <= 1e-2 * reference.abs().max()
    # and that weight is close to the original: int8 per channel, int4 per group of 32
    error = (layer.dequantized() - dense.weight).abs().max() / dense.weight.abs().max()
    assert error < (0.01 if weights == "int8" else 0.1)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_every_row_is_computed_on_its_own(weights):
    """A forward over M rows gives each row bitwise what a one-row forward gives: what lets a tree forward
    score what single decoding steps score."""
    layer = LAYERS[weights](linear())
    x = torch.randn(16, 128)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(16)])
    for rows in (2, 4, 5, 8, 13, 16):
        assert torch.equal(layer(x[:rows]), alone[:rows])


def test_int4_recovers_a_q4_1_grid():
    """Weights that are scale * q + minimum per group of 32 (GGUF Q4_1) are held exactly when the scale, the
    minimum and the kernel's zero point are bf16-exact (here multiples of 2^-9 with few bits)."""
    torch.manual_seed(0)
    n, k = 64, 128
    q = torch.randint(0, 16, (n, k // GROUP, GROUP)).float()
    q[..., 0], q[..., 1] = 0, 15  # every group spans the grid, as a fitted Q4_1 group does
    scale = torch.randint(1, 4, (n, k // GROUP, 1)).float() * 2.0 ** -9
    low = torch.randint(-16, 16, (n, k // GROUP, 1)).float() * 2.0 ** -7
    dense = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        dense.weight.copy_((scale * q + low).view(n, k))
    assert torch.equal(Int4Linear(dense).dequantized(), dense.weight.detach())
    noisy = nn.Linear(k, n, bias=False)  # negative control: off the grid, the held weight differs
    with torch.no_grad():
        noisy.weight.copy_(dense.weight + 2.0 ** -11)
        noisy.weight[:, ::GROUP] = dense.weight[:, ::GROUP]
    assert not torch.equal(Int4Linear(noisy).dequantized(), noisy.weight.detach())


def test_bad_weights_are_refused():
    model = build_tiny_model(TinyModelConfig())
    with pytest.raises(EagleLabError, match="target.weights"):
        quantize_decoder(model, "int3")
    with pytest.raises(EagleLabError, match="divisible"):
        Int4Linear(nn.Linear(40, 8))


def quantized_tiny(family: str, weights: str) -> Target:
    return load_target(TargetConfig(name=f"tiny_{family}", source="tiny", tiny=TinyModelConfig(family=family),
                                    device="cpu", weights=weights))


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_equals_plain_on_a_quantized_target(family, weights):
    target = quantized_tiny(family, weights)
    replaced = [m for m in target.model.modules() if isinstance(m, LAYERS[weights])]
    assert len(replaced) == 7 * target.config.num_hidden_layers  # q, k, v, o, gate, up, down
    generator = torch.Generator().manual_seed(7)
    for length in (12, 19):
        prompt = torch.randint(0, 256, (length,), generator=generator)
        plain = generate(vanilla_decode(target, prompt, SamplingParams(), Stopper(target.tokenizer, 40, set())))
        for drafter in (OracleDrafter(target, depth=4),
                        EagleDrafter(new_head(target, seed=1), target, TreeShape(depth=3, topk=3, total_tokens=8))):
            spec = generate(speculative_decode(target, drafter, prompt, SamplingParams(),
                                               Stopper(target.tokenizer, 40, set())))
            assert spec.token_ids == plain.token_ids
    oracle = generate(speculative_decode(target, OracleDrafter(target, depth=4), prompt, SamplingParams(),
                                         Stopper(target.tokenizer, 40, set())))
    assert oracle.stats.accept_length > 3  # the trees were really verified, many tokens at a time


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_sampling_keeps_a_quantized_targets_distribution(weights):
    target = small_vocab_target()
    assert quantize_decoder(target.model, weights) > 0
    params = SamplingParams(temperature=1.0)
    prompt = torch.tensor([1, 4, 2, 0])
    length, samples = 3, 3000
    drafter = NoisyDrafter(target, depth=2, topk=2, noise=1.0, seed=5)
    counts, accepted_any = sampled_sequences(target, drafter, prompt, params, length, samples, seed=11)
    assert 0.2 * samples < accepted_any < samples
    expected = exact_sequence_probs(target, prompt, params, length)  # the quantized target's own distribution
    assert chi_square_pvalue(counts, expected, samples) > ALPHA
