"""freeze_loaded_objects: what is loaded leaves the collector's reach, garbage does not survive it."""

from __future__ import annotations

import gc
import weakref

from eagle_lab.decoding.gc_freeze import freeze_loaded_objects


class Node:
    def __init__(self):
        self.other = None


def cycle() -> Node:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a


def test_live_objects_are_exempt_and_garbage_is_collected_first():
    kept = cycle()
    garbage = weakref.ref(cycle())  # unreachable already; only the collector can free a cycle
    assert garbage() is not None
    assert any(o is kept for o in gc.get_objects())
    before = gc.get_freeze_count()
    frozen = freeze_loaded_objects()
    assert garbage() is None
    assert frozen == gc.get_freeze_count() > before
    assert not any(o is kept for o in gc.get_objects())  # in the permanent generation: no collection walks it
    later = cycle()
    assert any(o is later for o in gc.get_objects())  # what is allocated afterwards is collected as usual


def test_serve_exempts_what_it_loaded_before_it_decodes(tmp_path, monkeypatch):
    """serve.py's generate mode freezes once, after the target, backend and drafter are built and before the first
    prompt decodes."""
    import eagle_lab.serve as serve_module
    from tests.serving_helpers import reference

    events = []
    monkeypatch.setattr(serve_module, "freeze_loaded_objects", lambda: events.append("freeze"))
    decode = serve_module._decode

    def recording(*args, **kwargs):
        events.append("decode")
        return decode(*args, **kwargs)

    monkeypatch.setattr(serve_module, "_decode", recording)
    rows = reference(["target=tiny_qwen2", "max_new_tokens=4", "method=vanilla"], ["hi", "there"], tmp_path)
    assert len(rows) == 2 and events == ["freeze", "decode", "decode"]
