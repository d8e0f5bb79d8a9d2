"""Compiled graphs that outlive the process: AOTInductor packages on disk, built once per machine.

`torch.compile` rebuilds every graph in every process (minutes each on a small CPU), so a short
run would never get compiled decoding. Here a step is exported (`torch.export`) and compiled ahead of time
into a package (`torch._inductor.aoti_compile_and_package`) under `<cache>/compiled/`; a later process
loads it in milliseconds and runs it from its first token.

Packages hold code, not weights: they are compiled without freezing and with
`package_constants_in_so=False`, and a loaded package is bound to the live module's own parameters
(`load_constants(..., user_managed=True)`: no copy). So a package is a few MB, one set of weights
serves every package, and a package cannot run stale weights: new weights of the same shapes run
through the same code. On CPUs with AMX this unfrozen code runs a 1-token step as fast as the frozen,
prepacked torch.compile graph (docs/design-decoding.md, "Compiled artifacts").

`frozen=True` (decoding.frozen_weights) compiles the other way: weights frozen into the package and
prepacked for inductor's C++ GEMM template, autotuned per shape. On CPUs where that template beats
MKL at a few rows (measured on an AVX2 CPU: docs/design-decoding.md, "Compiled artifacts") it is
worth its cost: each package then carries the weights (about 0.65 GB per graph
for SmolLM2 in fp32) and takes minutes to build, and its key includes a digest of the weights.

A package's path is a hash of everything its code depends on: torch, transformers and Python
versions, the CPU's instruction sets, eagle_lab's source files of that step, the module's parameter
names, shapes and dtypes, the example inputs' shapes, strides and dtypes, and the step's own
constants (rows, layers). Change any of them and the package is built anew instead of loaded; a package
that fails to load is rebuilt too. A dimension exported as dynamic (`dynamic=`: the target step's attended
length, the head step's cache width) is one package for every size, and its key names its range, not a size.

So an upgrade leaves the packages of the old code behind. A load stamps its package's modification time,
which is then the time it was last used, and `python -m eagle_lab.decoding.graph_store
[unused_days=14] [dry_run=false]` removes the packages no process has loaded for that many days.
Loading a package unpacks it into the temporary directory; what stopped processes left there is removed
by the next process (eagle_lab/decoding/package_extractions.py).
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils import _pytree as pytree

from eagle_lab.decoding.package_extractions import remove_orphaned_extractions, remove_orphans_once
from eagle_lab.errors import key_values
from eagle_lab.models.device import cpu_features
from eagle_lab.models.embedded import cache_root

log = logging.getLogger(__name__)
STORE_DIR = "compiled"
# inductor settings of a package: no freezing, so the weights stay inputs bound at load time
PACKAGE_OPTIONS = {"aot_inductor.package_constants_in_so": False}
# frozen: weights prepacked into the package for the C++ GEMM template, each GEMM autotuned
FROZEN_OPTIONS = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN", "freezing": True}
# how a package is built (export, then AOTInductor with the options above): raise it when build() changes
BUILD_VERSION = 1


def source_digest(sources: tuple[str, ...]) -> str:
    """A digest of eagle_lab's source files `sources` (paths under eagle_lab/): for a package, the code that defines
    its exported step, so a change there invalidates that step's packages, and only those."""
    return _digest(sources, lambda path: path.read_bytes())


def code_digest(sources: tuple[str, ...]) -> str:
    """source_digest of the code alone: Python files are read through `ast`, without docstrings, comments
    or layout, so an edit to the prose keeps what was measured with the code (the cost curves)
    valid. Other files (the C++ kernels) count byte for byte."""
    return _digest(sources, lambda path: python_code(path.read_text()).encode() if path.suffix == ".py"
                   else path.read_bytes())


def _digest(sources: tuple[str, ...], read) -> str:
    """sha1 over read(path) of each source (paths under eagle_lab/), in order; 16 hex digits."""
    digest = hashlib.sha1()
    package = Path(__file__).resolve().parent.parent
    for relative in sources:
        path = package / relative
        if not path.is_file():
            raise FileNotFoundError(f"a source list names {relative}, which is not in {package}")
        digest.update(read(path))
    return digest.hexdigest()[:16]


def python_code(text: str) -> str:
    """Python source as its syntax tree, without docstrings (ast drops comments and layout)."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def environment() -> dict:
    """What every package built in this process depends on, whatever its shape."""
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": ".".join(map(str, sys.version_info[:3])), "cpu": cpu_features()}


def _describe(value, dynamic=None) -> object:
    """Shapes, strides and dtypes of a nested structure of tensors (what an exported graph is specialised on);
    `dynamic` mirrors it as torch.export's dynamic_shapes do ({dim: Dim} for a tensor, None: static), and a
    dynamic dimension is described by its name and range, with no size. Such a tensor's strides are "contiguous" when it
    is (they follow from its sizes), else listed: a view's strides come from the storage it views, so a
    package never serves a layout it was not built for."""
    if isinstance(value, torch.Tensor):
        if not dynamic:
            return [list(value.shape), list(value.stride()), str(value.dtype), value.device.type]
        shape = [f"{dynamic[d].__name__}:{dynamic[d].min}..{dynamic[d].max}" if d in dynamic else n
                 for d, n in enumerate(value.shape)]
        strides = "contiguous" if value.is_contiguous() else list(value.stride())
        return [shape, strides, str(value.dtype), value.device.type]
    if isinstance(value, (list, tuple)):
        return [_describe(item, None if dynamic is None else dynamic[i]) for i, item in enumerate(value)]
    if isinstance(value, dict):  # a mask per layer type
        return {str(key): _describe(item, None if dynamic is None else dynamic[key])
                for key, item in sorted(value.items())}
    return repr(value)


def module_constants(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under its name, tied ones under each name (a package asks for each)."""
    constants = dict(module.named_parameters(remove_duplicate=False))
    constants.update(module.named_buffers(remove_duplicate=False))
    return constants


class GraphStore:
    """Packages under `<cache>/compiled/` (or `root`)."""

    def __init__(self, root: Path | None = None, frozen: bool = False):
        self.root = Path(root) if root is not None else cache_root() / STORE_DIR
        self.frozen = frozen
        self._environment: dict | None = None
        self._weight_digests: dict[tuple, str] = {}  # (name, address, version) of every weight -> digest

    def family(self, name: str, module: nn.Module, constants: dict, sources: tuple[str, ...] = ()) -> str:
        """`name-<hash>` of what every package of one module shares: environment, the source files that define
        the step (`sources`, under eagle_lab/), weights' names, shapes and dtypes (their values too when frozen),
        the module's own constants."""
        if self._environment is None:
            self._environment = environment()
        weights = sorted((n, list(t.shape), str(t.dtype)) for n, t in module_constants(module).items())
        frozen = self._weights_digest(module) if self.frozen else ""
        build = [BUILD_VERSION, PACKAGE_OPTIONS, FROZEN_OPTIONS if self.frozen else None]
        text = json.dumps([self._environment, build, source_digest(sources), name, type(module).__name__, weights,
                           sorted((str(k), repr(v)) for k, v in constants.items()), frozen], sort_keys=True)
        return f"{name}-{hashlib.sha1(text.encode()).hexdigest()[:16]}"

    def key(self, name: str, module: nn.Module, args: tuple, constants: dict, sources: tuple[str, ...] = (),
            dynamic: tuple | None = None) -> str:
        """A package's file name: its family, then a hash of the inputs' shapes, strides and dtypes (`dynamic`:
        build()'s; its dimensions count by name, not size)."""
        shape = hashlib.sha1(json.dumps(_describe(args, dynamic)).encode()).hexdigest()[:12]
        return f"{self.family(name, module, constants, sources)}-{shape}"

    def has_family(self, family: str) -> bool:
        """Whether any package of this family is on disk."""
        return self.root.is_dir() and any(self.root.glob(f"{family}-*.pt2"))

    def _weights_digest(self, module: nn.Module) -> str:
        """A digest of the weights' values (frozen packages carry them); computed once per set of tensors."""
        constants = sorted(module_constants(module).items())
        identity = tuple((name, tensor.data_ptr(), tensor._version) for name, tensor in constants)
        if identity not in self._weight_digests:
            digest = hashlib.sha1()
            for name, tensor in constants:
                digest.update(name.encode())
                digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            self._weight_digests[identity] = digest.hexdigest()[:16]
        return self._weight_digests[identity]

    def path(self, key: str) -> Path:
        return self.root / f"{key}.pt2"

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def load(self, key: str, module: nn.Module) -> LoadedPackage | None:
        """The package bound to `module`'s weights, or None when there is none or it does not load."""
        path = self.path(key)
        if not path.is_file():
            return None
        remove_orphans_once()  # what killed processes left unpacked in the temporary directory
        try:
            runner = torch._inductor.aoti_load_package(str(path))
            if self.frozen:
                return LoadedPackage(runner)  # its weights are inside
            wanted = runner.get_constant_fqns()
            constants = module_constants(module)
            missing = [name for name in wanted if name not in constants]
            if missing:
                raise RuntimeError(f"the package wants constants the module lacks: {missing[:3]}")
            runner.load_constants({name: constants[name] for name in wanted}, check_full_update=True,
                                  user_managed=True)
        except (RuntimeError, OSError, ValueError, KeyError) as err:
            log.warning("compiled graph %s does not load here (%s); building it again", path.name, err)
            return None
        _mark_used(path)
        return LoadedPackage(runner)

    def build(self, key: str, module: nn.Module, args: tuple, dynamic: tuple | None = None) -> LoadedPackage:
        """Export `module` on `args` (a tuple of tensors and nested lists of them), compile it ahead of time,
        write the package atomically and return it loaded. dynamic: torch.export's dynamic_shapes for `args`
        (None: every size fixed)."""
        from torch._inductor import aoti_compile_and_package

        self.root.mkdir(parents=True, exist_ok=True)
        exported = torch.export.export(module, args, dynamic_shapes=dynamic, strict=False)
        handle, partial = tempfile.mkstemp(dir=self.root, prefix=f".{key}.", suffix=".pt2")
        os.close(handle)
        try:
            aoti_compile_and_package(exported, package_path=partial,
                                     inductor_configs=dict(FROZEN_OPTIONS if self.frozen
                                                           else PACKAGE_OPTIONS))  # it adds keys
            os.replace(partial, self.path(key))
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        runner = self.load(key, module)
        if runner is None:
            raise RuntimeError(f"a freshly built compiled graph does not load: {self.path(key)}")
        return runner

    def load_or_build(self, key: str, module: nn.Module, args: tuple, what: str, build: bool = True,
                      dynamic: tuple | None = None):
        """The loaded package for `key`; built first (and logged with its time and size) when missing and
        `build`, else None. dynamic: as build()'s."""
        runner = self.load(key, module)
        if runner is not None or not build:
            return runner
        log.info("compiling %s ahead of time (once on this machine; kept in %s)", what, self.root)
        start = time.perf_counter()
        runner = self.build(key, module, args, dynamic)
        log.info("compiled %s in %.0f s (%.1f MB)", what, time.perf_counter() - start,
                 self.path(key).stat().st_size / 1e6)
        return runner

    def summary(self) -> tuple[int, int]:
        """(packages, bytes) in the store."""
        files = list(self.root.glob("*.pt2")) if self.root.is_dir() else []
        return len(files), sum(f.stat().st_size for f in files)

    def unused(self, days: float) -> list[Path]:
        """The packages no process has loaded (or built) for `days` days, oldest first."""
        if not self.root.is_dir():
            return []
        cutoff = time.time() - days * 86400
        old = [f for f in self.root.glob("*.pt2") if f.stat().st_mtime < cutoff]
        return sorted(old, key=lambda f: f.stat().st_mtime)


def _mark_used(path: Path) -> None:
    """Stamp a package as used now (its modification time), so that pruning keeps it."""
    try:
        os.utime(path)
    except OSError:  # a read-only store still serves its packages
        pass


class LoadedPackage:
    """A loaded package, called with tensors and nested lists, tuples or dicts of them as it was exported with.

    The inputs are flattened here, depth first (the order export flattened them in), and handed to the
    package's runner; the generic call of a loaded package parses its input and output specs and walks the
    arguments with pytree on every call, a cost a speculative round pays three times."""

    def __init__(self, compiled):
        self.compiled = compiled  # torch's AOTICompiledModel
        self._run = compiled.loader.boxed_run
        self._out_spec = pytree.treespec_loads(compiled.loader.get_call_spec()[1])

    def __call__(self, *args):
        flat: list[torch.Tensor] = []
        _flatten_tensors(args, flat)
        return pytree.tree_unflatten(self._run(flat), self._out_spec)


def _flatten_tensors(value, out: list) -> None:
    """The tensors in `value` (a tensor, or lists, tuples and dicts of them), depth first, appended to `out`."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _flatten_tensors(item, out)
    elif isinstance(value, dict):  # a mask per layer type: values in insertion order, as pytree flattens a dict
        for item in value.values():
            _flatten_tensors(item, out)


def main(argv: list[str]) -> None:
    """Remove packages unused for `unused_days` (default 14); dry_run=true only lists them."""
    args = key_values("graph_store", argv, ("unused_days", "dry_run"))
    try:
        days = float(args.get("unused_days", 14))
    except ValueError:
        raise SystemExit(f"graph_store: unused_days must be a number, got {args['unused_days']!r}") from None
    dry_run = args.get("dry_run", "false").lower()
    if days < 0 or dry_run not in ("true", "false"):
        raise SystemExit("graph_store: unused_days must be >= 0 and dry_run true or false")
    store = GraphStore()
    old = store.unused(days)
    size = sum(f.stat().st_size for f in old)
    for f in old:
        print(f"{'would remove' if dry_run == 'true' else 'removing'} {f.name} (last used "
              f"{time.strftime('%Y-%m-%d', time.localtime(f.stat().st_mtime))})")
        if dry_run == "false":
            f.unlink()
    count, left = store.summary()
    if dry_run == "false":
        unpacked, freed = remove_orphaned_extractions()
        print(f"{unpacked} unpacked copies left by stopped processes removed from the temporary directory "
              f"({freed / 1e6:.0f} MB)")
    print(f"{len(old)} packages unused for {days:g} days ({size / 1e6:.0f} MB) "
          f"{'found' if dry_run == 'true' else 'removed'}; {count} left in {store.root} ({left / 1e6:.0f} MB)")


if __name__ == "__main__":
    main(sys.argv[1:])
