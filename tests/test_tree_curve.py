"""The tree-size curve read from a tree=auto calibration (python -m eagle_lab.benchmark.tree_curve)."""

import json
import os
from dataclasses import asdict

import pytest

from eagle_lab.benchmark.tree_curve import curve, main
from eagle_lab.tree_search.costs import CostModel


def summary() -> dict:
    costs = CostModel({1: 10.0, 2: 10.0, 4: 10.0}, {1: 1.0, 3: 1.0}, 1.0, 0.5, 0.0, plain_ms=10.0)
    def row(d, k, n, tau, sampled, **extra):
        return {"shape": {"depth": d, "topk": k, "total_tokens": n}, "tau": tau, "sampled_tau": {"1": sampled}, **extra}

    return {"cost_model": asdict(costs), "rounds": 12,
            "shapes": [row(0, 0, 0, 1.0, 1.0), row(1, 1, 1, 1.5, 1.3), row(3, 1, 3, 2.2, 1.45),
                       row(1, 3, 3, 1.7, 1.5), row(1, 1, 1, 1.9, 1.35, ngram_tokens=2, extra={"0": 12})]}


def test_curve_gives_the_fastest_shape_per_size_and_temperature():
    lines = curve(summary())
    assert lines[0] == "| draft tokens | T=0: shape, tau, tok/s | T=1: shape, tau, tok/s |"
    by_size = {line.split(" | ")[0]: line for line in lines[2:]}
    assert by_size["| 0"].startswith("| 0 | plain, 1.00")
    assert "d3 k1 n3, 2.20" in by_size["| 3"] and "d1 k3 n3, 1.50" in by_size["| 3"]  # greedy deep, sampled wide
    assert "chain" not in "".join(lines)  # the head's trees alone unless asked
    assert any("d1 k1 n1 + chain 2, 1.90" in line for line in curve(summary(), ngram=True))


def test_curve_cli_reads_a_file_and_refuses_bad_ones(tmp_path, capsys):
    good = tmp_path / "calibration.json"
    good.write_text(json.dumps(summary()))
    main([f"file={good}"])
    assert "12 recorded rounds" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="not a tree=auto calibration"):
        main([f"file={bad}"])
    with pytest.raises(SystemExit, match="no such file"):
        main([f"file={tmp_path / 'missing.json'}"])


def test_curve_cli_defaults_to_the_newest_calibration_not_the_servers_choices(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path))
    folder = tmp_path / "tree_auto"
    folder.mkdir()
    calibration = folder / "smollm2_135m-0123456789abcdef.json"
    calibration.write_text(json.dumps(summary()))
    server_choices = folder / "smollm2_135m-rows-fedcba9876543210.json"
    server_choices.write_text(json.dumps({"1": {"depth": 1}}))
    os.utime(calibration, (1, 1))  # older than the server's file
    main([])
    assert "12 recorded rounds" in capsys.readouterr().out
    calibration.unlink()
    with pytest.raises(SystemExit, match="no calibration"):
        main([])
