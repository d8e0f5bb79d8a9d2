"""Heads work at any position up to the target's context, not only where they were trained.

A head has no position table of its own: it takes the target's rotary embedding, whose
attention scores depend only on relative positions. So the same pairs placed deep into the
context must give the same outputs as at the start — the failure of heads that carry a
2048-position table does not arise. Checked for both head kinds, and end to end near the
context limit.
"""

import pytest
import torch

from eagle_lab.decoding.generate import Stopper, generate, speculative_decode, vanilla_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.growth import TreeShape


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
@torch.no_grad()
def test_head_output_is_shift_invariant(tiny_llama, kind):
    head = new_head(tiny_llama, kind=kind, seed=3)
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    layers = tuple(head.arch.feature_layers)
    out = tiny_llama.forward(tokens, layer_ids=layers)
    feats = out.layer_features if layers else out.features  # [1, T, F]
    embeds = tiny_llama.embed_tokens(tokens[:, 1:])
    results = []
    for offset in (0, 1900):  # the tiny target's context is 2048; "training" never went past 512
        positions = torch.arange(offset, offset + 23)[None]
        cos, sin = tiny_llama.backbone.rotary_emb(embeds, positions)
        results.append(head(embeds, feats[:, :-1], cos, sin))
    torch.testing.assert_close(results[0], results[1], atol=2e-4, rtol=2e-4)


def test_generation_near_the_context_limit_is_exact(tiny_llama):
    drafter = EagleDrafter(new_head(tiny_llama, kind="eagle3", seed=4), tiny_llama, TreeShape(4, 3, 9))
    prompt = torch.randint(0, 256, (2000,), generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams()
    plain = generate(vanilla_decode(tiny_llama, prompt, greedy, Stopper(tiny_llama.tokenizer, 100, set())))
    spec = generate(speculative_decode(tiny_llama, drafter, prompt, greedy, Stopper(tiny_llama.tokenizer, 100, set())))
    assert spec.token_ids == plain.token_ids
    assert spec.stats.stop_reason == plain.stats.stop_reason == "context"  # 2048 reached, cleanly
