"""What `rvrun` and `rvrun ppl` show while they load and score, with stderr not a terminal: one
line per finished phase (open, check, verify, upload, compile; ppl's windows with the running
perplexity), then their output; and the generate stream (Model.generate_stream) yields as the
tokens come, its engine requests streaming."""

from __future__ import annotations

import re

import pytest

from rvcompile import runtime
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.progress import Phases
from rvcompile.runtime import cli as rvrun

LOAD = ["open", "check", "verify", "upload", "compile"]
DONE = re.compile(r"^rvrun: (.+) done in \d+\.\d s(?: \((.*)\))?$")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("rvrun") / "tiny.rvp"
    build_artifact("gemma-4-tiny-dense", out, BuildOptions(
        "xla-f32", max_context=64, prefill_buckets=(16,), max_seqs=1, platforms=("cpu",),
        decode_loop_steps=8), random_weights=True, progress=False, log=lambda s: None)
    return out


def _phases(err: str) -> list[tuple[str, str | None]]:
    return [m.groups() for line in err.splitlines() if (m := DONE.match(line))]


def test_serve_shows_its_load_phases(artifact, capsys):
    """Refused after the load (its KV pools too small), `rvrun serve` has logged the phases."""
    assert rvrun.main(["serve", str(artifact), "--port", "0", "--kv-blocks", "1"]) == 2
    err = capsys.readouterr().err
    assert [name for name, _ in _phases(err)] == LOAD[:2]  # refused before the upload
    assert rvrun.main(["serve", str(artifact), "--port", "0", "--max-num-seqs", "2"]) == 2
    assert [name for name, _ in _phases(capsys.readouterr().err)] == LOAD[:2]


def test_load_phases_in_order(artifact):
    lines: list[str] = []
    runtime.load(artifact, phases=Phases("rvrun", "lines", write=lines.append))
    assert [name for name, _ in _phases("\n".join(lines))] == LOAD
    lines.clear()
    runtime.load(artifact, verify=False, phases=Phases("rvrun", "lines", write=lines.append))
    assert [name for name, _ in _phases("\n".join(lines))] == ["open", "check", "upload",
                                                                "compile"]


def test_rvrun_run_logs_only_its_load_report_and_summary(artifact, capsys):
    """Not on a terminal, `rvrun` keeps stderr to its load report (two lines) and its summary
    (or one error line)."""
    assert rvrun.main([str(artifact), "--prompt", "hello", "--max-tokens", "4"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("rvrun: load ") and lines[1].startswith("rvrun: weights ")
    assert lines[2].startswith("[rvrun] load ")


def test_ppl_shows_windows_and_the_running_perplexity(artifact, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("one two three four five six seven eight nine ten " * 12)
    assert rvrun.main(["ppl", str(artifact), "--text", str(text), "--window", "32"]) == 0
    out, err = capsys.readouterr()
    phases = _phases(err)
    assert [name for name, _ in phases] == [*LOAD, "score windows"]
    final = float(phases[-1][1].removeprefix("perplexity "))
    assert f"perplexity {final:.4f} |" in out  # the running figure ends at the result


def test_a_failed_load_shows_no_phase_past_it(tmp_path, capsys):
    bad = tmp_path / "bad.rvp"
    bad.write_bytes(b"not an artifact")
    assert rvrun.main([str(bad), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert _phases(err) == [] and err.startswith("rvrun: error: ")


def test_generate_stream_streams(artifact):
    """The model's stream asks the engine for streaming: with a tiny interval every loop call
    runs one step, so the 8-step loop hands over one token per step (not 8 at once)."""
    m = runtime.load(artifact, verify=False)
    m.engine.stream_interval_s = 1e-9
    sizes = []
    real_step = m.engine.step

    def step():
        outs = real_step()
        sizes.extend(len(o.token_ids) for o in outs)
        return outs

    m.engine.step = step
    list(m.generate_stream([2, 5, 9], max_tokens=12, ignore_eos=True))
    assert sizes == [1] * 12
    sizes.clear()
    m.generate([2, 5, 9], max_tokens=12, ignore_eos=True)
    assert sizes == [1, 8, 3]  # not streamed: full loop calls
