"""The linear-layer cost diagnostic runs and refuses bad arguments with one message."""

import pytest

from eagle_lab.benchmark.gemm_rows import LinearStack, main


def test_the_stack_holds_each_layer_shape():
    stack = LinearStack(layers=2)
    assert len(stack.linears) == 14
    assert {(lin.out_features, lin.in_features) for lin in stack.linears} == {(576, 576), (192, 576), (1536, 576),
                                                                              (576, 1536)}


def test_eager_table(capsys):
    main(["dtypes=float32", "rows=1,2", "layers=1", "compile=false"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("|")[1:3] for line in lines[2:]] == [[" float32 ", " 1 "], [" float32 ", " 2 "]]
    assert all(line.split("|")[4].strip() == "-" for line in lines[2:])


@pytest.mark.parametrize("argv", [["rows"], ["dtypes=float7"], ["dtypes=nn"], ["threads=2"], ["rows=x"]])
def test_bad_arguments(argv):
    with pytest.raises(SystemExit, match="gemm_rows"):
        main(argv)
