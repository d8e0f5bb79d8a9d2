"""Unpacked package directories that stopped processes left in the temporary directory are removed, and only
those: not another program's, not one a live process maps, not one unpacked a moment ago."""

import mmap
import os
import time
from pathlib import Path

import pytest

from eagle_lab.decoding.package_extractions import remove_orphaned_extractions


def unpacked(root: Path, name: str, inner: str, age_s: float) -> Path:
    """A directory laid out as torch unpacks a package: aotinductor_X/<inner>/data/aotinductor/model/lib.so."""
    directory = root / f"aotinductor_{name}"
    library = directory / inner / "data" / "aotinductor" / "model" / "lib.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"\0" * 4096)
    then = time.time() - age_s
    os.utime(directory, (then, then))
    return directory


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc (Linux)")
def test_only_our_old_unmapped_directories_are_removed(tmp_path):
    hour = 3600.0
    orphan = unpacked(tmp_path, "orphan", ".target-step-0123-4567.abcd", hour)
    head_orphan = unpacked(tmp_path, "headorphan", ".head-step-89ab-cdef.efgh", hour)
    young = unpacked(tmp_path, "young", ".target-step-0123-4567.ijkl", 5.0)
    foreign = unpacked(tmp_path, "foreign", ".someone-elses-model.mnop", hour)
    live = unpacked(tmp_path, "live", ".head-step-89ab-cdef.qrst", hour)
    with open(next(live.rglob("lib.so")), "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ):
        removed, freed = remove_orphaned_extractions([tmp_path])
        assert (removed, freed) == (2, 2 * 4096)
        assert not orphan.exists() and not head_orphan.exists()
        assert young.exists() and foreign.exists() and live.exists()
    assert remove_orphaned_extractions([tmp_path]) == (1, 4096)  # unmapped now
    assert not live.exists() and young.exists()


def test_nothing_is_removed_without_proc(tmp_path):
    orphan = unpacked(tmp_path, "orphan", ".target-step-0123-4567.abcd", 3600.0)
    assert remove_orphaned_extractions([tmp_path], proc=tmp_path / "no-proc") == (0, 0)
    assert orphan.exists()
