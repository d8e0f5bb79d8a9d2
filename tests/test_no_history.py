"""The README is a user's manual and the docs, code and configs say what things are, not when they
were done: no lab-notebook references to numbered work sessions or tracker issues anywhere in the
project's text files, and a README short enough to read."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("README.md", "docs", "eagle_lab", "conf", "tests")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".txt", ".json"}
README_MAX_LINES = 350
README_MAX_WIDTH = 110  # characters: the README reads without side-scrolling
BENCHMARKS_MAX_LINES = 400  # docs/benchmarks.md: the current figures; older ones stay in git

# Built from pieces so that this file does not match itself.
_SESSION = "sess" + "ions?"
HISTORY = re.compile(r"\b" + _SESSION + r"[ -]?[0-9]" + "|" + r"\biss" + "ue #", re.IGNORECASE)
# In the README, the words of a diary are out even without a number.
README_DIARY = re.compile(r"\b" + _SESSION + r"\b" + "|" + "not yet " + "explained" + "|" + "next thing " + "to try",
                          re.IGNORECASE)


def _text_files():
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            yield path
            continue
        for file in sorted(path.rglob("*")):
            if file.is_file() and file.suffix in SUFFIXES and "__pycache__" not in file.parts:
                yield file


def _hits(pattern: re.Pattern, files) -> list[str]:
    hits = []
    for file in files:
        for number, line in enumerate(file.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{file.relative_to(ROOT)}:{number}: {line.strip()}")
    return hits


def test_no_work_history_in_project_text():
    files = list(_text_files())
    assert any(f.name == "README.md" for f in files) and len(files) > 20  # the scan sees the project
    hits = _hits(HISTORY, files)
    assert not hits, "lab-notebook references (say what, not when):\n" + "\n".join(hits)


def test_readme_is_a_manual_not_a_diary():
    readme = ROOT / "README.md"
    lines = readme.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): "
                                            "move measurements and design notes to docs/")
    hits = _hits(README_DIARY, [readme])
    assert not hits, "diary wording in README.md:\n" + "\n".join(hits)


def test_readme_lines_fit_the_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    wide = [f"README.md:{n}: {len(line)} characters" for n, line in enumerate(lines, 1) if len(line) > README_MAX_WIDTH]
    assert not wide, f"README lines over {README_MAX_WIDTH} characters (rewrap them):\n" + "\n".join(wide)


def test_benchmarks_page_keeps_current_figures_only():
    lines = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= BENCHMARKS_MAX_LINES, (
        f"docs/benchmarks.md has {len(lines)} lines (at most {BENCHMARKS_MAX_LINES}): replace superseded figures "
        "with the newest of their kind; the older ones stay in git")


def test_the_patterns_catch_what_they_are_for():
    for text in ("measured in sess" + "ion 7", "Sess" + "ions 5-10", "sess" + "ion-4 variants", "iss" + "ue #11"):
        assert HISTORY.search(text), text
    for text in ('@pytest.fixture(scope="session")', "an HTTP session", "a tiss" + "ue #3", "posses" + "sion 2"):
        assert not HISTORY.search(text), text
