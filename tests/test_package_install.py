"""A non-editable install works on its own: the configs ship inside the package, so `serve`, `train`
and `export` find them without the source tree."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_installed_package_serves_from_anywhere(tmp_path):
    site = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                            "--target", str(site), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    assert (site / "eagle_lab" / "conf" / "serve.yaml").is_file()
    assert (site / "eagle_lab" / "conf" / "tree" / "cpu.yaml").is_file()
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    where = subprocess.run([sys.executable, "-c", "import eagle_lab; print(eagle_lab.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr  # the installed copy, not the tree
    run = subprocess.run([sys.executable, "-m", "eagle_lab.serve", "prompt=hi", "method=vanilla", "max_new_tokens=4",
                          "output=json", f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert '"new_tokens": 4' in run.stdout
    presets = subprocess.run([sys.executable, "-c", "from eagle_lab.tree_search.presets import tree_preset; "
                              "print(tree_preset('cpu').total_tokens)"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
    assert presets.stdout.strip() == "12", presets.stderr[-2000:]
