"""What a build records of its sources and shows while it runs (issue 17): `inspect` shows the
manifest's provenance (rvcompile/provenance.py: the checkpoint's path and digest, or the random
seed, the build options, the toolchain), which read_manifest checks; the build's phases as one
line each when stderr is not a terminal."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.artifacts.manifest import parse_manifest
from rvcompile.cli import app

MODEL = Path(__file__).resolve().parents[1] / "models" / "rv-gemma4-tiny"
SMALL = ["--target", "xla-f32", "--platforms", "cpu", "--prefill-buckets", "16", "--max-seqs",
         "1", "--max-context", "64"]
PHASES = ["digest rv-gemma4-tiny", "read", "passes", "export StableHLO", "quantize + write weights",
          "hash"]


def _cli(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("src") / "tiny.rvp"
    r = _cli("build", str(MODEL), *SMALL, "-o", str(out))
    assert r.exit_code == 0, r.output
    return out, r.stderr


def test_build_prints_one_line_per_phase(built):
    _, stderr = built
    done = re.findall(r"^rvcompile: (.+) done in \d+\.\d s$", stderr, re.M)
    assert done == PHASES, stderr


def test_no_progress_prints_no_phases(tmp_path):
    r = _cli("build", "gemma-4-tiny-dense", "--random-weights", *SMALL, "--no-progress", "-o",
             str(tmp_path / "x.rvp"))
    assert r.exit_code == 0, r.output
    assert "done in" not in r.stderr and r.stderr.startswith("wrote ")


def test_inspect_shows_the_checkpoint_and_its_digest(built):
    out, _ = built
    stored = json.loads(_cli("inspect", str(out), "--json").output)["provenance"]
    files = stored["inputs"]["model"]
    assert any(n.endswith(".safetensors") for n in files) and "config.json" in files
    assert files == {n: hashlib.sha256((MODEL / n).read_bytes()).hexdigest() for n in files}
    digest = hashlib.sha256("".join(f"{files[n]}  {n}\n" for n in sorted(files)).encode())
    assert stored["recipe"]["model"]["digest"] == f"sha256:{digest.hexdigest()}"
    r = _cli("inspect", str(out))
    assert f"weights           checkpoint {MODEL}\n" in r.output
    assert f"digest sha256:{digest.hexdigest()} ({len(files)} files hashed)" in r.output
    options = r.output.split("build options")[1].split("\ntoolchain")[0].split()
    assert "max_context=64" in options and "prefill_buckets=16" in options
    assert stored["recipe"]["options"]["prefill_buckets"] == [16]
    assert stored["recipe"]["options"]["decode_loop_steps"] == 16  # the target's default


def test_inspect_shows_the_random_seed(tmp_path):
    out = tmp_path / "r.rvp"
    r = _cli("build", "gemma-4-tiny-dense", "--random-weights", "--seed", "7", *SMALL,
             "--no-progress", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert "weights           random, seed 7 (shapes of gemma-4-tiny-dense)\n" in _cli(
        "inspect", str(out)).output


@pytest.mark.parametrize(("path", "value", "error"), [
    (("inputs", "model", "config.json"), "abc", "manifest.provenance.inputs.model.config.json"),
    (("inputs", "model"), {"../x": "0" * 64}, "is not a file name"),
    (("inputs", "weights"), {}, "an input is one of"),
    (("recipe", "target"), "xla-bf16", "differs from the header's"),
    (("toolchain", "rvcompile"), "0.0.0", "differs from the header's compiler_version"),
])
def test_manifest_provenance_is_checked(built, path, value, error):
    out, _ = built
    with Artifact.open(out) as art:
        manifest = copy.deepcopy(art.manifest)
        sizes = {n: s.size for n, s in art.sections.items()}
        header = art.header
    parse_manifest(header, manifest, sizes, "x.rvp")
    at = manifest["provenance"]
    for key in path[:-1]:
        at = at[key]
    at[path[-1]] = value
    with pytest.raises(ArtifactError, match=re.escape(error)):
        parse_manifest(header, manifest, sizes, "x.rvp")


def test_h100_build_shows_lowering_and_nvcc_as_phases(tmp_path):
    """nvcc is its own phase, counted in modules (stub cubins stand in for nvcc's here)."""
    from stub_cubins import stub_nvcc

    with stub_nvcc():
        r = _cli("build", "gemma-4-tiny-dense", "--random-weights", "--target", "h100-fp8",
                 "--max-context", "64", "--prefill-buckets", "8", "--max-seqs", "1", "-o",
                 str(tmp_path / "h.rvp"))
    assert r.exit_code == 0, r.output
    done = re.findall(r"^rvcompile: (.+) done in \d+\.\d s$", r.stderr, re.M)
    assert done == ["read", "passes", "lower for h100", "nvcc", "quantize + write weights",
                    "hash"], r.stderr
