"""Two versions of the row-stable kernel in one process (benchmark/kernel_ab.py, models/native.load_variant)."""

import pytest

from eagle_lab.benchmark import kernel_ab
from eagle_lab.errors import EagleLabError
from eagle_lab.models.native import SOURCE_DIR, load_variant

SOURCE = (SOURCE_DIR / "stable_linear.cpp").read_text()


def test_a_variant_must_register_ops():
    with pytest.raises(EagleLabError, match="registers no ops"):
        load_variant("stable_linear", "int main() { return 0; }")


def test_the_cli_refuses_a_revision_or_file_it_cannot_read(tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        kernel_ab.main([f"against={tmp_path / 'missing.cpp'}"])
    with pytest.raises(SystemExit, match="cannot read"):
        kernel_ab.main(["against=no-such-revision-anywhere"])
    with pytest.raises(SystemExit, match="unknown kernel"):
        kernel_ab.main(["kernels=q5_k"])


@pytest.mark.slow
def test_a_variant_runs_beside_the_kernel_and_a_numerics_change_is_refused(tmp_path, capsys):
    same = tmp_path / "same.cpp"
    same.write_text(SOURCE)
    kernel_ab.main([f"against={same}", "kernels=q4_1x8", "rows=1,3", "layers=1", "passes=2"])
    table = capsys.readouterr().out.splitlines()
    assert table[1] == "| kernel | rows | working tree | against | ratio |"
    assert [line.split(" | ")[1] for line in table[3:]] == ["1", "3"]
    # activations quantized to +-126 instead of +-127: same speed, other numbers, so no timing is given
    assert SOURCE.count("d = amax / 127.f;") == 2
    moved = tmp_path / "moved.cpp"
    moved.write_text(SOURCE.replace("d = amax / 127.f;", "d = amax / 126.f;"))
    with pytest.raises(SystemExit, match="outputs differ"):
        kernel_ab.main([f"against={moved}", "kernels=q4_1x8", "rows=2", "layers=1", "passes=1"])
