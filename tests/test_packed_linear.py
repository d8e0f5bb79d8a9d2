"""Prepacked float32 GEMMs change nothing but speed: a packed linear equals the plain one up to float rounding,
follows its weight when it changes, keeps tied weights tied; decoding over packed buckets is greedy-identical to
plain decoding and keeps the target's distribution when sampling, eager and compiled."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eagle_lab.decoding.backend import DecodingConfig, EagerBackend, StaticBackend, build_backend
from eagle_lab.models.packed_linear import PackedLinear, available, pack_linears
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.decoding.generate import Stopper, generate, speculative_decode, vanilla_decode
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.models.target import TargetConfig, load_target
from tests.conftest import OracleDrafter, small_vocab_target
from tests.test_sampling_lossless import assert_noisy_drafts_keep_distribution

pytestmark = pytest.mark.skipif(not available(torch.device("cpu"), torch.float32), reason="PyTorch built without MKL")
GREEDY = SamplingParams()


def packed_copy(linear: nn.Linear, rows: set[int]) -> PackedLinear:
    holder = nn.Sequential(linear)
    pack_linears(holder, rows)
    return holder[0]


@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_equals_the_plain_one_at_every_row_count(bias):
    torch.manual_seed(0)
    plain = nn.Linear(96, 200, bias=bias)
    packed = packed_copy(nn.Linear(96, 200, bias=bias), {4, 8})
    packed.load_state_dict(plain.state_dict())
    for rows in (1, 2, 4, 8, 16):
        x = torch.randn(1, rows, 96)
        assert torch.allclose(packed(x), plain(x), rtol=1e-5, atol=1e-5), rows
    x = torch.randn(2, 96, 4).transpose(1, 2)  # 8 rows, not contiguous
    assert torch.allclose(packed(x), plain(x), rtol=1e-5, atol=1e-5)
    assert sorted(packed.weight._eagle_lab_packs) == [4, 8]  # packs for the buckets only, made on first use


def test_a_pack_follows_its_weight_when_it_changes_in_place():
    torch.manual_seed(0)
    packed = packed_copy(nn.Linear(32, 48, bias=False), {4})
    x = torch.randn(4, 32)
    before = packed(x)
    with torch.no_grad():
        packed.weight.mul_(-2.0)
    after = packed(x)
    assert torch.allclose(after, F.linear(x, packed.weight), rtol=1e-5, atol=1e-5)
    assert torch.allclose(after, -2.0 * before, rtol=1e-5, atol=1e-5)


def test_packing_a_target_keeps_its_parameters_and_ties():
    target = load_target(TargetConfig(name="tiny_llama", source="tiny", device="cpu"))
    target.model.config.tie_word_embeddings = True
    target.model.tie_weights()
    names = sorted(target.model.state_dict())
    embedding = target.embed_tokens.weight
    assert target.pack_linears([1, 4, 8]) > 0
    assert sorted(target.model.state_dict()) == names
    assert isinstance(target.lm_head, PackedLinear) and target.lm_head.weight is embedding
    assert target.packed_rows == frozenset({4, 8})
    assert not any(type(m) is nn.Linear for m in target.model.modules())


def test_packs_that_would_take_over_a_quarter_of_memory_are_not_made(monkeypatch):
    target = load_target(TargetConfig(name="tiny_llama", source="tiny", device="cpu"))
    monkeypatch.setattr("eagle_lab.models.target.physical_memory", lambda: 1 << 16)  # 64 KiB
    assert target.pack_linears([1, 4, 8]) == 0 and target.packed_rows == frozenset()
    assert not any(isinstance(m, PackedLinear) for m in target.model.modules())


def decode_all(target, backend, prompt, tokens=40):
    drafter = EagleDrafter(new_head(target, seed=1), target, TreeShape(3, 3, 8))
    runs = []
    for spec in (None, OracleDrafter(target, depth=3), drafter):
        stopper = Stopper(target.tokenizer, tokens, set())
        steps = (vanilla_decode(target, prompt, GREEDY, stopper, backend=backend) if spec is None else
                 speculative_decode(target, spec, prompt, GREEDY, stopper, backend=backend))
        runs.append(generate(steps).token_ids)
    return runs


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_decoding_over_packed_buckets_is_greedy_identical_to_plain_decoding(compiled, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path))
    target = load_target(TargetConfig(name="tiny_llama", source="tiny", device="cpu"))
    prompt = torch.tensor(target.tokenizer.encode("Packed weights change nothing but speed."))
    reference = decode_all(target, EagerBackend(target), prompt)
    backend = StaticBackend(target, [1, 4, 8], 64, compiled=compiled, min_attended_length=0, packed_weights=True)
    assert target.packed_rows == frozenset({4, 8})
    runs = decode_all(target, backend, prompt)
    assert runs[0] == runs[1] == runs[2] == reference[0]
    assert runs == reference


def test_build_backend_packs_the_buckets_by_default_and_not_when_told():
    target = load_target(TargetConfig(name="tiny_llama", source="tiny", device="cpu"))
    build_backend(target, "true", DecodingConfig(buckets=[1, 4], packed_weights=False))
    assert target.packed_rows == frozenset()
    build_backend(target, "true", DecodingConfig(buckets=[1, 4]))
    assert target.packed_rows == frozenset({4})


def test_sampling_over_packed_buckets_keeps_the_target_distribution():
    target = small_vocab_target()
    backend = StaticBackend(target, [4, 8], 64, packed_weights=True)
    assert target.packed_rows == frozenset({4, 8})
    assert_noisy_drafts_keep_distribution(target, SamplingParams(temperature=1.0), backend)
