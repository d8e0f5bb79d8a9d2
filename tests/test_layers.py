"""The package's layers import in one direction only, and no module imports itself back in a circle.

Every `import eagle_lab...` counts, function-local ones included, so a circle cannot hide inside a
function. A module may import its own layer and the layers below it, never one above.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "eagle_lab"

# top to bottom; a module belongs to the first layer one of whose prefixes it starts with
LAYERS = [
    ("entry points", ["eagle_lab.serve", "eagle_lab.train", "eagle_lab.export", "eagle_lab.compile",
                     "eagle_lab.training.trainer"]),
    ("benchmark", ["eagle_lab.benchmark"]),
    ("serving", ["eagle_lab.serving"]),
    ("builders and configs", ["eagle_lab.builders", "eagle_lab.config"]),
    ("tree search and training", ["eagle_lab.tree_search", "eagle_lab.training"]),
    ("drafters", ["eagle_lab.drafters"]),
    ("decoding", ["eagle_lab.decoding"]),
    ("models", ["eagle_lab.models"]),
    ("base", ["eagle_lab.errors", "eagle_lab.conf", "eagle_lab"]),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle_lab"):
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("eagle_lab"))
        graph[module_name(path)] = found
    return graph


def layer_of(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        if module == "eagle_lab" or any(module == p or module.startswith(p + ".")
                                        for p in prefixes if p != "eagle_lab"):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")


def test_every_module_has_a_layer_and_imports_only_downwards():
    upward = []
    for module, targets in imports().items():
        for target in targets:
            if layer_of(target) < layer_of(module):
                upward.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                              f"({LAYERS[layer_of(target)][0]})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_circles():
    graph = imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue
            if state.get(target) == 1:
                return path + [module, target]
            if state.get(target) is None:
                found = visit(target, path + [module])
                if found:
                    return found
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            circle = visit(module, [])
            assert circle is None, " -> ".join(circle)


def test_the_check_sees_an_upward_import():
    assert layer_of("eagle_lab.decoding.sequence") > layer_of("eagle_lab.serving.engine")
    assert layer_of("eagle_lab.errors") == len(LAYERS) - 1


def test_the_top_level_holds_the_entry_points_and_configs_only():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 8, modules


def test_no_module_is_longer_than_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400}
    assert not long, long


def test_no_two_modules_share_a_name_with_different_jobs():
    """Modules with one name in several folders are the same job for different kinds (drafters/*/drafter.py);
    any other repeated name is a collision a reader would trip over."""
    allowed = {"__init__", "drafter"}
    seen: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        seen.setdefault(path.stem, []).append(str(path.relative_to(PACKAGE)))
    repeated = {name: where for name, where in seen.items() if len(where) > 1 and name not in allowed}
    assert not repeated, repeated
