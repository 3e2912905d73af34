"""What a build records of its sources and shows while it runs (issue 17): the manifest's
`source` (the checkpoint's path and digest, or the random seed, and the build options),
checked by read_manifest and shown by `inspect`; the build's phases as one line each when
stderr is not a terminal."""

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
from rvcompile.sources import provenance

MODEL = Path(__file__).resolve().parents[1] / "models" / "rv-gemma4-tiny"
SMALL = ["--target", "xla-f32", "--platforms", "cpu", "--prefill-buckets", "16", "--max-seqs",
         "1", "--max-context", "64"]
PHASES = ["read", "hash checkpoint", "passes", "lower for xla-f32", "quantize + write weights",
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
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(MODEL.iterdir())
             if p.suffix in (".safetensors", ".json", ".jinja")}
    assert any(n.endswith(".safetensors") for n in files)
    digest = hashlib.sha256("".join(f"{n} {h}\n" for n, h in sorted(files.items())).encode())
    r = _cli("inspect", str(out))
    assert f"weights           checkpoint {MODEL}\n" in r.output
    assert f"digest {digest.hexdigest()} ({len(files)} files hashed)" in r.output
    options = r.output.split("build options")[1].split("\njax_version")[0].split()
    assert "max_context=64" in options and "target=xla-f32" in options
    source = json.loads(_cli("inspect", str(out), "--json").output)["source"]
    assert source["weights"]["files"] == files
    assert source["options"]["prefill_buckets"] == [16]
    assert source["options"]["decode_loop_steps"] == 16  # the target's default, as it took it


def test_inspect_shows_the_random_seed(tmp_path):
    out = tmp_path / "r.rvp"
    r = _cli("build", "gemma-4-tiny-dense", "--random-weights", "--seed", "7", *SMALL,
             "--no-progress", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert "weights           random, seed 7\n" in _cli("inspect", str(out)).output


@pytest.mark.parametrize(("path", "value", "error"), [
    (("weights", "digest"), "abc", "manifest.source.weights.digest: expected a string matching"),
    (("weights", "kind"), "http", "manifest.source.weights.kind: expected one of"),
    (("weights", "files"), {"../x": "0" * 64}, "is not a file name"),
    (("options", "tp"), {"a": 1}, "manifest.source.options.tp: expected null, true, false"),
    (("options",), {"bad name!": 1}, "is not an option name"),
    (("weights", "path"), "a\nb", "manifest.source.weights.path: expected a printable string"),
])
def test_manifest_source_is_checked(built, path, value, error):
    out, _ = built
    with Artifact.open(out) as art:
        manifest = copy.deepcopy(art.manifest)
        sizes = {n: s.size for n, s in art.sections.items()}
        header = art.header
    parse_manifest(header, manifest, sizes, "x.rvp")
    at = manifest["source"]
    for key in path[:-1]:
        at = at[key]
    at[path[-1]] = value
    with pytest.raises(ArtifactError, match=re.escape(error)):
        parse_manifest(header, manifest, sizes, "x.rvp")


def test_weights_directory_rule():
    assert provenance.weights_directory("m", None, True) is None
    assert provenance.weights_directory("m", Path("w"), False) == Path("w")
    assert provenance.weights_directory("m", None, False) == Path("m")
