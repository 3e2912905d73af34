"""Draw the benchmark figures (matplotlib PNGs) from a figures JSON: the ones docs/BENCHMARKS.md
shows, from docs/results/figures.json into docs/img/.

    python benchmarks/plots.py [--figures docs/results/figures.json] [--out docs/img]

The JSON ("format": "rvcompile-figures/1") holds measured numbers only, each series with its
label, date, device, commit and `source` (the raw result it was transcribed from). Every key is
optional but, where present, must hold a list of series:

    decode_context  points [{context, tok_s, roofline_tok_s}]       -> decode_context.png
    decode_batch    points [{batch, tok_s}], bound {weights_gb,
                    bandwidth_gbps}: the weight-read bound B * bandwidth / weights
                                                                    -> decode_batch.png
    serving         levels [{concurrency, output_tok_s, ttft_ms {p50, p90, p99},
                    itl_ms {p50, p90, p99}}]; optional bare [{batch,
                    tok_s}] (the bare decode step rate at that width)
                    and bound {weights_gb, bandwidth_gbps} (the
                    weight-read roofline), drawn beside the served rate
                                                                    -> serving.png
    perplexity      builds [{target, perplexity (or null), vs_xla_f32_pct}]
                                                                    -> perplexity.png

A malformed file is refused in one line naming the series and field. Output is deterministic
for a given matplotlib (no dates in the PNG metadata).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402

FORMAT = "rvcompile-figures/1"
PERCENTILES = ("p50", "p90", "p99")
_PNG_META = {"Software": None}  # keep the PNGs byte-stable across machines


class FiguresError(ValueError):
    """A figures file that cannot be drawn; the message names the series and field."""


def _number(value: Any, where: str, *, nullable: bool = False) -> float | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FiguresError(f"{where}: expected a number, got {json.dumps(value)}")
    return float(value)


def _series(doc: dict, key: str, rows: str) -> list[dict]:
    """doc[key] checked as a list of series, each with a label and a non-empty list `rows`."""
    series = doc.get(key, [])
    if not isinstance(series, list):
        raise FiguresError(f"{key}: expected a list of series")
    for i, s in enumerate(series):
        if not isinstance(s, dict) or not isinstance(s.get("label"), str):
            raise FiguresError(f"{key}[{i}]: a series needs a string \"label\"")
        if not isinstance(s.get(rows), list) or not s[rows]:
            raise FiguresError(f"{key}[{i}] ({s['label']}): \"{rows}\" must be a non-empty list")
        for j, row in enumerate(s[rows]):
            if not isinstance(row, dict):
                raise FiguresError(f"{key}[{i}].{rows}[{j}]: expected an object")
    return series


def load(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FiguresError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise FiguresError(f"{path}: \"format\" must be {FORMAT!r}")
    return doc


def decode_context(doc: dict, out: Path) -> Path | None:
    series = _series(doc, "decode_context", "points")
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, s in enumerate(series):
        where = f"decode_context[{i}] ({s['label']})"
        ctx = [_number(p.get("context"), f"{where}.context") for p in s["points"]]
        tok = [_number(p.get("tok_s"), f"{where}.tok_s") for p in s["points"]]
        roof = [_number(p.get("roofline_tok_s"), f"{where}.roofline_tok_s") for p in s["points"]]
        (line,) = ax.plot(ctx, tok, "o-", label=s["label"])
        ax.plot(ctx, roof, "--", color=line.get_color(), alpha=0.6)
    ax.plot([], [], "k--", alpha=0.6, label="roofline (same colour)")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode tok/s, batch 1",
           title="Single-stream decode against context")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    _plain(ax)
    contexts = sorted({c for s in series for c in (p["context"] for p in s["points"])})
    ax.set_xticks(contexts, [f"{c:g}" for c in contexts])
    return _save(fig, out / "decode_context.png")


def decode_batch(doc: dict, out: Path) -> Path | None:
    series = _series(doc, "decode_batch", "points")
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 6), layout="constrained")
    for i, s in enumerate(series):
        where = f"decode_batch[{i}] ({s['label']})"
        batch = [_number(p.get("batch"), f"{where}.batch") for p in s["points"]]
        tok = [_number(p.get("tok_s"), f"{where}.tok_s") for p in s["points"]]
        (line,) = ax.plot(batch, tok, "o-", label=s["label"])
        for b, t in zip(batch, tok, strict=True):
            ax.annotate(f"{t:.0f}", (b, t), textcoords="offset points", xytext=(4, -10),
                        fontsize=7)
        bound = s.get("bound")
        if bound is not None:
            if not isinstance(bound, dict):
                raise FiguresError(f"{where}.bound: expected an object")
            gb = _number(bound.get("weights_gb"), f"{where}.bound.weights_gb")
            bw = _number(bound.get("bandwidth_gbps"), f"{where}.bound.bandwidth_gbps")
            ax.plot(batch, [b * bw / gb for b in batch], "--", color=line.get_color(), alpha=0.6,
                    label=f"weight-read bound: B x {bw:.0f} GB/s / {gb:.2f} GB")
    ax.set(xscale="log", yscale="log", xlabel="decode batch (sequences)",
           ylabel="decode tok/s (all sequences)", title="Batched decode against batch width")
    ax.grid(True, which="both", alpha=0.3)
    # below the axes: the series' labels are long and the lines fill the plot's diagonal
    fig.legend(fontsize=7, loc="outside lower left")
    _plain(ax)
    ax.set_xticks(batch, [f"{b:g}" for b in batch])
    return _save(fig, out / "decode_batch.png")


def serving(doc: dict, out: Path) -> Path | None:
    series = _series(doc, "serving", "levels")
    if not series:
        return None
    fig, axes = plt.subplots(len(series), 2, figsize=(10, 3.6 * len(series)), squeeze=False)
    for i, s in enumerate(series):
        where = f"serving[{i}] ({s['label']})"
        levels = s["levels"]
        conc = [_number(lv.get("concurrency"), f"{where}.concurrency") for lv in levels]
        tput = [_number(lv.get("output_tok_s"), f"{where}.output_tok_s") for lv in levels]
        left, right = axes[i]
        left.plot(conc, tput, "o-", label="served (output tok/s)")
        for c, t in zip(conc, tput, strict=True):
            left.annotate(f"{t:.0f}", (c, t), textcoords="offset points", xytext=(4, -10),
                          fontsize=7)
        ticks = list(conc)
        if "bare" in s:
            bare = s["bare"]
            if not isinstance(bare, list) or not bare:
                raise FiguresError(f"{where}.bare: expected a non-empty list of points")
            batch = [_number(p.get("batch"), f"{where}.bare.batch") for p in bare]
            left.plot(batch, [_number(p.get("tok_s"), f"{where}.bare.tok_s") for p in bare],
                      "s--", label="bare decode step, same width")
            ticks = sorted(set(ticks) | set(batch))
        if "bound" in s:
            bound = s["bound"]
            if not isinstance(bound, dict):
                raise FiguresError(f"{where}.bound: expected an object")
            gb = _number(bound.get("weights_gb"), f"{where}.bound.weights_gb")
            bw = _number(bound.get("bandwidth_gbps"), f"{where}.bound.bandwidth_gbps")
            left.plot(ticks, [c * bw / gb for c in ticks], ":", color="gray",
                      label=f"weight-read roofline: B x {bw:.0f} GB/s / {gb:.2f} GB")
        left.legend(fontsize=7)
        # log tok/s only beside the bare rate and the roofline (a decade or more apart)
        left.set(xscale="log", yscale="log" if "bare" in s or "bound" in s else "linear",
                 xlabel="concurrent requests (bare: batch width)", ylabel="tok/s",
                 title=s["label"])
        for metric, style in (("ttft_ms", "o-"), ("itl_ms", "s--")):
            for pct in PERCENTILES:
                values = []
                for lv in levels:
                    block = lv.get(metric)
                    if not isinstance(block, dict):
                        raise FiguresError(f"{where}.{metric}: expected an object of percentiles")
                    values.append(_number(block.get(pct), f"{where}.{metric}.{pct}"))
                right.plot(conc, values, style, label=f"{metric.split('_')[0].upper()} {pct}")
        right.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="ms",
                  title="latency percentiles")
        right.legend(fontsize=7, ncol=2)
        for ax, xs in ((left, ticks), (right, conc)):
            ax.grid(True, which="both", alpha=0.3)
            _plain(ax)
            ax.set_xticks(xs, [f"{c:g}" for c in xs])
    fig.tight_layout()
    return _save(fig, out / "serving.png")


def perplexity(doc: dict, out: Path) -> Path | None:
    series = _series(doc, "perplexity", "builds")
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    targets: list[str] = []
    for s in series:
        targets += [b.get("target") for b in s["builds"] if b.get("target") not in targets]
    width = 0.8 / len(series)
    for i, s in enumerate(series):
        where = f"perplexity[{i}] ({s['label']})"
        xs, ys, labels = [], [], []
        for b in s["builds"]:
            if not isinstance(b.get("target"), str):
                raise FiguresError(f"{where}.target: expected a string")
            rel = _number(b.get("vs_xla_f32_pct"), f"{where}.{b['target']}.vs_xla_f32_pct")
            ppl = _number(b.get("perplexity"), f"{where}.{b['target']}.perplexity",
                          nullable=True)
            xs.append(targets.index(b["target"]) + (i - (len(series) - 1) / 2) * width)
            ys.append(rel)
            labels.append(f"{ppl:.2f}" if ppl is not None else "")
        bars = ax.bar(xs, ys, width, label=s["label"])
        ax.bar_label(bars, labels=labels, fontsize=7, padding=2)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(targets)), targets, fontsize=8)
    ax.set(ylabel="perplexity vs xla-f32 (%)",
           title="Perplexity by target (rv-gemma4-tiny; bar labels: perplexity)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out / "perplexity.png")


def _plain(ax) -> None:
    """Log axes labelled 20, 50, 100 rather than 10^2, ticks at 1-2-5 steps on a log y axis."""
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    if ax.get_yscale() == "log":
        lo, hi = ax.get_ylim()
        ticks = [m * 10**e for e in range(-3, 7) for m in (1, 2, 5) if lo <= m * 10**e <= hi]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.set_ylim(lo, hi)


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110, metadata=_PNG_META)
    plt.close(fig)
    return path


FIGURES = (decode_context, decode_batch, serving, perplexity)


def draw_all(figures: Path, out: Path) -> list[Path]:
    """Every figure `figures` has data for, written into `out`; the paths written."""
    doc = load(figures)
    out.mkdir(parents=True, exist_ok=True)
    return [p for draw in FIGURES if (p := draw(doc, out)) is not None]


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--figures", type=Path, default=root / "docs/results/figures.json")
    ap.add_argument("--out", type=Path, default=root / "docs/img")
    args = ap.parse_args(argv)
    try:
        written = draw_all(args.figures, args.out)
    except FiguresError as e:
        print(f"plots: error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
