"""Pruning the compiled-graph store: packages no process loaded for N days go, the others stay."""

import os
import time

import pytest

from eagle_lab.decoding import graph_store
from eagle_lab.decoding.graph_store import GraphStore


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path))
    root = tmp_path / graph_store.STORE_DIR
    root.mkdir()
    return root


def package(root, name: str, days_ago: float):
    path = root / f"{name}.pt2"
    path.write_bytes(b"x" * 1000)
    stamp = time.time() - days_ago * 86400
    os.utime(path, (stamp, stamp))
    return path


def test_only_packages_unused_for_the_given_days_are_removed(store_dir, capsys):
    old, older = package(store_dir, "target-step-old", 20), package(store_dir, "head-step-older", 40)
    recent = package(store_dir, "target-step-recent", 2)
    assert GraphStore().unused(days=14) == [older, old]  # oldest first

    graph_store.main(["unused_days=14", "dry_run=true"])
    assert old.exists() and older.exists() and "2 packages unused for 14 days" in capsys.readouterr().out

    graph_store.main(["unused_days=14"])
    assert not old.exists() and not older.exists() and recent.exists()
    assert "1 left" in capsys.readouterr().out


def test_an_empty_or_missing_store_has_nothing_to_prune(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path))
    assert GraphStore().unused(days=0) == []
    graph_store.main([])
    assert "0 packages unused" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["unused_days=soon"], ["unused_days=-1"], ["dry_run=maybe"], ["days=3"], ["14"]])
def test_bad_arguments_end_in_one_line(store_dir, argv):
    with pytest.raises(SystemExit) as stop:
        graph_store.main(argv)
    assert str(stop.value).startswith("graph_store:")
