"""Model.load_report (runtime/load_report.py): what each phase of `runtime.load` cost, for the
XLA runtime on the CPU (its phases: open, check, the text check alongside, verify, programs,
upload, compile), and the block rvrun prints, for an XLA load and for an H100 one whose weights
streamed (rendered from its times; the H100 load itself: tests/test_h100_cold_start.py)."""

from __future__ import annotations

import json
import re

import pytest

from rvcompile import runtime
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.runtime.executor_api import LoadTimes
from rvcompile.runtime.load_report import LoadReport


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "tiny.rvp"
    build_artifact("gemma-4-tiny-dense", out, BuildOptions(
        "xla-f32", max_context=64, prefill_buckets=(16,), max_seqs=1, platforms=("cpu",)),
        random_weights=True, progress=False, log=lambda s: None)
    return out


def test_xla_load_report_times_every_phase(artifact):
    m = runtime.load(artifact)
    r = m.load_report
    e = r.executor
    assert (r.artifact, r.runtime) == ("tiny.rvp", "xla")
    assert [name for name, _ in r.phases()] == ["open", "check", "text check", "import",
                                                 "verify", "programs", "upload", "compile"]
    assert all(s > 0 for name, s in r.phases() if name != "import")  # jax imported already?
    assert r.alongside == ("text check",) and 0 <= r.text_waited_s <= r.text_check_s
    counted = sum(s for name, s in r.phases() if name != "text check")
    assert counted + r.text_waited_s + r.other_s == pytest.approx(r.total_s)
    assert r.other_s < 0.5 * r.total_s and r.cpu_s > 0
    assert e.weight_bytes == sum(w["nbytes"] for w in m.manifest["xla"]["weights"])
    assert e.checked and e.hashed_on == "cpu" and not e.streamed and e.read_s == e.hash_s == 0
    assert r.upload_gb_s == pytest.approx(e.weight_bytes / e.upload_s / 1e9)
    first, weights = r.lines()
    n = r"\d+\.\d\d"
    assert re.fullmatch(rf"rvrun: load {n} s \({n} s CPU\): open {n} \| check {n} \| text check "
                        rf"{n} \(alongside; waited {n}\) \| import {n} \| verify {n} \| "
                        rf"programs {n} \| upload {n} \| compile {n} \| other {n}", first)
    assert weights.startswith(f"rvrun: weights {e.weight_bytes / 1e9:.3f} GB uploaded in ")
    assert weights.endswith("GB/s), sha256-checked before the upload")
    data = json.loads(json.dumps(r.as_json()))
    assert data["runtime"] == "xla" and data["compile_s"] == e.compile_s
    assert data["upload_gb_s"] == r.upload_gb_s


def test_no_verify_says_so(artifact):
    r = runtime.load(artifact, verify=False).load_report
    assert r.executor.verify_s < 0.01 and not r.executor.checked
    assert r.lines()[1].endswith("not checked (--no-verify)")


def test_h100_report_shows_the_stream_and_what_overlapped():
    times = LoadTimes(context_s=0.12, verify_s=0.05, arena_s=0.03, upload_s=1.6,
                      weight_bytes=32_100_000_000, streamed=True, hashed_on="cpu", threads=16,
                      read_s=9.5, hash_s=20.25, cubin_load_s=0.3, graph_capture_s=0.4,
                      warm_up_s=0.01, finish_s=0.04, overlapped=("cubin load", "graph capture"),
                      checks_during_upload_s=0.2)
    r = LoadReport("31b.rvp", "h100", 0.01, 0.02, 0.01, times, 2.0, 31.5, text_check_s=0.5,
                   text_waited_s=0.03)
    assert r.upload_gb_s == pytest.approx(20.0625)
    assert [n for n, _ in r.phases()] == ["open", "check", "text check", "import", "context",
                                          "verify", "arena", "upload", "cubin load",
                                          "graph capture", "warm-up", "finish"]
    # what ran alongside is not counted again, but for the text check what the load waited
    assert r.other_s == pytest.approx(2.0 - 0.01 - 0.02 - 0.01 - 0.12 - 0.05 - 0.03 - 1.6
                                      - 0.01 - 0.04 - 0.03)
    assert r.lines() == [
        "rvrun: load 2.00 s (31.50 s CPU): open 0.01 | check 0.02 | text check 0.50 "
        "(alongside, 0.20 during upload; waited 0.03) | import 0.01 | context 0.12 | verify 0.05 "
        "| arena 0.03 | upload 1.60 | cubin load 0.30 (during upload) | graph capture 0.40 "
        "(during upload) | warm-up 0.01 | finish 0.04 | other 0.08",
        "rvrun: weights 32.100 GB uploaded in 1.60 s (20.06 GB/s), read once, each piece "
        "sha256-checked as it streamed; read 9.50 s, hash 20.25 s over 16 threads "
        "(thread-seconds)"]


def test_h100_report_shows_the_gpu_hash():
    """Weights checked on the GPU (the artifact's piece hash): its own phase after the upload,
    counted in the wall time, and the weights line says which verification ran."""
    times = LoadTimes(context_s=0.12, verify_s=0.05, arena_s=0.03, upload_s=1.4,
                      weight_bytes=32_100_000_000, streamed=True, hashed_on="gpu",
                      gpu_hash_s=0.045, threads=16, read_s=9.5, cubin_load_s=0.3,
                      graph_capture_s=0.4, warm_up_s=0.01, finish_s=0.04,
                      overlapped=("cubin load", "graph capture"))
    r = LoadReport("31b.rvp", "h100", 0.01, 0.02, 0.01, times, 2.0, 12.5, text_check_s=0.5,
                   text_waited_s=0.03)
    assert [n for n, _ in r.phases()] == ["open", "check", "text check", "import", "context",
                                          "verify", "arena", "upload", "gpu hash", "cubin load",
                                          "graph capture", "warm-up", "finish"]
    assert r.other_s == pytest.approx(2.0 - 0.01 - 0.02 - 0.01 - 0.12 - 0.05 - 0.03 - 1.4
                                      - 0.045 - 0.01 - 0.04 - 0.03)
    first, weights = r.lines()
    assert "| upload 1.40 | gpu hash 0.04 | cubin load 0.30 (during upload) |" in first
    assert weights == ("rvrun: weights 32.100 GB uploaded in 1.40 s (22.93 GB/s), read once, "
                       "sha256-checked on the GPU once uploaded; read 9.50 s over 16 threads "
                       "(thread-seconds), gpu hash 0.045 s")
    data = r.as_json()
    assert data["hashed_on"] == "gpu" and data["gpu_hash_s"] == 0.045
