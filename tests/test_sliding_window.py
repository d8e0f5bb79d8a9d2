"""Targets with sliding-window attention decode speculatively, exactly: Mistral (every layer slides), Qwen2 with
`use_sliding_window` and Gemma 3 (sliding layers between full ones), each with a window far shorter than the
context, on the dynamic cache, the static cache, compiled graphs and the server's rows."""

import pytest
import torch

from eagle_lab.decoding.backend import StaticBackend
from eagle_lab.decoding.generate import Stopper, generate, speculative_decode, vanilla_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.errors import EagleLabError
from eagle_lab.models.masks import FULL, SLIDING, AttentionLayout
from eagle_lab.models.target import TargetConfig, load_target
from eagle_lab.models.tiny import TinyModelConfig
from tests.conftest import OracleDrafter, small_vocab_target
from tests.scheduler_helpers import static_rows
from tests.test_sampling_lossless import assert_noisy_drafts_keep_distribution
from tests.test_server_batching import alone, encoded, make_drafters, together

WINDOW = 8
PROMPT, NEW_TOKENS = 12, 40  # 52 positions: more than 4 windows
GREEDY = SamplingParams()
WINDOWED = ("mistral", "qwen2", "gemma3")


@pytest.fixture(scope="module", params=WINDOWED)
def windowed(request):
    return load_target(TargetConfig(name=f"tiny_{request.param}_window", source="tiny", device="cpu",
                                    tiny=TinyModelConfig(family=request.param, sliding_window=WINDOW)))


def prompt_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(seed))


def reference(target, prompt: torch.Tensor, count: int) -> list[int]:
    """Greedy tokens from full forwards without a cache: Hugging Face's own sliding-window masks."""
    ids = prompt.clone()
    for _ in range(count):
        with torch.no_grad():
            logits = target.model(ids[None]).logits[0, -1]
        ids = torch.cat([ids, logits.argmax()[None]])
    return ids[prompt.numel():].tolist()


def decode(target, drafter, prompt, backend=None, params=GREEDY, seed=0):
    stopper = Stopper(target.tokenizer, NEW_TOKENS, set())
    generator = torch.Generator().manual_seed(seed)
    if drafter is None:
        return generate(vanilla_decode(target, prompt, params, stopper, generator, backend=backend))
    return generate(speculative_decode(target, drafter, prompt, params, stopper, generator, backend=backend))


def eagle(target):
    return EagleDrafter(new_head(target, seed=1), target, TreeShape(depth=4, topk=3, total_tokens=10))


def test_layouts_of_the_families(windowed):
    layout = windowed.layout
    assert layout.window == WINDOW
    assert layout.mixed == windowed.config.model_type.startswith("gemma3")
    for layer in windowed.new_cache().layers:  # the cache keeps every position; the masks apply the window
        assert not getattr(layer, "is_sliding", False)


@pytest.mark.parametrize("backend_kind", ["dynamic", "static"])
def test_greedy_speculative_equals_plain_and_the_model_itself(windowed, backend_kind):
    backend = StaticBackend(windowed, [1, 2, 4, 8, 16]) if backend_kind == "static" else None
    for seed in (0, 1):
        prompt = prompt_ids(seed)
        expected = reference(windowed, prompt, NEW_TOKENS)
        assert decode(windowed, None, prompt, backend).token_ids == expected
        oracle = decode(windowed, OracleDrafter(windowed, depth=4), prompt, backend)
        assert oracle.token_ids == expected and oracle.stats.accept_length > 3  # deep trees past the window
        assert decode(windowed, eagle(windowed), prompt, backend).token_ids == expected


def test_trees_scored_without_the_window_part_from_plain_decoding(windowed, monkeypatch):
    """The negative control: masks that ignore the window (chains still get Hugging Face's windowed masks)
    give other tokens, so the tests above see the window."""
    prompt = prompt_ids()
    plain = decode(windowed, None, prompt).token_ids
    monkeypatch.setattr(windowed, "layout", AttentionLayout())
    assert decode(windowed, OracleDrafter(windowed, depth=4), prompt).token_ids != plain
    assert decode(windowed, OracleDrafter(windowed, depth=4), prompt,
                  StaticBackend(windowed, [1, 2, 4, 8, 16])).token_ids != plain


def test_a_mixed_model_gets_a_mask_per_layer_type():
    layout = AttentionLayout(window=2, mixed=True)
    allowed = torch.ones(1, 2, 6, dtype=torch.bool)  # two tree nodes at slots 4 and 5, siblings at depth 0
    allowed[0, 0, 5] = allowed[0, 1, 4] = False
    masks = layout.masks(allowed, torch.tensor([[4, 4]]), 4, torch.float32)
    assert set(masks) == {FULL, SLIDING}
    assert (masks[FULL][0, 0] == 0).tolist() == allowed[0].tolist()
    seen = (masks[SLIDING][0, 0] == 0).tolist()
    assert seen == [[False, False, False, True, True, False], [False, False, False, True, False, True]]


def test_an_unknown_attention_kind_is_refused():
    config = TinyModelConfig(family="gemma3", sliding_window=4)
    target = load_target(TargetConfig(name="t", source="tiny", device="cpu", tiny=config))
    target.config.layer_types = ["chunked_attention"] * target.config.num_hidden_layers
    with pytest.raises(EagleLabError, match="chunked_attention"):
        AttentionLayout.of(target.config)
    with pytest.raises(EagleLabError, match="sliding-window"):
        load_target(TargetConfig(name="t", source="tiny", device="cpu",
                                 tiny=TinyModelConfig(family="llama", sliding_window=4)))


@pytest.mark.parametrize("kinds", [("eagle", "oracle", "ngram", "eagle-small"), ("vanilla",) * 4],
                         ids=["mixed4", "vanilla4"])
def test_server_rows_at_batch_four_equal_each_sequence_alone(windowed, kinds):
    prompts = encoded(windowed, ["Tell me a story about a dragon.", "1 2 3 1 2 3 1 2 3 1 2 3",
                                 "def add(a, b):\n    return a + b", "Hi there, window"])
    lengths = (30, 24, 36, 20)
    drafters = make_drafters(windowed, kinds)
    expected = [alone(windowed, d, p, GREEDY, n, 0) for d, p, n in zip(drafters, prompts, lengths)]
    assert all(p.numel() + n > 4 * WINDOW for p, n in zip(prompts, lengths))
    got = together(windowed, make_drafters(windowed, kinds), prompts, GREEDY, lengths, [0] * 4,
                   rows=static_rows(windowed))
    assert got == expected


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_sampling_keeps_the_target_distribution_with_a_window(family):
    """Window 2 over 9-token sequences: the chi-square test of test_sampling_lossless, eager, static and (Gemma 3's
    mask per layer type) compiled."""
    target = small_vocab_target(family=family, sliding_window=2)
    assert target.layout.window == 2
    prompt = (1, 4, 2, 0, 3, 1)
    assert_noisy_drafts_keep_distribution(target, SamplingParams(temperature=1.0), prompt=prompt)
    assert_noisy_drafts_keep_distribution(target, SamplingParams(temperature=0.8), StaticBackend(target, [4, 8], 64),
                                          prompt=prompt)
    if family == "gemma3":
        compiled = StaticBackend(target, [4, 8], 64, compiled=True)
        assert_noisy_drafts_keep_distribution(target, SamplingParams(temperature=1.0), compiled, prompt=prompt)


@pytest.mark.slow
def test_compiled_graphs_decode_a_mixed_window_model_exactly():
    """Gemma 3's per-layer-type masks through compiled graphs (a dict input of the exported step)."""
    target = load_target(TargetConfig(name="tiny_gemma3_window", source="tiny", device="cpu",
                                      tiny=TinyModelConfig(family="gemma3", sliding_window=WINDOW)))
    compiled = StaticBackend(target, [4], 64, compiled=True, min_attended_length=64)
    prompt = prompt_ids()
    expected = reference(target, prompt, NEW_TOKENS)
    assert decode(target, None, prompt, compiled).token_ids == expected
    assert decode(target, OracleDrafter(target, depth=3), prompt, compiled).token_ids == expected
    assert compiled._steps._graphs  # the steps ran compiled
