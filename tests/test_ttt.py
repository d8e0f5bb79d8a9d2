"""The parallel unroll used in training equals step-by-step chain drafting."""

import torch

from eagle_lab.drafters.eagle.head import HeadKVCache
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.training.ttt import unrolled_hidden


def sequential_chain(head, target, tokens, features, anchor, steps):
    """Draft `steps` chain steps after anchor a with a KV cache, like the drafter does."""
    rotary = target.backbone.rotary_emb
    cache = HeadKVCache()
    embeds = target.embed_tokens(tokens[None, 1:anchor + 2])  # x_1..x_{a+1}
    positions = torch.arange(anchor + 1)[None]
    cos, sin = rotary(embeds, positions)
    hidden = head(embeds, features[None, :anchor + 1], cos, sin, cache, None)[:, -1:]  # [1, 1, H]
    outputs = [hidden[0, 0]]
    for step in range(2, steps + 1):
        p = anchor + step - 1
        embed = target.embed_tokens(tokens[None, p + 1:p + 2])
        cos, sin = rotary(embed, torch.tensor([[p]]))
        hidden = head(embed, hidden, cos, sin, cache, None, from_draft=True)  # sees prefix + own steps
        outputs.append(hidden[0, 0])
    return outputs


@torch.no_grad()
def test_unroll_matches_sequential_drafting(tiny_target):
    head = new_head(tiny_target, seed=7)
    tokens = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0))
    features = tiny_target.forward(tokens[None]).features[0]  # [T, H]
    steps = 4
    embeds = tiny_target.embed_tokens(tokens[None, 1:])  # [1, T-1, H] embeddings of x_{p+1}
    cos, sin = tiny_target.backbone.rotary_emb(embeds, torch.arange(19)[None])
    unrolled = unrolled_hidden(head, embeds, features[None, :19], cos, sin, steps)
    for anchor in (0, 5, 12):
        chain = sequential_chain(head, tiny_target, tokens, features, anchor, steps)
        for j in range(1, steps + 1):
            torch.testing.assert_close(unrolled[j - 1][0, anchor + j - 1], chain[j - 1], atol=1e-4, rtol=1e-4)
