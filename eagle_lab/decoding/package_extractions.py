"""The directories torch unpacks compiled packages into, removed once no process uses them.

Loading an AOTInductor package (eagle_lab/decoding/graph_store.py) unpacks it into a fresh
`aotinductor_XXXXXX` directory in the temporary directory (TMPDIR, TEMP or TEMPDIR, else /tmp) and
loads the shared library from there; torch removes the directory when the loader is destroyed. A
process that is killed, or stopped with Ctrl-C, never destroys it: each such stop of `serve.py`
leaves about 4 MB per loaded graph behind, and a day of development here left 2 GB.

`remove_orphaned_extractions()` runs once per process, before its first package loads: it removes
the directories that hold one of eagle_lab's packages (their folder inside is named after the package,
`.target-step-...` or `.head-step-...`), that no live process maps (Linux: /proc/<pid>/maps), and that
are older than a few minutes (a directory another process has just unpacked may not be mapped yet).
Where /proc is missing it does nothing.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import stat
import time
from pathlib import Path

log = logging.getLogger(__name__)
PREFIX = "aotinductor_"  # torch's name for a package's unpacked directory
FAMILIES = (".target-step-", ".head-step-")  # how the folder inside an eagle_lab package's directory starts
MIN_AGE_S = 600.0  # younger directories may belong to a process between unpacking and mapping the library


def temporary_directories() -> list[Path]:
    """Where torch may unpack: the directories named by TMPDIR, TEMP and TEMPDIR, and /tmp."""
    named = [os.environ.get(name, "") for name in ("TMPDIR", "TEMP", "TEMPDIR")]
    found: list[Path] = []
    for candidate in [*named, "/tmp"]:
        path = Path(candidate) if candidate else None
        if path is not None and path.is_dir() and path.resolve() not in found:
            found.append(path.resolve())
    return found


def mapped_paths(proc: Path = Path("/proc")) -> set[str] | None:
    """Every file path mapped by a process this user can inspect; None where /proc is missing."""
    if not proc.is_dir():
        return None
    paths: set[str] = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "maps").read_text()
        except OSError:  # the process ended, or belongs to another user (who cannot use our directories)
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and PREFIX in fields[5]:
                paths.add(fields[5])
    return paths


def is_ours(directory: Path) -> bool:
    """Whether an unpacked directory holds one of eagle_lab's packages."""
    try:
        return any(child.name.startswith(FAMILIES) for child in directory.iterdir())
    except OSError:
        return False


def remove_orphaned_extractions(roots: list[Path] | None = None, min_age_s: float = MIN_AGE_S,
                                proc: Path = Path("/proc")) -> tuple[int, int]:
    """Remove eagle_lab's unpacked package directories that no live process maps and that are older than
    `min_age_s`. -> (directories removed, bytes freed)."""
    now, owner = time.time(), os.geteuid()
    candidates = []
    for root in roots if roots is not None else temporary_directories():
        for directory in root.glob(f"{PREFIX}*"):
            try:
                info = directory.stat()
            except OSError:
                continue
            old = now - info.st_mtime >= min_age_s
            if stat.S_ISDIR(info.st_mode) and info.st_uid == owner and old and is_ours(directory):
                candidates.append(directory)
    if not candidates:
        return 0, 0
    mapped = mapped_paths(proc)
    if mapped is None:
        return 0, 0
    removed = freed = 0
    for directory in candidates:
        inside = str(directory) + os.sep
        if any(path.startswith(inside) for path in mapped):
            continue
        size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
        shutil.rmtree(directory, ignore_errors=True)
        if not directory.exists():
            removed, freed = removed + 1, freed + size
    if removed:
        log.info("removed %d unpacked compiled graphs left by stopped processes (%.0f MB)", removed, freed / 1e6)
    return removed, freed


@functools.cache
def remove_orphans_once() -> tuple[int, int]:
    """remove_orphaned_extractions(), the first time a process asks."""
    return remove_orphaned_extractions()
