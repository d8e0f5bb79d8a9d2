"""The attention cost diagnostic runs and refuses bad arguments with one message."""

import pytest

from eagle_lab.benchmark.attention_rows import main


def test_table(capsys):
    main(["rows=1,3", "lengths=32"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("|")[2].strip() for line in lines[3:]] == ["row-stable", "sdpa"]
    assert all(float(cell) > 0 for line in lines[3:] for cell in line.split("|")[3:5])


@pytest.mark.parametrize("argv", [["rows"], ["rows=x"], ["heads=2"]])
def test_bad_arguments(argv):
    with pytest.raises(SystemExit, match="attention_rows"):
        main(argv)
