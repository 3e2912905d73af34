"""Targets as plugins (targets/api.py): the registry, that the driver and the CLIs name no target
(tests/test_layering.py checks the arrows between packages), what each target decides
(options, KV rules), and `rvcompile inspect` asking the artifact's target for its summary (an
h100 artifact with stub cubins: no nvcc needed)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from stub_cubins import build_h100
from typer.testing import CliRunner

import rvcompile
from rvcompile.artifacts.kernel_schedule import SCHEDULE_VERSION
from rvcompile.artifacts.manifest import RUNTIMES as MANIFEST_RUNTIMES
from rvcompile.build import BuildOptions, kv_cache_choice, prepare
from rvcompile.cli import app
from rvcompile.runtime import RUNTIMES
from rvcompile.sources.model_source import CheckpointError
from rvcompile.targets import get_target, registry

ROOT = Path(rvcompile.__file__).parent
def _rvcompile_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("rvcompile")}


def test_registry():
    targets = registry()
    assert list(targets) == ["tpu-bf16", "tpu-int8", "xla-f32", "xla-fp8", "h100-fp8", "h100-f32"]
    for name, t in targets.items():
        assert t.name == name
        assert t.runtime in RUNTIMES  # some rvrun opens what it builds
        names = [n for n, _ in t.passes]
        assert len(names) == len(set(names)), name
    with pytest.raises(CheckpointError, match="unknown target 'gpu-f16' \\(known: tpu-bf16, "):
        get_target("gpu-f16")


def test_every_runtime_kind_an_artifact_may_name_has_an_executor():
    assert set(RUNTIMES) == set(MANIFEST_RUNTIMES)


def test_build_and_cli_name_no_target():
    """build.py, the CLI and the runtime find targets through the registry, never by name."""
    for rel in ("build.py", "cli.py", "runtime/__init__.py", "runtime/cli.py"):
        text = (ROOT / rel).read_text()
        for name in registry():
            assert name not in text, f"{rel} names target {name}"
        assert not {m for m in _rvcompile_imports(ROOT / rel)
                    if m.startswith("rvcompile.targets.")} - {"rvcompile.targets.api"}, rel


@pytest.mark.parametrize("target,steps", [("tpu-bf16", 32), ("xla-f32", 8), ("h100-f32", 0)])
def test_decode_loop_default_is_the_targets(target, steps):
    buckets = (16, 64) if steps != 8 else (8,)
    _, opts = prepare(BuildOptions(target, max_context=128, prefill_buckets=buckets,
                                   decode_loop_steps=None))
    assert opts.decode_loop_steps == steps


def test_h100_options_refused_by_the_target():
    with pytest.raises(CheckpointError, match="--topology v6e:2x2: target h100-fp8 has no "
                                              "precompiled executables"):
        prepare(BuildOptions("h100-fp8", topologies=("v6e:2x2",)))
    _, opts = prepare(BuildOptions("h100-fp8"))
    assert opts.platforms == ("cuda",)


def test_kv_rules_are_data():
    assert get_target("h100-fp8").kv.choices() == ("float", "fp8")
    assert get_target("h100-f32").kv.choices() == ("float",)
    assert get_target("xla-f32").kv.resolve_auto(1 << 20) == "float"
    assert get_target("tpu-int8").kv.resolve_auto(32769) == "int8"
    with pytest.raises(CheckpointError, match=r"--kv-cache fp8: target tpu-int8 has no fp8 KV "
                                              r"cache \(targets with one: h100-fp8\)"):
        kv_cache_choice(BuildOptions("tpu-int8", kv_cache="fp8"), 128)


def test_targets_command_lists_each():
    r = CliRunner().invoke(app, ["targets"])
    assert r.exit_code == 0, r.output
    for name, t in registry().items():
        assert f"{name:10} {t.emits}" in r.stdout


@pytest.fixture(scope="module")
def h100_artifact(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("targets") / "tiny-h100.rvp"
    return build_h100(out, "gemma-4-tiny", BuildOptions("h100-fp8", max_context=64,
                                                        prefill_buckets=(8, 16), max_seqs=2))


def test_inspect_asks_the_h100_target(h100_artifact):
    r = CliRunner().invoke(app, ["inspect", str(h100_artifact)])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert "target            h100-fp8" in lines
    assert ("entry_points      ['decode_1', 'decode_2', 'logits_16', 'prefill_16', 'prefill_8', "
            "'sampled_decode_1', 'sampled_decode_2', 'sampled_prefill_16', 'sampled_prefill_8']"
            in lines)
    schedule = next(line for line in lines if line.startswith("schedule"))
    assert f"version {SCHEDULE_VERSION}: arena" in schedule and "launches of" in schedule
    assert any(line.startswith("  decode_2") and line.endswith("(CUDA graph)") for line in lines)
    assert any(line.startswith("  KV bfloat16, blocks of") for line in lines)
    assert ("piece_hash        sha256.cu:sha256_pieces (the GPU hashes the weights' pieces)"
            in lines)
    r = CliRunner().invoke(app, ["inspect", str(h100_artifact), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["requirements"]["runtime"] == "h100" and info["arch"] == "sm_90a"
    assert info["max_seqs"] == 2 and info["max_context"] == 64
    s = info["schedule"]
    assert s["entries"]["decode_2"]["graph"] and s["entries"]["prefill_8"]["graph"]
    assert not s["entries"]["logits_16"]["graph"]
    assert sum(e["launches"] for e in s["entries"].values()) == s["launches"]
    assert set(s["kv"]["kinds"]) == {"full", "sliding"}
