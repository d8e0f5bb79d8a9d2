"""The measuring tools' key=value arguments: one message naming the tool for bad input."""

import pytest

from eagle_lab.benchmark.profile_round import main as profile_round
from eagle_lab.errors import key_values


def test_key_values_parses_and_refuses():
    assert key_values("tool", ["a=1", "b=x=y"], ("a", "b")) == {"a": "1", "b": "x=y"}
    for argv, message in ((["a"], "key=value"), (["=1"], "key=value"), (["c=1"], "unknown argument")):
        with pytest.raises(SystemExit, match=f"^tool: .*{message}"):
            key_values("tool", argv, ("a", "b"))


@pytest.mark.parametrize("argv", [["depth"], ["depth=x"], ["threads=2"], ["compile=maybe"], ["total=-1"], ["tokens=0"]])
def test_profile_round_refuses_bad_arguments_before_loading(argv, monkeypatch):
    import eagle_lab.benchmark.profile_round as tool

    monkeypatch.setattr(tool, "load_target", lambda *a, **k: pytest.fail("loaded the target for bad arguments"))
    with pytest.raises(SystemExit, match="^profile_round: "):
        profile_round(argv)
