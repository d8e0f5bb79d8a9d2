"""A head drafting in its own dtype (head.draft_dtype): bf16 beside an fp32 target where bf16 is native.

Drafts are proposals, so the head's numerics may change which tokens are drafted, never the output:
greedy output stays plain decoding's, alone and in a server batch, eager and over a static cache.
"""

from __future__ import annotations

import pytest
import torch

from eagle_lab.builders import build_head
from eagle_lab.config import HeadConfig
from eagle_lab.decoding.backend import StaticBackend
from eagle_lab.decoding.generate import Stopper, generate, speculative_decode, vanilla_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.errors import EagleLabError
from eagle_lab.models import device
from eagle_lab.models.prompts import as_tensor, encode_prompt
from eagle_lab.models.stable_linear import StableLinear
from eagle_lab.models.target import Target
from eagle_lab.models.tiny import TinyModelConfig, build_tiny_model
from eagle_lab.serving.batching import BatchScheduler
from eagle_lab.serving.engine import Engine, drafter_factory
from eagle_lab.tree_search.costs import timing_fingerprint
from tests.scheduler_helpers import plan, run_plans, static_rows
from tests.serving_helpers import TINY, serve_config

GREEDY = SamplingParams()
CPU = torch.device("cpu")


def test_auto_drafts_in_bf16_only_beside_an_fp32_target_on_a_native_bf16_cpu(monkeypatch):
    monkeypatch.setattr(device, "cpu_has_bf16", lambda: True)
    assert device.drafting_dtype("auto", torch.float32, CPU) == torch.bfloat16
    assert device.drafting_dtype("auto", torch.bfloat16, CPU) == torch.bfloat16
    assert device.drafting_dtype("auto", torch.float32, torch.device("cuda")) == torch.float32  # the target's
    assert device.drafting_dtype("float32", torch.float32, CPU) == torch.float32
    monkeypatch.setattr(device, "cpu_has_bf16", lambda: False)  # emulated bf16 would be slower
    assert device.drafting_dtype("auto", torch.float32, CPU) == torch.float32
    assert device.drafting_dtype("bfloat16", torch.float32, CPU) == torch.bfloat16
    with pytest.raises(EagleLabError, match="head.draft_dtype"):
        device.drafting_dtype("int8", torch.float32, CPU)


def test_build_head_casts_to_the_drafting_dtype_or_stores_it_on_the_stable_kernel(tiny_llama):
    for name, dtype, storage in (("bfloat16", torch.bfloat16, "bf16"), ("float32", torch.float32, "f32")):
        torch_layers = Target(build_tiny_model(TinyModelConfig()), tiny_llama.tokenizer, "tiny_llama")
        head = build_head(HeadConfig(path="random", draft_dtype=name), torch_layers)
        assert all(p.dtype == dtype for p in head.parameters())
        head = build_head(HeadConfig(path="random", draft_dtype=name), tiny_llama)  # on the stable kernel
        linears = [m for m in head.modules() if isinstance(m, StableLinear)]
        assert linears and all(m.storage == storage for m in linears)
        assert all(p.dtype == torch.float32 for p in head.parameters())  # activations stay float32


@pytest.mark.parametrize("weights, storage", [("w8a8", "q8_0x8"), ("w4a8", "q4_1x8"), ("fp32", "f32")])
def test_head_draft_weights_pick_the_heads_storage_and_keep_greedy_output_exact(tiny_llama, weights, storage):
    head = build_head(HeadConfig(path="random", draft_weights=weights), tiny_llama)
    linears = [m for m in head.modules() if isinstance(m, StableLinear)]
    assert linears and all(m.storage == storage for m in linears)
    drafter = EagleDrafter(head, tiny_llama, TreeShape(3, 2, 6))
    prompt = as_tensor(encode_prompt(tiny_llama.tokenizer, "Tell me a story about a dragon.", chat=False),
                       tiny_llama.device)
    plain = generate(vanilla_decode(tiny_llama, prompt, GREEDY, Stopper(tiny_llama.tokenizer, 40, set())))
    spec = generate(speculative_decode(tiny_llama, drafter, prompt, GREEDY, Stopper(tiny_llama.tokenizer, 40, set())))
    assert spec.token_ids == plain.token_ids and spec.stats.tree_tokens > 0
    bf16 = EagleDrafter(build_head(HeadConfig(path="random", draft_weights="bf16"), tiny_llama), tiny_llama,
                        TreeShape(3, 2, 6))
    assert timing_fingerprint(tiny_llama, drafter) != timing_fingerprint(tiny_llama, bf16)


def test_bad_head_draft_weights_are_refused(tiny_llama):
    with pytest.raises(EagleLabError, match="head.draft_weights"):
        build_head(HeadConfig(path="random", draft_weights="int3"), tiny_llama)


def test_cost_curves_of_a_bf16_and_an_fp32_head_are_kept_apart(tiny_llama):
    head = new_head(tiny_llama, seed=1)
    fp32 = timing_fingerprint(tiny_llama, EagleDrafter(head, tiny_llama, TreeShape(2, 2, 3)))
    bf16 = timing_fingerprint(tiny_llama, EagleDrafter(head.to(torch.bfloat16), tiny_llama, TreeShape(2, 2, 3)))
    assert fp32 != bf16


def test_cost_curves_are_timed_again_when_the_round_code_changes(tiny_llama, monkeypatch):
    import eagle_lab.tree_search.costs as costs

    drafter = EagleDrafter(new_head(tiny_llama, seed=1), tiny_llama, TreeShape(2, 2, 3))
    before = timing_fingerprint(tiny_llama, drafter)
    assert before == timing_fingerprint(tiny_llama, drafter)
    monkeypatch.setattr(costs, "code_digest", lambda sources: "an edited round")
    assert timing_fingerprint(tiny_llama, drafter) != before


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
@pytest.mark.parametrize("static", [False, True])
def test_a_bf16_head_keeps_greedy_output_exact(tiny_llama, static, kind):
    prompt = as_tensor(encode_prompt(tiny_llama.tokenizer, "Tell me a story about a dragon.", chat=False),
                       tiny_llama.device)
    backend = StaticBackend(tiny_llama, [4, 16], 64) if static else None
    drafter = EagleDrafter(new_head(tiny_llama, kind=kind, seed=1).to(torch.bfloat16), tiny_llama, TreeShape(3, 2, 6))
    plain = generate(vanilla_decode(tiny_llama, prompt, GREEDY, Stopper(tiny_llama.tokenizer, 40, set()),
                                    backend=backend))
    spec = generate(speculative_decode(tiny_llama, drafter, prompt, GREEDY, Stopper(tiny_llama.tokenizer, 40, set()),
                                       backend=backend))
    assert spec.token_ids == plain.token_ids
    assert drafter.cache.key_buffer.dtype == torch.bfloat16
    # the target's LM-head rows are cast only for a head that multiplies by them (EAGLE-3 has its own)
    assert drafter.lm_weight.dtype == (torch.bfloat16 if kind == "eagle2" else torch.float32)
    assert spec.stats.tree_tokens > 0  # the head drafted every round


def test_a_bf16_head_drafting_in_a_server_batch_keeps_greedy_output_exact(tiny_llama):
    prototype = EagleDrafter(new_head(tiny_llama, seed=1).to(torch.bfloat16), tiny_llama, TreeShape(3, 2, 6))
    engine = Engine(serve_config(*TINY), tiny_llama, drafter_factory(prototype), static_rows(tiny_llama))
    plans = [plan(engine, f"Request {i}: {'z' * (4 * i)} 1 2 1 2", n) for i, n in enumerate((10, 30, 18))]
    clients = run_plans(BatchScheduler(max_batch=3, max_queue=8, target=engine.target, rows=engine.rows), engine, plans)
    for client, p in zip(clients, plans):
        want = generate(vanilla_decode(tiny_llama, as_tensor(p.prompt_ids, tiny_llama.device), GREEDY,
                                       Stopper(tiny_llama.tokenizer, p.max_tokens, set())))
        assert client.tokens == want.token_ids
