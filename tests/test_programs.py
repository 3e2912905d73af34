"""The artifact's exported programs are checked before anything compiles them
(rvcompile/runtime/executors/programs.py, issue 12).

A program's StableHLO can name any custom-call target. One that jax.export would never have
written, a host callback with no callback behind it, crashes the process when it runs (measured:
jaxlib 0.10.2 on the CPU, `xla_ffi_python_cpu_callback` with index 0 and no callbacks, SIGSEGV).
Such a program, or one that disables jax.export's safety checks, is refused at load in one line,
before compiling; what rvcompile builds passes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import pytest
from jax import export

from rvcompile.artifacts import Artifact, ArtifactError, ArtifactWriter
from rvcompile.artifacts.manifest import read_manifest
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.runtime.executors.programs import custom_call_targets, load_programs

CALLBACK = """\
module @jit_f attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<3xf32>) -> (tensor<3xf32>) {
    %0 = stablehlo.custom_call @xla_ffi_python_cpu_callback(%arg0) {api_version = 4 : i32,
      backend_config = {index = 0 : ui64}} : (tensor<3xf32>) -> tensor<3xf32>
    return %0 : tensor<3xf32>
  }
}
"""


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("programs") / "plain.rvp"
    build_artifact("gemma-4-tiny-dense", out,
                   BuildOptions(target="xla-f32", max_context=64, prefill_buckets=(16,), max_seqs=1,
                                platforms=("cpu",)), random_weights=True, progress=False,
                   log=lambda s: None)
    return out


def _with_program(src: Path, dst: Path, name: str, exp: export.Exported) -> None:
    """A copy of `src` whose program `name` is `exp`, digests consistent."""
    with Artifact.open(src) as art:
        m = art.manifest
        blob = art.buffer("programs")
        programs = {n: bytes(blob[loc["offset"]:loc["offset"] + loc["size"]])
                    for n, loc in m["xla"]["programs"].items()}
        programs[name] = bytes(exp.serialize())
        data, locs, offset = b"", {}, 0
        for n in sorted(programs):
            locs[n] = {**m["xla"]["programs"][n], "offset": offset, "size": len(programs[n])}
            data += programs[n]
            offset += len(programs[n])
        with ArtifactWriter(dst, art.header) as w:
            for section in art.sections:
                w.add(section, data if section == "programs" else art.buffer(section))
            w.commit({**m, "xla": {**m["xla"], "programs": locs}})


def _program(art_path: Path, name: str) -> export.Exported:
    with Artifact.open(art_path) as art:
        return load_programs(art, read_manifest(art).xla)[name]


def _module_bytes(text: str) -> bytes:
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context():
        return mlir.module_to_bytecode(ir.Module.parse(text))


def test_built_programs_call_only_stable_targets(plain):
    with Artifact.open(plain) as art:
        programs = load_programs(art, read_manifest(art).xla)
    assert sorted(programs) == ["decode_1", "logits_16", "prefill_16"]
    for exp in programs.values():
        assert custom_call_targets(exp) <= {"shape_assertion"}
        assert exp.disabled_safety_checks == ()


def test_a_host_callback_is_refused_before_compiling(plain, tmp_path):
    from rvcompile.runtime import load

    exp = dataclasses.replace(_program(plain, "logits_16"),
                              mlir_module_serialized=_module_bytes(CALLBACK))
    assert custom_call_targets(exp) == {"xla_ffi_python_cpu_callback"}
    bad = tmp_path / "bad.rvp"
    _with_program(plain, bad, "logits_16", exp)
    with pytest.raises(ArtifactError) as e:
        load(bad)
    assert str(e.value) == ("bad.rvp: program logits_16: calls custom target "
                            "'xla_ffi_python_cpu_callback', which rvrun does not run (not one "
                            "jax.export keeps stable)")


def test_disabled_safety_checks_are_refused(plain, tmp_path):
    exp = dataclasses.replace(
        _program(plain, "logits_16"),
        disabled_safety_checks=(export.DisabledSafetyCheck.custom_call("anything"),))
    bad = tmp_path / "bad.rvp"
    _with_program(plain, bad, "logits_16", exp)
    with Artifact.open(bad) as art, pytest.raises(ArtifactError) as e:
        load_programs(art, read_manifest(art).xla)
    assert str(e.value).startswith("bad.rvp: program logits_16: disables jax.export safety "
                                   "checks (")
    assert "\n" not in str(e.value)


def test_a_damaged_program_is_refused_in_one_line(plain, tmp_path):
    exp = dataclasses.replace(_program(plain, "logits_16"), mlir_module_serialized=b"ML\xefR!!")
    bad = tmp_path / "bad.rvp"
    _with_program(plain, bad, "logits_16", exp)
    with Artifact.open(bad) as art, pytest.raises(ArtifactError) as e:
        load_programs(art, read_manifest(art).xla)
    assert str(e.value).startswith("bad.rvp: program logits_16: its StableHLO does not parse: ")
    assert "\n" not in str(e.value)
    assert jax.devices()  # the process is whole
