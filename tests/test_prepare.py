"""`rvrun prepare` (runtime/prepare.py) on the CPU, an XLA device like any other: the executables
compiled once into ART.prepared load instead of compiling and give the same logits and tokens; a
cache that does not match the artifact, this machine, the KV pools, or that others may write, or
whose bytes are damaged, is refused in one line and the StableHLO compiled. And the first start
that compiles says so, with a measured estimate (runtime/executors/compile_estimate.py)."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from rvcompile import runtime
from rvcompile.artifacts import Artifact
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.progress import Phases
from rvcompile.runtime import cli as rvrun
from rvcompile.runtime import prepare as prep
from rvcompile.runtime.executors import compile_estimate, prepared_cache
from rvcompile.runtime.executors.xla import XlaExecutor

ROOT = Path(__file__).resolve().parents[1]
OPTS = BuildOptions("xla-f32", max_context=64, prefill_buckets=(16,), max_seqs=1,
                    platforms=("cpu",))
PROMPT = [2, 17, 5, 99, 3]


def _build(path: Path, seed: int) -> Path:
    build_artifact("gemma-4-tiny-dense", path, OPTS, random_weights=True, seed=seed,
                   progress=False, log=lambda s: None)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(artifact, its prepared cache, the compiled model's logits and tokens, the phase lines
    of that first compiled start in an empty cache)."""
    d = tmp_path_factory.mktemp("prepare")
    art = _build(d / "tiny.rvp", seed=0)
    mp = pytest.MonkeyPatch()
    mp.setenv("RVCOMPILE_CACHE", str(d / "cache"))
    try:
        lines: list[str] = []
        model = runtime.load(art, phases=Phases("rvrun", "lines", write=lines.append))
        ref = (model.logits(PROMPT), model.generate(PROMPT, max_tokens=6,
                                                    ignore_eos=True).token_ids)
        assert rvrun.main(["prepare", str(art)]) == 0
    finally:
        mp.undo()
    return art, prep.prepared_path(art), ref, lines


def test_first_start_says_it_compiles(built):
    lines = built[3]
    note = next(i for i, line in enumerate(lines) if "first start here" in line)
    assert lines[note].startswith("rvrun: first start here: compiling 3 XLA programs (")
    assert "for cpu / jax " in lines[note]
    assert lines[note].endswith("later starts load them from the cache")
    done = [line for line in lines[note + 1:] if " done in " in line]
    assert done[0].startswith("rvrun: compile done in ")  # the note comes right before it
    assert [line for line in lines[:note] if " done in " in line][-1].startswith(
        "rvrun: upload done in ")


def test_prepared_executables_load_instead_of_compiling(built, monkeypatch, capsys):
    art, cache, (logits, tokens), _ = built
    assert cache == art.with_name("tiny.rvp.prepared") and cache.exists()
    assert os.stat(cache).st_mode & 0o022 == 0
    with Artifact.open(cache) as c:
        info = c.manifest["prepared"]
        assert info["artifact"] == "tiny.rvp" and info["set"]["platform"] == "cpu"
        assert sorted(info["set"]["entries"]) == ["decode_1", "logits_16", "prefill_16"]

    def no_compile(self):
        raise AssertionError("compiled although prepared")

    monkeypatch.setattr(XlaExecutor, "_warm_up", no_compile)
    capsys.readouterr()
    model = runtime.load(art)
    assert model.executor.load_note.startswith("prepared executables (tiny.rvp.prepared); "
                                               "nothing compiled, 3 checked in ")
    assert model.executor.load_note.endswith(" s, each deserialized on its first use")
    assert model.executor.compile_s == 0.0 and model.load_report.executor.compile_s > 0
    # checked at load, deserialized by XLA only when first called, and the report says so
    fns = model.executor.fns
    assert fns.pending == ("decode_1", "logits_16", "prefill_16") and fns.loaded_s == {}
    assert model.load_report.executor.deferred == fns.pending
    assert model.load_report.lines()[-1] == (
        "rvrun: executables checked, not yet deserialized: decode_1, logits_16, prefill_16 "
        "(each on its first call, which waits for it)")
    assert model.load_report.as_json()["deferred"] == list(fns.pending)
    np.testing.assert_array_equal(model.logits(PROMPT), logits)
    assert fns.pending == ("decode_1", "prefill_16") and list(fns.loaded_s) == ["logits_16"]
    assert model.generate(PROMPT, max_tokens=6, ignore_eos=True).token_ids == tokens
    assert fns.pending == () and sorted(fns.loaded_s) == ["decode_1", "logits_16", "prefill_16"]
    assert capsys.readouterr().err == ""


def test_a_server_loads_every_executable_before_it_serves(built):
    """executor_api.load_pending (what `rvrun serve` calls before it listens): every entry left
    for its first use deserialized now, none left; the tokens as before; an executor that
    defers nothing loads nothing."""
    from rvcompile.runtime.executor_api import load_pending

    art, _, (_, tokens), _ = built
    model = runtime.load(art)
    assert load_pending(model.executor) == ["decode_1", "logits_16", "prefill_16"]
    fns = model.executor.fns
    assert fns.pending == () and sorted(fns.loaded_s) == ["decode_1", "logits_16", "prefill_16"]
    assert load_pending(model.executor) == []
    assert model.generate(PROMPT, max_tokens=6, ignore_eos=True).token_ids == tokens
    assert sorted(fns.loaded_s) == ["decode_1", "logits_16", "prefill_16"]  # none again
    assert load_pending(object()) == []


def test_a_prepared_start_compiles_nothing(built, monkeypatch):
    """Not the programs, nor anything of jax's around them (a fill program per KV pool shape
    cost a CPU start 0.1-0.3 s): jax reports no backend compile from load to the first tokens."""
    from jax._src import dispatch, monitoring

    art, _, (_, tokens), _ = built
    compiled: list[str] = []
    monkeypatch.setattr(monitoring, "_event_duration_secs_listeners", [
        *monitoring._event_duration_secs_listeners,
        lambda event, secs, **kw: compiled.append(kw.get("fun_name", "?"))
        if event == dispatch.BACKEND_COMPILE_EVENT else None])
    jax.jit(lambda x: x + 1).lower(np.float32(1)).compile()  # the listener hears a compile
    assert compiled and compiled.pop()
    jax.clear_caches()  # what this process compiled before (the fixture's start) is forgotten
    model = runtime.load(art)
    assert model.generate(PROMPT, max_tokens=6, ignore_eos=True).token_ids == tokens
    assert compiled == []


def test_the_collector_is_paused_for_a_load_only(built, monkeypatch):
    """runtime.load turns Python's cyclic garbage collector off while it runs (the objects it
    makes live as long as the process) and back as it found it, whether the load fails or not."""
    art = built[0]
    seen = []
    real = runtime.runtime_module

    def spy(*args):
        seen.append(gc.isenabled())
        return real(*args)

    monkeypatch.setattr(runtime, "runtime_module", spy)
    assert gc.isenabled()
    runtime.load(art)
    assert seen == [False] and gc.isenabled()
    with pytest.raises(runtime.ArtifactError):
        runtime.load(art.with_name("missing.rvp"))
    assert gc.isenabled()
    gc.disable()
    try:
        runtime.load(art)
        assert not gc.isenabled()  # left as it was
    finally:
        gc.enable()


def _refused(art: Path, capsys, monkeypatch, **load) -> str:
    """The one line a load prints refusing the cache; the load then compiles (stubbed)."""
    monkeypatch.setattr(XlaExecutor, "_warm_up", lambda self: 0.0)  # the refusal, not the compile
    capsys.readouterr()
    assert runtime.load(art, **load).executor.load_note.startswith("XLA compile")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"[rvrun] not using {art.name}.prepared: ")
    assert err.rstrip().endswith(f"; run `rvrun prepare {art.name}` again; compiling StableHLO")
    return err


def test_a_cache_for_another_artifact_is_refused(built, tmp_path, capsys, monkeypatch):
    _, cache, _, _ = built
    other = _build(tmp_path / "tiny.rvp", seed=1)  # same name and shapes, other weights
    shutil.copy(cache, prep.prepared_path(other))
    assert "prepared for another artifact (or an earlier build of tiny.rvp)" in _refused(
        other, capsys, monkeypatch)


def _copy(built, tmp_path) -> tuple[Path, Path]:
    art, cache, _, _ = built
    shutil.copy(art, tmp_path / art.name)
    shutil.copy(cache, tmp_path / cache.name)
    return tmp_path / art.name, tmp_path / cache.name


def test_another_machine_or_pool_size_is_refused(built, tmp_path, capsys, monkeypatch):
    art, _ = _copy(built, tmp_path)
    assert "compiled for KV blocks" in _refused(art, capsys, monkeypatch,
                                                kv_blocks={"full": 9})
    real = prepared_cache.this_machine()
    monkeypatch.setattr(prepared_cache, "this_machine",
                        lambda: dataclasses.replace(real, jaxlib="0.0.1"))
    assert "it was compiled with jaxlib " in _refused(art, capsys, monkeypatch)


def test_a_cache_others_may_write_is_refused(built, tmp_path, capsys, monkeypatch):
    art, cache = _copy(built, tmp_path)
    os.chmod(cache, 0o664)
    assert "must be owned by this user and writable by no one else" in _refused(
        art, capsys, monkeypatch)


def test_a_damaged_cache_is_refused(built, tmp_path, capsys, monkeypatch):
    art, cache = _copy(built, tmp_path)
    with Artifact.open(cache) as c:
        at = c.sections["executables"].offset + 1000
    data = bytearray(cache.read_bytes())
    data[at] ^= 1
    cache.write_bytes(bytes(data))
    assert "section 'executables' is corrupt: piece 0" in _refused(art, capsys, monkeypatch)
    cache.write_bytes(b"junk")
    _refused(art, capsys, monkeypatch)  # whatever the container says of it, in the one line


def test_prepare_refuses_in_one_line(tmp_path, capsys):
    assert rvrun.main(["prepare", str(tmp_path / "missing.rvp")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rvrun: error: missing.rvp: cannot open")


def test_compile_estimate_is_measured(tmp_path):
    cache = tmp_path / "xla" / "abc-jax1"
    est = compile_estimate.compile_estimate(cache, 2 << 20, 3, "cpu / jax 1")
    assert est.first and est.seconds is None
    assert "no estimate yet (nothing compiled for cpu / jax 1 on this machine yet)" in est.line()
    est.record(12.0)
    again = compile_estimate.compile_estimate(tmp_path / "xla" / "def-jax1", 4 << 20, 3,
                                              "cpu / jax 1")
    assert again.first and again.seconds == pytest.approx(24.0)
    assert "expected about 24 s (measured: the last first start here compiled 2.0 MiB in 12 s)" \
        in again.line()
    assert compile_estimate.compile_estimate(cache, 1, 3, "tpu / jax 1").seconds is None
    cache.mkdir(parents=True)
    for i in range(3):
        (cache / f"jit_call-{i}-cache").write_bytes(b"x")
    assert not compile_estimate.compile_estimate(cache, 1, 3, "cpu / jax 1").first
    (tmp_path / "xla" / compile_estimate.LOG).write_text("{not json")
    assert compile_estimate.compile_estimate(cache, 1, 3, "cpu / jax 1").seconds is None


@pytest.mark.parametrize("load_all", [False, True], ids=["deferred", "load-all"])
def test_cold_start_benchmark_says_what_ready_left(built, tmp_path, load_all):
    """benchmarks/cold_start.py on a prepared artifact: ready after deserializing only what the
    1-token request ran (prefill), the decoding requests after it paying for decode; or, with
    --load-all, everything deserialized before ready."""
    art = built[0]
    out = tmp_path / "cold.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cold_start.py"), str(art), "--runs", "1",
           "--out", str(out), *(["--load-all"] if load_all else [])]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=300)
    run = json.loads(out.read_text())["page_cache_starts"][0]
    after = run["after_ready"]
    assert len(after["decode_requests_s"]) == 2
    assert after["still_pending"] == ([] if load_all else ["logits_16"])
    if load_all:
        assert run["report"]["deferred"] == ["decode_1", "logits_16", "prefill_16"]
        assert set(after["deserialized_at_ready_s"]) == {"decode_1", "logits_16", "prefill_16"}
        assert after["deserialized_by_decode_requests_s"] == {}
    else:
        assert run["report"]["deferred"] == ["decode_1", "logits_16", "prefill_16"]
        assert list(after["deserialized_at_ready_s"]) == ["prefill_16"]
        assert list(after["deserialized_by_decode_requests_s"]) == ["decode_1"]


def test_rvrun_says_what_first_use_cost(built, capsys):
    """`rvrun ART --prompt` on a prepared artifact: its summary says how much of the request's
    TTFT and decode time went to deserializing executables on their first call."""
    art = built[0]
    capsys.readouterr()
    assert rvrun.main([str(art), "--prompt", "Hello", "--max-tokens", "4", "--ignore-eos"]) == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert summary.startswith("[rvrun] load ") and "each deserialized on its first use" in summary
    assert re.search(r" \| of these times, executables deserialized on first use \d+\.\d\d s "
                     r"\(decode_1, prefill_16\)$", summary), summary
