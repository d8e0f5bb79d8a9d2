"""Compiled graphs kept on disk: a package built in one process serves a later one, equal to eager decoding;
a package that anything it depends on has changed under is rebuilt, never loaded; a package runs the weights
of the module it is bound to, not those it was built with."""

import os
import time

import pytest
import torch

from eagle_lab.decoding import compiled, graph_store
from eagle_lab.decoding.backend import DecodingConfig, EagerBackend, StaticBackend, build_backend
from eagle_lab.decoding.generate import Stopper, generate, vanilla_decode
from eagle_lab.decoding.graph_store import GraphStore
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.models.target import Target
from eagle_lab.models.tiny import TinyModelConfig, build_tiny_model, byte_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    """Each test builds into its own empty store."""
    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path))
    return tmp_path / graph_store.STORE_DIR


def tiny(seed: int = 0) -> Target:
    model = build_tiny_model(TinyModelConfig(family="llama", seed=seed), vocab_size=byte_tokenizer().vocab_size)
    return Target(model, byte_tokenizer(), name="tiny_llama")


def greedy(target: Target, backend, tokens: int = 12) -> list[int]:
    prompt = torch.tensor(target.tokenizer.encode("Packages outlive the process."))
    return generate(vanilla_decode(target, prompt, SamplingParams(), Stopper(target.tokenizer, tokens, set()),
                                   backend=backend)).token_ids


def backend_for(target: Target, build: bool) -> StaticBackend:
    return StaticBackend(target, [1], 64, compiled=True, min_attended_length=0, build=build)


def test_a_package_built_once_serves_a_later_backend_equal_to_eager(store_dir, monkeypatch):
    target = tiny()
    reference = greedy(target, EagerBackend(target))
    assert greedy(target, backend_for(target, build=True)) == reference
    packages = sorted(store_dir.glob("*.pt2"))
    assert packages and all(p.stat().st_size < 50e6 for p in packages)  # code only: no weights inside

    def no_build(*args, **kwargs):
        raise AssertionError("a package that exists was built again")

    monkeypatch.setattr(GraphStore, "build", no_build)
    month_ago = time.time() - 30 * 86400
    for package in packages:
        os.utime(package, (month_ago, month_ago))
    later = backend_for(target, build=False)  # what a later process with compile=auto does in a short run
    assert later.has_graphs()
    assert greedy(target, later) == reference
    assert later._steps._graphs and not later._steps._missing  # it ran the package, not eager fallbacks
    assert not GraphStore().unused(days=14)  # loading stamped them as used: pruning keeps them


def test_a_stale_package_is_rebuilt_not_loaded(store_dir, monkeypatch):
    target = tiny()
    reference = greedy(target, EagerBackend(target))
    greedy(target, backend_for(target, build=True))
    built = set(store_dir.glob("*.pt2"))
    real = graph_store.environment()
    monkeypatch.setattr(graph_store, "environment", lambda: {**real, "torch": "0.0.0-other"})
    other = backend_for(target, build=False)
    assert not other.has_graphs()  # another torch: the package is not found
    assert greedy(target, other) == reference  # ... and the step ran eagerly
    assert other._steps._missing
    rebuilt = backend_for(target, build=True)
    assert greedy(target, rebuilt) == reference
    assert set(store_dir.glob("*.pt2")) - built  # built anew under its own key


def test_a_package_runs_the_weights_it_is_bound_to(store_dir):
    first, second = tiny(seed=0), tiny(seed=1)  # same shapes, other weights
    greedy(first, backend_for(first, build=True))
    count = len(list(store_dir.glob("*.pt2")))
    out = greedy(second, backend_for(second, build=False))
    assert len(list(store_dir.glob("*.pt2"))) == count  # the same packages served
    assert out == greedy(second, EagerBackend(second))
    assert out != greedy(first, EagerBackend(first))  # the check can tell the two targets apart


def test_a_package_that_does_not_load_is_rebuilt(store_dir):
    target = tiny()
    reference = greedy(target, EagerBackend(target))
    greedy(target, backend_for(target, build=True))
    for package in store_dir.glob("*.pt2"):
        package.write_bytes(b"not a package")
    assert greedy(target, backend_for(target, build=True)) == reference
    assert all(p.stat().st_size > 100 for p in store_dir.glob("*.pt2"))


def test_compile_auto_in_a_short_run_uses_packages_when_they_exist(store_dir):
    target = tiny()
    config = DecodingConfig(buckets=[1, 4], cache_block=64, min_attended_length=0, cache_capacity=64)
    assert isinstance(build_backend(target, "auto", config, planned_tokens=16), EagerBackend)  # none built yet
    built = build_backend(target, "true", config)
    greedy(target, built)
    short = build_backend(target, "auto", config, planned_tokens=16)
    verdicts = list(compiled._read_verdicts().values())  # compile=auto timed a compiled plain step against eager
    assert len(verdicts) == 1
    if verdicts[0]["choice"] == "compiled":
        assert isinstance(short, StaticBackend) and short.compiled and not short.build
    else:
        assert isinstance(short, EagerBackend)


def test_packages_are_keyed_by_the_ops_tags_too(tmp_path, monkeypatch):
    """A tag that changes how a graph lays out an op's inputs (flexible_layout: the cache's own views) changes what
    a package computes, so the ops' definitions in a package's key carry their tags."""
    from eagle_lab.models import native

    definitions = native.op_schemas()
    attention = [d for d in definitions if d.startswith('"stable_attention(')]
    assert len(attention) == 1 and attention[0].endswith("{at::Tag::flexible_layout}")
    assert any(d.startswith('"stable_linear_q4x8(') for d in definitions)
    source = (native.SOURCE_DIR / "stable_attention.cpp").read_text()
    monkeypatch.setattr(native, "SOURCE_DIR", tmp_path)
    (tmp_path / "stable_attention.cpp").write_text(source.replace("{at::Tag::flexible_layout}", "{}"))
    native.op_schemas.cache_clear()
    try:
        assert native.op_schemas() == (attention[0].replace("{at::Tag::flexible_layout}", "{}"),)  # another key
    finally:
        native.op_schemas.cache_clear()


CHILD = """
import sys, time, torch
from eagle_lab.decoding.backend import StaticBackend
from eagle_lab.decoding.generate import Stopper, generate, vanilla_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.models.target import Target
from eagle_lab.models.tiny import TinyModelConfig, build_tiny_model, byte_tokenizer
model = build_tiny_model(TinyModelConfig(family="llama", seed=0), vocab_size=byte_tokenizer().vocab_size)
target = Target(model, byte_tokenizer(), name="tiny_llama")
backend = StaticBackend(target, [1], 64, compiled=True, min_attended_length=0, build=False)
prompt = torch.tensor(target.tokenizer.encode("Packages outlive the process."))
generate(vanilla_decode(target, prompt, SamplingParams(), Stopper(target.tokenizer, 4, set()), backend=backend))
assert backend._steps._graphs and not backend._steps._missing
print("ready", flush=True)
time.sleep(600)
"""


def test_what_a_killed_process_unpacked_is_removed_once_it_has_ended(store_dir, tmp_path):
    import signal
    import subprocess
    import sys

    from eagle_lab.decoding.package_extractions import remove_orphaned_extractions

    target = tiny()
    greedy(target, backend_for(target, build=True))  # the packages the child loads
    private = tmp_path / "temporary"
    private.mkdir()
    env = {**os.environ, "TMPDIR": str(private), "EAGLE_LAB_CACHE": str(store_dir.parent)}
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        unpacked = list(private.glob("aotinductor_*"))
        assert unpacked  # torch unpacked the package where TMPDIR points
        assert remove_orphaned_extractions([private], min_age_s=0) == (0, 0)  # mapped by a live process
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert all(d.exists() for d in unpacked)  # a killed process cleans nothing up
    removed, freed = remove_orphaned_extractions([private], min_age_s=0)
    assert removed == len(unpacked) and freed > 0
    assert not list(private.glob("aotinductor_*"))


def test_compile_builds_the_known_shapes_in_worker_processes(store_dir, monkeypatch):
    """`python -m eagle_lab.compile` first builds one sequence's bucket steps and the server's plain row steps
    side by side in worker processes; afterwards every one of them is on disk for the main process to load."""
    from eagle_lab import compile as compile_command
    from eagle_lab.models.target import load_target
    from tests.serving_helpers import serve_config

    monkeypatch.setattr(compile_command.os, "cpu_count", lambda: 2)  # workers even on a one-core runner
    cfg = serve_config("target=tiny_llama", "head.path=random", "decoding.buckets=[1,2]", "server.max_batch=2",
                       "server.context=96", "decoding.cache_block=32", "decoding.cache_capacity=128")
    target = load_target(cfg.target)
    backend = build_backend(target, "true", cfg.decoding, compile_ahead=True)
    server = compile_command.rows_capacity(backend, 96)  # a server row: its context and the slack, in blocks
    shapes = [(128, 1, 1), (128, 1, 2), (server, 1, 1), (server, 2, 1)]  # (capacity, rows, tokens)
    assert not any(backend.has_package(*shape) for shape in shapes)
    compile_command._build_known_shapes(cfg, backend)
    assert all(backend.has_package(*shape) for shape in shapes)
