"""The slim installs (pyproject extras): `pip install 'rvcompile[h100,serve]'` runs and serves an
h100 artifact without jax, torch, transformers or the compiler's own dependencies.

- What the h100 runtime and the server import, read from the source (every import statement,
  those inside functions too, following rvcompile's own modules from rvrun's entry points and
  the h100 executor), is exactly what the base dependencies and the h100 and serve extras
  declare; the xla executor needs nothing beyond the base and the xla extra.
- In a process where jax, jaxlib, torch, transformers, flax, typer, safetensors, ml_dtypes and
  rich cannot be imported: the runtime, rvrun's CLI, the h100 executor and the server import;
  `rvrun --help` and `rvrun serve --help` work; loading an h100 artifact goes as far as the GPU
  and is refused there in one line (no CUDA device or driver here; on a GPU host, cuda-python is
  blocked too so the refusal comes at the same point); an XLA artifact is refused naming the
  extra to install.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from stub_cubins import build_h100

import rvcompile
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.runtime import RUNTIMES

ROOT = Path(rvcompile.__file__).parent
PYPROJECT = ROOT.parent / "pyproject.toml"
# The compiler's and the tests' heavy dependencies: none may be needed to run an h100 artifact.
BLOCKED = ("jax", "jaxlib", "torch", "transformers", "flax", "typer", "safetensors",
           "ml_dtypes", "rich")
# Import name -> the distribution pyproject declares for it.
DISTRIBUTION = {
    "numpy": "numpy", "tokenizers": "tokenizers", "jinja2": "jinja2",
    "cryptography": "cryptography", "cuda": "cuda-python", "fastapi": "fastapi",
    "uvicorn": "uvicorn", "prometheus_client": "prometheus-client", "pydantic": "pydantic",
    "starlette": "starlette", "yaml": "pyyaml", "jax": "jax", "jaxlib": "jaxlib",
    "ml_dtypes": "ml-dtypes", "llguidance": "llguidance",
}
# rvrun's entry points and the server: where an h100 host's imports start.
H100_HOST = ("rvcompile.runtime", "rvcompile.runtime.cli", RUNTIMES["h100"],
             "rvcompile.runtime.serve.server")
TINY = {"max_context": 64, "prefill_buckets": (8,), "max_seqs": 1}


# ---------------------------------------------------------------------------------------------
# Declared against imported


def _module_file(name: str) -> Path | None:
    """rvcompile's module `name` as a file, or None if there is none of that name."""
    rel = Path(*name.split(".")[1:])
    for path in (ROOT / rel / "__init__.py", (ROOT / rel).with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _imports(path: Path) -> set[str]:
    """Every module `path` imports anywhere in its body, as dotted names; `from a import b`
    gives a.b as well when b is a module."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names
                       if node.module.startswith("rvcompile") and
                       _module_file(f"{node.module}.{a.name}") is not None)
    return out


def third_party_imports(*roots: str) -> set[str]:
    """The top-level names of what `roots` import, following rvcompile's modules (and their
    parent packages), less the standard library."""
    seen: set[str] = set()
    todo = [*roots]
    outside: set[str] = set()
    while todo:
        name = todo.pop()
        parts = name.split(".")
        if parts[0] != "rvcompile":
            outside.add(parts[0])
            continue
        for i in range(1, len(parts) + 1):
            parent = ".".join(parts[:i])
            if parent in seen:
                continue
            seen.add(parent)
            path = _module_file(parent)
            assert path is not None or parent == "rvcompile", f"no module {parent}"
            if path is not None:
                todo.extend(_imports(path))
    return outside - set(sys.stdlib_module_names) - {"__future__"}


def declared(*extras: str) -> set[str]:
    """The distributions of the base dependencies and `extras`, by name."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    specs = [*project["dependencies"]]
    for extra in extras:
        specs += project["optional-dependencies"][extra]
    names = set()
    for spec in specs:
        end = next((i for i, c in enumerate(spec) if c in "<>=!~[;( "), len(spec))
        names.add(spec[:end].lower().replace("_", "-"))
    return names


def _distributions(imports: set[str]) -> set[str]:
    unknown = sorted(imports - set(DISTRIBUTION))
    assert not unknown, f"imports {unknown}: add them to DISTRIBUTION and to pyproject"
    return {DISTRIBUTION[name] for name in imports}


def test_h100_and_serve_extras_are_what_the_h100_runtime_imports():
    needed = _distributions(third_party_imports(*H100_HOST))
    assert needed == declared("h100", "serve")
    assert not needed & {DISTRIBUTION.get(b, b) for b in BLOCKED}


# Imported by the runtime only when a request needs it (a grammar constraint: structured
# outputs), which is refused in one line naming the extra when it is missing
# (tests/test_sampler_extras.py checks the refusal): import name -> the extra that brings it.
OPTIONAL = {"llguidance": "serve"}


def test_xla_runtime_needs_only_the_xla_extra():
    imports = third_party_imports(RUNTIMES["xla"])
    needed = _distributions(imports - set(OPTIONAL))
    assert {"jax", "jaxlib", "ml-dtypes"} <= needed <= declared("xla")
    for name, extra in OPTIONAL.items():
        assert DISTRIBUTION[name] in declared(extra)


def test_import_scan_sees_imports_inside_functions():
    """runtime/cli.py imports the server only when serving, and cuda-python is imported where
    the driver is first needed: both are found."""
    assert {"fastapi", "uvicorn"} <= third_party_imports("rvcompile.runtime.cli")
    assert "cuda" in third_party_imports(RUNTIMES["h100"])


def test_test_extra_installs_every_other_extra():
    """scripts/setup.sh installs `test`; tpu-aot's libtpu it puts aside (see there)."""
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    own = [s for s in extras["test"] if s.startswith("rvcompile[")]
    assert len(own) == 1
    assert set(own[0].removeprefix("rvcompile[").removesuffix("]").split(",")) == (
        set(extras) - {"test", "tpu-aot"})


# ---------------------------------------------------------------------------------------------
# Run with the heavy dependencies blocked

BLOCKER = f"""
import importlib.abc, sys
BLOCKED = {BLOCKED!r}

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{{name}} is blocked (not in the h100,serve install)",
                                      name=name)
        return None

sys.meta_path.insert(0, Blocked())
"""


def run_blocked(code: str, *, also_blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    prelude = BLOCKER.replace("BLOCKED = (", f"BLOCKED = {also_blocked!r} + (", 1)
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_the_blocker_blocks():
    p = run_blocked("import jax")
    assert p.returncode == 1 and "jax is blocked" in p.stderr


def test_h100_host_imports():
    p = run_blocked(f"""
import importlib
for name in {H100_HOST!r}:
    importlib.import_module(name)
print(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
""")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["ppl", "--help"]])
def test_rvrun_help(argv):
    p = run_blocked(f"""
from rvcompile.runtime.cli import main
try:
    main({argv!r})
except SystemExit as e:
    sys.exit(e.code)
""")
    assert p.returncode == 0, p.stderr
    assert "usage: rvrun" in p.stdout


def _gpu_here() -> bool:
    try:
        from rvcompile.runtime.executors.cuda_driver import CudaContext, CudaError

        CudaContext()
    except (ImportError, CudaError):
        return False
    return True


@pytest.fixture(scope="module")
def h100_artifact(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("installs") / "tiny-h100.rvp"
    return build_h100(out, "gemma-4-tiny", BuildOptions("h100-fp8", **TINY))


@pytest.mark.parametrize("command", ["run", "serve"])
def test_h100_artifact_loads_up_to_the_gpu(h100_artifact, command):
    """rvrun reads, checks and verifies the artifact and imports the h100 executor; the one
    thing missing is a CUDA device (a GPU host: cuda-python, blocked as well)."""
    args = [str(h100_artifact), "--prompt", "Hi"] if command == "run" else [
        "serve", str(h100_artifact), "--port", "0"]
    p = run_blocked(f"""
from rvcompile.runtime.cli import main
code = main({args!r})
print(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
sys.exit(code)
""", also_blocked=("cuda",) if _gpu_here() else ())
    assert p.returncode == 2, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("rvrun: error:")]
    assert len(errors) == 1, p.stderr
    assert "tiny-h100.rvp: needs an NVIDIA H100 (CUDA): " in errors[0], errors[0]
    assert "Traceback" not in p.stderr
    assert p.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def xla_artifact(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("installs") / "tiny-xla.rvp"
    build_artifact("gemma-4-tiny", out, BuildOptions("xla-f32", platforms=("cpu",), **TINY),
                   random_weights=True, progress=False, log=lambda s: None)
    return out


def test_xla_artifact_without_jax_names_the_extra(xla_artifact):
    p = run_blocked(f"""
from rvcompile.runtime.cli import main
sys.exit(main([{str(xla_artifact)!r}, "--prompt", "Hi"]))
""")
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        "rvrun: error: tiny-xla.rvp: the xla runtime needs jax, which is not installed (pip "
        "install 'rvcompile[xla]')"]
