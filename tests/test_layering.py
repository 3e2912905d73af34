"""The packages follow the data flow (docs/DESIGN.md): every `import` of every module under
rvcompile/, read with ast (module level and inside functions alike), checked against the layers.

- the runtime (and the artifact format it reads) imports no compiler code;
- a target imports neither the runtime nor another target;
- no two units import each other, directly or round a longer loop.

A unit is a top-level package or module of rvcompile (`model`, `sources`, `ir`, `passes`,
`artifacts`, `runtime`, `build`, `cli`, the shared leaves `dtypes`, `chat_template` and
`yaml_file`, `progress`), each target family (`targets.xla`, `targets.h100`: a package under
targets/) counting as its own; `targets` itself is the interface and registry every family
implements (targets/api.py, targets/__init__.py).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "rvcompile"
COMPILER = {"model", "sources", "ir", "passes", "targets", "build", "cli"}
LEAVES = {"dtypes", "chat_template", "yaml_file", "progress"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str:
    """The unit of a dotted module name under rvcompile ("" for the package's own __init__)."""
    parts = module.split(".")[1:]
    if not parts:
        return ""
    if parts[0] == "targets" and len(parts) > 1 and (PKG / "targets" / parts[1]).is_dir():
        return f"targets.{parts[1]}"
    return parts[0]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every rvcompile module `path` imports; `from P import X` names
    P.X (X may be a submodule; a name defined in P lands in P's unit all the same)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return [(line, m) for line, m in out if m == "rvcompile" or m.startswith("rvcompile.")]


@functools.cache
def edges() -> list[tuple[str, str, str]]:
    """(importing unit, imported unit, 'file:line imports module') for every cross-unit import."""
    out = []
    for path in sorted(PKG.rglob("*.py")):
        src = unit(module_name(path))
        for line, mod in imported_modules(path):
            dst = unit(mod)
            if dst not in (src, ""):
                out.append((src, dst, f"{path.relative_to(PKG.parent)}:{line} imports {mod}"))
    return out


def test_the_walk_sees_the_layers():
    """The checks below can fail: the walk finds the imports every layer is known to make."""
    found = {(a, b) for a, b, _ in edges()}
    assert {("runtime", "artifacts"), ("build", "targets"), ("sources", "model"),
            ("ir", "model"), ("passes", "ir"), ("targets.h100", "artifacts"),
            ("targets.h100", "targets"), ("targets.xla", "targets")} <= found
    assert unit("rvcompile.targets.h100.moe") == "targets.h100"
    assert unit("rvcompile.targets.api.Target") == unit("rvcompile.targets.registry") == "targets"
    assert unit("rvcompile.runtime.executors.xla") == "runtime"


@pytest.mark.parametrize("layer", ["runtime", "artifacts", *sorted(LEAVES)])
def test_the_runtime_side_imports_no_compiler_code(layer):
    allowed = {"runtime", "artifacts", *LEAVES} if layer == "runtime" else {"artifacts"}
    bad = [why for a, b, why in edges() if a == layer and b.split(".")[0] not in allowed]
    assert not bad, "\n".join(bad)


def test_targets_import_neither_the_runtime_nor_each_other():
    bad = [why for a, b, why in edges()
           if a.startswith("targets.") and (b == "runtime" or b.startswith("targets."))]
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_units():
    graph: dict[str, dict[str, str]] = {}
    for a, b, why in edges():
        graph.setdefault(a, {}).setdefault(b, why)
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            loop = path[path.index(node):] + [node]
            pytest.fail("import cycle " + " -> ".join(loop) + ":\n" + "\n".join(
                graph[x][y] for x, y in zip(loop, loop[1:], strict=False)))
        if node in done:
            return
        for nxt in graph.get(node, {}):
            visit(nxt, [*path, node])
        done.add(node)

    for start in sorted(graph):
        visit(start, [])
