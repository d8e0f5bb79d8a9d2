"""The shape-noise diagnostic: a position's logits scored alone against inside more rows."""

import pytest

from eagle_lab.benchmark.numerics import main, measure_shape_noise


def test_fp32_logits_barely_move_with_the_row_count(tiny_llama):
    prompts = [[5, 17, 99, 42], [7, 7, 8]]
    noise = measure_shape_noise(tiny_llama, prompts, tokens=6, extra=(3, 15))
    assert noise.positions == 12
    assert 0.0 <= noise.max_abs_dlogit < 1e-4  # fp32: rounding only, far below a real logit gap
    assert noise.argmax_flips <= noise.near_ties  # a greedy choice can only flip at a near-tie


def test_a_changed_tail_is_caught(tiny_llama, monkeypatch):
    """If the extra rows leaked into the position (a broken causal mask), the noise would be large."""
    forward = tiny_llama.forward

    def leaky(ids, cache, **kwargs):  # every position sees the mean of the whole input
        out = forward(ids, cache, **kwargs)
        out.features = out.features + out.features.mean(dim=1, keepdim=True)
        return out

    monkeypatch.setattr(tiny_llama, "forward", leaky)
    noise = measure_shape_noise(tiny_llama, [[5, 17, 99, 42]], tokens=3, extra=(3,))
    assert noise.max_abs_dlogit > 1e-3


@pytest.mark.parametrize("argv", [["dtype"], ["rows=3"], ["dtype=float7"], ["path=/nonexistent/model.gguf"]])
def test_bad_arguments_end_in_one_message(argv):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert str(err.value).startswith("numerics: ")
