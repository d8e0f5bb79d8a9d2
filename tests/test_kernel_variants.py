"""A second build of a kernel in one process (models/native.load_variant): the kernels built for older
instruction sets than this CPU's compute what this CPU's build computes."""

import pytest
import torch
from torch import nn

from eagle_lab.errors import EagleLabError
from eagle_lab.models import native
from eagle_lab.models.device import cpu_flags
from eagle_lab.models.native import SOURCE_DIR, load_variant
from eagle_lab.models.stable_linear import StableLinear, kernels_available

SOURCE = (SOURCE_DIR / "stable_linear.cpp").read_text()


def test_a_variant_must_register_ops():
    with pytest.raises(EagleLabError, match="registers no ops"):
        load_variant("stable_linear", "int main() { return 0; }")


# -march levels this CPU can run, with what each leaves out: x86-64-v3 is AVX2 + FMA (vpmaddubsw for the int8
# activations, 16 lanes as two halves); x86-64-v4 is AVX-512 without VNNI.
MARCH_NEEDS = {"x86-64-v3": {"avx2", "fma", "f16c"}, "x86-64-v4": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}


@pytest.mark.slow
@pytest.mark.skipif(not kernels_available()[0], reason="no C++ kernels here")
@pytest.mark.parametrize("march", sorted(MARCH_NEEDS))
def test_every_instruction_set_computes_the_same_bits(march):
    if not MARCH_NEEDS[march] <= cpu_flags():
        pytest.skip(f"this CPU cannot run -march={march}")
    older = load_variant("stable_linear", SOURCE, march)
    native.load("stable_linear")
    torch.manual_seed(0)
    for storage in ("f32", "bf16", "q8_0", "q4_1", "q8_0x8", "q4_1x8"):
        for bias in (False, True):
            layer = StableLinear(nn.Linear(96, 40, bias=bias), storage)  # 40 columns: a partial panel
            for rows in (1, 3, 4, 5, 8, 9):
                x = torch.randn(rows, 96) * 3
                assert torch.equal(layer.run(older, x), layer.run(torch.ops.eagle_lab_kernels, x)), (storage, rows)
    # attention: lanes summed in another order without AVX512DQ, so equal up to rounding there, bitwise with it
    attention = (SOURCE_DIR / "stable_attention.cpp").read_text()
    older_attention = load_variant("stable_attention", attention, march)
    native.load("stable_attention")
    q, k, v = torch.randn(1, 4, 5, 64), torch.randn(1, 2, 37, 64), torch.randn(1, 2, 37, 64)
    mask = torch.zeros(1, 1, 5, 37, dtype=torch.bool)
    for t in range(5):
        mask[..., t, : 32 + t + 1] = True
    ours = torch.ops.eagle_lab_attention.stable_attention(q, k, v, mask, 0.125)
    theirs = older_attention.stable_attention(q, k, v, mask, 0.125)
    if "avx512dq" in cpu_flags() and march == "x86-64-v4":
        assert torch.equal(ours, theirs)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(not kernels_available()[0], reason="no C++ kernels here")
@pytest.mark.parametrize("march", sorted(MARCH_NEEDS))
def test_int4_sums_at_their_largest_are_exact_on_every_instruction_set(march):
    """Every weight nibble 15 and every activation -127 after quantization: the largest pair sums a group adds (the
    16-bit sums of the builds without VNNI must not saturate), through the raw q4_1x8 op."""
    if not MARCH_NEEDS[march] <= cpu_flags():
        pytest.skip(f"this CPU cannot run -march={march}")
    older = load_variant("stable_linear", SOURCE, march)
    native.load("stable_linear")
    panels, k = 4, 256
    packed = torch.full((panels, k // 8, 64), 255, dtype=torch.uint8)  # both nibbles 15
    scales = torch.full((panels, k // 32, 16), 0.5).half()
    minimums = torch.full((panels, k // 32, 16), -1.0).half()
    for rows in (1, 4, 5, 8):
        for sign in (-1.0, 1.0):
            x = torch.full((rows, k), 3.0 * sign)
            ours = torch.ops.eagle_lab_kernels.stable_linear_q4x8(x, packed, scales, minimums, None, 64)
            theirs = older.stable_linear_q4x8(x, packed, scales, minimums, None, 64)
            assert torch.equal(ours, theirs)
            expected = (15 * 0.5 - 1.0) * 3.0 * sign * k  # w = 15 * scale + minimum everywhere, x exact after rounding
            torch.testing.assert_close(ours, torch.full_like(ours, expected))
