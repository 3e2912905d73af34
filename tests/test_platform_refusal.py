"""An artifact exported only for platforms this machine lacks is refused at load, by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rvcompile import runtime
from rvcompile.artifacts import ArtifactError
from rvcompile.build import BuildOptions, build_artifact


@pytest.fixture(scope="module")
def tpu_only(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plat") / "tpu_only.rvp"
    opts = BuildOptions("xla-f32", max_context=64, prefill_buckets=(8,), max_seqs=1,
                        platforms=("tpu",))
    build_artifact("gemma-4-tiny-dense", out, opts, random_weights=True, progress=False)
    return out


def test_load_refuses_missing_platform(tpu_only: Path) -> None:
    with pytest.raises(ArtifactError, match=r"tpu_only.rvp: built for platforms tpu; this "
                                            r"machine's platform is cpu"):
        runtime.load(tpu_only)


def test_rvrun_refuses_missing_platform(tpu_only: Path) -> None:
    rvrun = Path(sys.executable).parent / "rvrun"
    p = subprocess.run([str(rvrun), str(tpu_only), "--prompt", "hi"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "rvrun: error: tpu_only.rvp: built for platforms tpu; this machine's platform is cpu"]
