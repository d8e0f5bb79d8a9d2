"""The linear-layer cost diagnostic runs and refuses bad arguments with one message."""

import pytest

from eagle_lab.benchmark.gemm_rows import LM_HEAD, linear_stack, main
from eagle_lab.models.stable_linear import StableLinear


def test_the_stack_holds_each_layer_shape_and_the_lm_head():
    stack = linear_stack(layers=2, kernel="q4_1")
    assert len(stack) == 15 and all(isinstance(linear, StableLinear) for linear in stack)
    assert {(lin.out_features, lin.in_features) for lin in stack} == {(576, 576), (192, 576), (1536, 576),
                                                                      (576, 1536), LM_HEAD}


def test_table(capsys):
    main(["kernels=torch,f32", "rows=1,2", "layers=1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("|")[1].strip() for line in lines[3:]] == ["torch", "f32"]
    assert all(float(cell) > 0 for line in lines[3:] for cell in line.split("|")[2:4])


@pytest.mark.parametrize("argv", [["rows"], ["kernels=int7"], ["threads=2"], ["rows=x"]])
def test_bad_arguments(argv):
    with pytest.raises(SystemExit, match="gemm_rows"):
        main(argv)
