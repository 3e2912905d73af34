"""benchmarks/plots.py: every figure drawn from a small fixture, the committed figures file
drawn whole, and malformed files refused in one line naming the series and field."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("plots", ROOT / "benchmarks" / "plots.py")
plots = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plots)

PNG = b"\x89PNG\r\n\x1a\n"
FIXTURE = {
    "format": "rvcompile-figures/1",
    "decode_context": [{"label": "a", "points": [
        {"context": 16, "tok_s": 70.0, "roofline_tok_s": 90.0},
        {"context": 1200, "tok_s": 65.0, "roofline_tok_s": 88.0}]}],
    "decode_batch": [{"label": "b", "points": [{"batch": 1, "tok_s": 70.0},
                                               {"batch": 8, "tok_s": 400.0}],
                      "bound": {"weights_gb": 32.0, "bandwidth_gbps": 3000.0}}],
    "serving": [{"label": "c", "levels": [
        {"concurrency": c, "output_tok_s": 30.0 * c,
         "ttft_ms": {"p50": 10.0 * c, "p90": 20.0 * c, "p99": 30.0 * c},
         "itl_ms": {"p50": 1.0 * c, "p90": 2.0 * c, "p99": 3.0 * c}} for c in (1, 2, 4)],
        "bare": [{"batch": 1, "tok_s": 40.0}, {"batch": 8, "tok_s": 300.0}],
        "bound": {"weights_gb": 32.0, "bandwidth_gbps": 3000.0}}],
    "perplexity": [{"label": "d", "builds": [
        {"target": "xla-f32", "perplexity": 45.0, "vs_xla_f32_pct": 0.0},
        {"target": "tpu-int8", "perplexity": None, "vs_xla_f32_pct": 0.1}]}],
}


def _write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "figures.json"
    path.write_text(json.dumps(doc))
    return path


def test_fixture_draws_every_figure(tmp_path: Path) -> None:
    written = plots.draw_all(_write(tmp_path, FIXTURE), tmp_path / "img")
    assert [p.name for p in written] == ["decode_context.png", "decode_batch.png",
                                         "serving.png", "perplexity.png"]
    for path in written:
        assert path.read_bytes()[:8] == PNG


def test_missing_figures_are_skipped(tmp_path: Path) -> None:
    doc = {"format": FIXTURE["format"], "perplexity": FIXTURE["perplexity"]}
    assert [p.name for p in plots.draw_all(_write(tmp_path, doc), tmp_path)] == [
        "perplexity.png"]


def test_committed_figures_draw(tmp_path: Path) -> None:
    written = plots.draw_all(ROOT / "docs/results/figures.json", tmp_path)
    assert len(written) == 4
    committed = {p.name for p in (ROOT / "docs/img").glob("*.png")}
    assert {p.name for p in written} <= committed


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(format="x"), "\"format\" must be 'rvcompile-figures/1'"),
    (lambda d: d.update(serving={}), "serving: expected a list of series"),
    (lambda d: d["decode_context"][0]["points"][1].update(tok_s="fast"),
     "decode_context[0] (a).tok_s: expected a number, got \"fast\""),
    (lambda d: d["decode_batch"][0].update(points=[]),
     "decode_batch[0] (b): \"points\" must be a non-empty list"),
    (lambda d: d["serving"][0]["levels"][2]["itl_ms"].pop("p99"),
     "serving[0] (c).itl_ms.p99: expected a number, got null"),
    (lambda d: d["serving"][0]["bare"][1].update(tok_s=None),
     "serving[0] (c).bare.tok_s: expected a number, got null"),
    (lambda d: d["serving"][0].update(bound=[]), "serving[0] (c).bound: expected an object"),
    (lambda d: d["perplexity"][0]["builds"][0].update(perplexity=True),
     "perplexity[0] (d).xla-f32.perplexity: expected a number, got true"),
])
def test_malformed_files_are_refused(tmp_path: Path, edit, message: str) -> None:
    doc = json.loads(json.dumps(FIXTURE))
    edit(doc)
    with pytest.raises(plots.FiguresError) as err:
        plots.draw_all(_write(tmp_path, doc), tmp_path / "img")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_main_exit_status(tmp_path: Path, capsys) -> None:
    assert plots.main(["--figures", str(_write(tmp_path, FIXTURE)),
                       "--out", str(tmp_path / "img")]) == 0
    assert plots.main(["--figures", str(tmp_path / "absent.json")]) == 2
    assert capsys.readouterr().err.startswith("plots: error: ")
