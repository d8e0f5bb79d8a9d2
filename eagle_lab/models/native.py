"""eagle_lab's C++ kernels, compiled once per machine into the cache and loaded as torch ops.

A library is built with the host's compiler for the host's instruction set (`-march=native`) and keyed by what
its machine code depends on: the source and the headers beside it, torch's version and ABI, the compiler's version,
the CPU's flags and the instruction set asked for. A variant may be built for an older instruction set than the
host's (`march="x86-64-v3"`: AVX2 and FMA, no AVX-512), which is how a newer CPU tests and times the code an older
one runs. A later process loads the built library in milliseconds; another machine, compiler or torch builds its
own. Building takes seconds.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from eagle_lab.errors import EagleLabError
from eagle_lab.models.device import cpu_features, cpu_flags
from eagle_lab.models.embedded import cache_root

log = logging.getLogger(__name__)
SOURCE_DIR = Path(__file__).resolve().parent / "kernels"
FLAGS = ("-O3", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-w")
NATIVE = "native"  # -march= of the libraries a run loads, unless $EAGLE_LAB_KERNEL_MARCH names another
MARCH_ENV = "EAGLE_LAB_KERNEL_MARCH"


def compiler() -> str:
    """`$CXX`, else the first of c++ / g++ / clang++ on PATH."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise EagleLabError("no C++ compiler found (set CXX, or install g++); eagle_lab's CPU kernels are built with one")


def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout.split("\n")[0]


def kernel_march() -> str:
    """The -march a run's kernels are built for: the host's, or $EAGLE_LAB_KERNEL_MARCH (`x86-64-v3`: AVX2 and
    FMA), which runs on this CPU the code an older one would run: how its speed is measured where none is at hand."""
    return os.environ.get(MARCH_ENV, "").strip() or NATIVE


def library_path(name: str) -> Path:
    """Where the library built from kernels/NAME.cpp for this machine (and kernel_march()) lives, built or not."""
    return _keyed_path(name, (SOURCE_DIR / f"{name}.cpp").read_bytes(), kernel_march())


def _keyed_path(stem: str, source: bytes, march: str = NATIVE) -> Path:
    cxx = compiler()
    digest = hashlib.sha256()
    headers = [header.read_bytes() for header in sorted(SOURCE_DIR.glob("*.h"))]  # what the sources include
    for part in (source, *headers, torch.__version__.encode(),
                 str(torch.compiled_with_cxx11_abi()).encode(), _compiler_version(cxx).encode(),
                 cpu_features().encode(), " ".join(sorted(cpu_flags())).encode(),
                 " ".join((*FLAGS, f"-march={march}")).encode()):
        digest.update(part)
    return cache_root() / "kernels" / f"{stem}-{digest.hexdigest()[:16]}.so"


def _build(name: str, path: Path, source: Path | None = None, march: str = NATIVE) -> None:
    """Compile `source` (default kernels/NAME.cpp) for the instruction set `march` into the library at `path`."""
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    path.parent.mkdir(parents=True, exist_ok=True)
    log.info("building eagle_lab's %s kernels for this CPU into %s (about 10 s, once)", name, path.parent)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        staged = Path(scratch) / path.name
        command = [compiler(), *FLAGS, f"-march={march}", f"-I{SOURCE_DIR}",
                   f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
                   *(f"-I{p}" for p in include_paths()), str(source or SOURCE_DIR / f"{name}.cpp"), "-o", str(staged),
                   f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-5:])
            raise EagleLabError(f"building eagle_lab's {name} kernels failed ({command[0]}):\n{tail}")
        os.replace(staged, path)  # atomic: a process racing this one loads a whole file or builds its own


@functools.cache
def op_schemas() -> tuple[str, ...]:
    """Every op definition the kernels' sources make (`m.def("schema", {tags})`, whitespace collapsed): what a
    compiled package that calls them depends on (the schema, and the tags that set how a graph lays out the
    op's inputs), where the kernels' code itself is loaded fresh by every process."""
    schemas = []
    for source in sorted(SOURCE_DIR.glob("*.cpp")):
        schemas += [" ".join(d.split()) for d in re.findall(r'm\.def\((".*?"(?:,\s*\{[^}]*\})?)\);', source.read_text(),
                                                            flags=re.S)]
    return tuple(schemas)


@functools.cache
def load(name: str) -> None:
    """Build kernels/NAME.cpp for this machine if needed and register its ops (once per process)."""
    path = library_path(name)
    if not path.is_file():
        _build(name, path, march=kernel_march())
    torch.ops.load_library(str(path))


def load_variant(name: str, source: str, march: str = NATIVE):
    """Another version of kernels/NAME.cpp (its text), built for the instruction set `march`, its ops registered
    under a namespace of its own (the source's, suffixed with a digest of the text and `march`: torch allows one
    library per namespace in a process), so that both versions run in one process: how one kernel's code for
    two instruction sets is compared (tests/test_kernel_variants.py), or two kernels on a machine whose speed
    drifts between processes. Built once, keyed like load()'s. -> torch.ops.<namespace>."""
    own = re.search(r"TORCH_LIBRARY\((\w+),", source)
    if own is None:
        raise EagleLabError(f"this {name} source registers no ops (no TORCH_LIBRARY)")
    tag = source if march == NATIVE else f"{source}\n-march={march}"
    namespace = f"{own.group(1)}_v{hashlib.sha1(tag.encode()).hexdigest()[:10]}"
    renamed = re.sub(rf"\b{own.group(1)}\b", namespace, source)
    path = _keyed_path(f"{name}-{namespace}", renamed.encode(), march)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
            staged_source = Path(scratch) / f"{name}.cpp"
            staged_source.write_text(renamed)
            _build(f"{name} ({namespace}, -march={march})", path, staged_source, march)
    torch.ops.load_library(str(path))
    return getattr(torch.ops, namespace)
