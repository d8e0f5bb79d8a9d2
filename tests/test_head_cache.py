"""The head's preallocated KV cache: appends write in place, growth keeps what was written,
cropping forgets draft entries without copying, and load() takes a batch row's entries."""

import torch

from eagle_lab.drafters.eagle.head import HeadKVCache


def entries(count: int, start: int = 0) -> torch.Tensor:
    """[1, kvH=2, count, D=3] with distinct values per slot."""
    return torch.arange(start, start + count, dtype=torch.float32).view(1, 1, count, 1).expand(1, 2, count, 3).clone()


def test_appends_grow_by_blocks_and_keep_every_entry():
    cache = HeadKVCache(block=4)
    keys, values = cache.append(entries(3), -entries(3))
    assert cache.capacity == 4 and keys.shape == (1, 2, 3, 3)
    keys, values = cache.append(entries(3, 3), -entries(3, 3))  # 6 entries: one more block
    assert cache.capacity == 8 and cache.length == 6
    torch.testing.assert_close(keys, entries(6))
    torch.testing.assert_close(values, -entries(6))


def test_crop_forgets_draft_entries_and_the_next_append_overwrites_them():
    cache = HeadKVCache(block=8)
    cache.append(entries(5), entries(5))
    buffer = cache.key_buffer
    cache.crop(3)
    assert cache.length == 3 and cache.key_buffer is buffer  # nothing copied
    keys, _ = cache.append(entries(2, 100), entries(2, 100))
    torch.testing.assert_close(keys, torch.cat([entries(3), entries(2, 100)], dim=2))


def test_reserve_preallocates_and_load_takes_given_entries():
    class Arch:
        num_kv_heads, head_dim = 2, 3

    cache = HeadKVCache(block=4, min_capacity=16)
    cache.reserve(5, torch.zeros(1), Arch())
    assert cache.capacity == 16 and cache.length == 0
    row = entries(6)
    cache.load(row, -row)
    assert cache.length == 6
    keys, values = cache.append(entries(1, 6), -entries(1, 6))  # full: grows, keeping the loaded entries
    torch.testing.assert_close(keys, entries(7))
    torch.testing.assert_close(values, -entries(7))
