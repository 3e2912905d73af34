"""`rvcompile`: build, inspect, verify and sign artifacts, make signing keys, list targets.

Every failure caused by the user's input prints one line `rvcompile: error: ...` to stderr and
exits 2; nothing is left at the output path. A build stopped by SIGTERM or SIGINT removes its
temporary file, prints one line and dies of that signal. SIGKILL cannot be caught: a build killed
with it leaves `.NAME.tmp-PID` beside the output path (never a partial NAME).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.artifacts.signature import (
    load_signing_key,
    load_trusted_key,
    sign_artifact,
    status,
    write_keypair,
)
from rvcompile.ir.ops import SpecError
from rvcompile.model.config import ConfigError
from rvcompile.sources.checkpoint import CheckpointError
from rvcompile.targets.h100.lower import LoweringError
from rvcompile.targets.h100.nvcc import NvccError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Compile Gemma 4 into one frozen artifact (.rvp).")
USER_ERRORS = (ArtifactError, CheckpointError, ConfigError, SpecError, LoweringError, NvccError,
               FileNotFoundError)


def fail(msg: str) -> None:
    typer.echo(f"rvcompile: error: {msg.splitlines()[0] if msg else msg}", err=True)
    raise typer.Exit(2)


class BuildInterrupted(BaseException):
    """SIGTERM or SIGINT during a build. A BaseException, like KeyboardInterrupt, so that no
    `except Exception` on the way up swallows it; unwinding runs every `with` block's cleanup,
    the artifact writer's removal of its temp file included."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


CLEANUP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def _signals_unwind() -> Iterator[None]:
    """Within the block, the first SIGTERM/SIGINT raises BuildInterrupted in the main thread
    (between bytecodes: a long C call, an XLA compile say, finishes first) and later ones are
    ignored, so the cleanup they started is not cut short. The handlers are restored after."""

    def handler(signum: int, frame: object) -> None:
        for s in CLEANUP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise BuildInterrupted(signum)

    previous = {s: signal.signal(s, handler) for s in CLEANUP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _die_of(signum: int) -> None:
    """Exit as killed by `signum` (what a shell or supervisor that sent it expects to see)."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    raise typer.Exit(128 + signum)  # not reached unless the signal is blocked


def _buckets(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        vals = ()
    if not vals or vals[0] < 1:
        fail(f"--prefill-buckets {text!r}: expected positive integers like 16,64,256")
    return vals


@app.command()
def build(
    model: str = typer.Argument(..., help="preset name (see `targets`) or a HF model directory"),
    target: str = typer.Option(..., "--target", help="tpu-bf16, tpu-int8, xla-f32, xla-fp8, "
                                                     "h100-fp8 or h100-f32 (see `targets`)"),
    output: Path = typer.Option(..., "-o", "--output", help="artifact path (.rvp)"),
    weights: Path | None = typer.Option(None, "--weights", help="HF checkpoint directory"),
    random_weights: bool = typer.Option(False, "--random-weights",
                                        help="seeded random weights of the real shapes"),
    seed: int | None = typer.Option(None, "--seed", help="with --random-weights: the seed, "
                                                          ">= 0 (default 0)"),
    max_context: int = typer.Option(2048, "--max-context", help="KV cache tokens per sequence"),
    slots: int = typer.Option(4, "--max-seqs", help="sequence slots in the decode batch"),
    prefill_buckets: str = typer.Option("16,64,256", "--prefill-buckets",
                                        help="prefill chunk sizes; the largest is the chunk"),
    platforms: str = typer.Option("tpu,cuda,cpu", "--platforms",
                                  help="platforms to export for (subset of tpu,cuda,cpu)"),
    dump_ir: str | None = typer.Option(None, "--dump-ir",
                                       help="print the IR after 'frontend' or a pass name"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    topology: list[str] = typer.Option([], "--topology",
                                       help="TPU slice to precompile every entry point for, "
                                            "e.g. v6e:2x2 (repeatable; needs libtpu, no TPU)"),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel devices (XLA targets): heads, MLP "
                                           "columns, experts and KV heads split over N"),
    kv_cache: str = typer.Option("auto", "--kv-cache",
                                 help="KV cache: float (the target's), int8 (XLA targets: int8 "
                                      "+ a scale per token and KV head, blockwise global "
                                      "attention), fp8 (h100-fp8: e4m3, unit scale, half the "
                                      "bytes), auto (int8 beyond 32K context on XLA targets "
                                      "but xla-f32)"),
    decode_loop_steps: int | None = typer.Option(
        None, "--decode-loop-steps",
        help="XLA targets: decode steps per device-side loop call, 0 to the largest prefill "
             "bucket (default 32, or that bucket if smaller); 0: no loop, one host round trip "
             "per token"),
    assistant: str | None = typer.Option(
        None, "--assistant",
        help="speculative decoding: a Gemma 4 assistant (MTP drafter) directory, or with "
             "--random-weights an assistant preset (e.g. gemma-4-31B-assistant, see `targets`), "
             "compiled into the artifact beside the target (XLA targets)"),
    draft_tokens: int | None = typer.Option(
        None, "--num-draft-tokens",
        help="XLA targets: most drafts one verify call checks (verify_{B}x{K+1}, draft_{B}); "
             "default 3 with --assistant, else 0 (no speculative entry points)"),
) -> None:
    """Build MODEL into one artifact for TARGET."""
    from rvcompile.build import TARGETS, BuildOptions, build_artifact

    if seed is not None and not random_weights:
        fail(f"--seed {seed}: only --random-weights uses a seed")
    if seed is not None and seed < 0:
        fail(f"--seed {seed}: expected an integer >= 0")
    buckets = _buckets(prefill_buckets)
    if decode_loop_steps is None:  # the default: 32 steps where there is a loop and room
        xla = target in TARGETS and TARGETS[target].lowering == "xla"
        decode_loop_steps = min(32, buckets[-1]) if xla else 0
    if draft_tokens is None:
        draft_tokens = 3 if assistant is not None else 0
    chosen = tuple(p.strip() for p in platforms.split(",") if p.strip())
    try:
        with _signals_unwind():
            opts = BuildOptions(target=target, max_context=max_context, prefill_buckets=buckets,
                                slots=slots, platforms=chosen, tp=tp, dump_ir=dump_ir,
                                kv_cache=kv_cache, decode_loop_steps=decode_loop_steps,
                                topologies=tuple(topology), draft_tokens=draft_tokens)
            report = build_artifact(model, output, opts, weights=weights,
                                    random_weights=random_weights, seed=seed or 0,
                                    assistant=assistant,
                                    progress=progress and sys.stderr.isatty(),
                                    log=lambda s: typer.echo(s, err=True))
    except BuildInterrupted as e:
        typer.echo(f"rvcompile: error: interrupted by {e}; no temporary file left behind",
                   err=True)
        _die_of(e.signum)
    except USER_ERRORS as e:
        fail(str(e).splitlines()[0])
    typer.echo(f"wrote {report.path} ({report.artifact_bytes / 2**20:.1f} MiB, weights "
               f"{report.weight_bytes / 2**20:.1f} MiB) in {report.seconds:.1f} s", err=True)


TRUSTED_KEY_HELP = "PEM Ed25519 public key to check signatures with (repeatable)"


@app.command()
def inspect(artifact: Path, as_json: bool = typer.Option(False, "--json"),
            trusted_key: list[Path] = typer.Option([], "--trusted-key", help=TRUSTED_KEY_HELP)
            ) -> None:
    """Show an artifact's model, target, platforms, entry points (an h100 artifact's kernel
    schedule), sizes, hashes, versions and signers (each signature valid, INVALID, or not
    checked without its --trusted-key)."""
    from rvcompile.artifacts.manifest import read_manifest

    try:
        keys = [load_trusted_key(k) for k in trusted_key]
        with Artifact.open(artifact) as art:
            checked = read_manifest(art)  # every field shown below is checked
            h, m = art.header, art.manifest
            info = {
                "file": str(artifact), "model": checked.model.name, "target": h.target,
                "platforms": list(h.platforms), "compiler_version": h.compiler_version,
                "requirements": h.requirements, "passes": m["passes"],
                "piece_size": art.piece_size,
                "sections": {n: {"offset": s.offset, "size": s.size,
                                 "pieces": len(s.piece_sha256), "digest": s.digest}
                             for n, s in art.sections.items()},
            }
            if checked.xla:
                x = m["xla"]
                info.update({
                    "entry_points": x["entry_points"], "slots": x["slots"],
                    "max_context": x["max_context"], "jax_version": x["jax_version"],
                    "layer_groups": x["layer_groups"], "precompiled": x.get("precompiled", {}),
                    "mesh": x.get("mesh"), "assistant": _drafter_info(checked)})
            else:
                info.update(_schedule_info(checked.h100))
            signed = [(s, status(s, art.signable, keys)) for s in art.signatures]
            info["signatures"] = [{"key_id": s.key_id, "signer": s.signer, "status": st}
                                  for s, st in signed]
    except USER_ERRORS as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    shown = ("file", "model", "target", "platforms", "compiler_version",
             *(("jax_version",) if "jax_version" in info else ("nvcc", "arch")),
             "passes", "entry_points", "slots", "max_context", "requirements")
    for key in shown:
        typer.echo(f"{key:17} {info[key]}")
    if info.get("assistant"):
        _echo_drafter(info["assistant"])
    if info.get("mesh"):
        _echo_mesh(info["mesh"])
    if info.get("precompiled"):
        _echo_precompiled(info["precompiled"])
    if "schedule" in info:
        _echo_schedule(info["schedule"])
    typer.echo(f"sections: (sha256 per {info['piece_size']:,}-byte piece)")
    for n, s in info["sections"].items():
        typer.echo(f"  {n:18} {s['size']:>14,} B  {s['pieces']:>4} pieces  "
                   f"digest {s['digest'][:16]}")
    typer.echo("signatures:" if signed else "signatures:      none (unsigned)")
    for sig, st in signed:
        typer.echo(f"  signed by {sig.who()}, {st}")


def _drafter_info(manifest) -> dict | None:
    """The assistant drafter and speculative entry points of a checked manifest, or None."""
    spec, drafter = manifest.xla.speculative, manifest.assistant
    if spec is None:
        return None
    info: dict = {"verify": spec.verify, "draft": spec.draft, "draft_tokens": spec.draft_tokens}
    if drafter is not None:
        info.update(name=drafter.name, model_type=drafter.model_type, origin=drafter.origin,
                    hidden_size=drafter.hidden_size, layers=list(drafter.layer_types),
                    heads=drafter.num_heads, intermediate_size=drafter.intermediate_size,
                    head=(f"centroids {drafter.num_centroids}, top {drafter.top_k}"
                          if drafter.num_centroids else "dense (tied)"),
                    reads=list(spec.reads))
    return info


def _echo_drafter(d: dict) -> None:
    if "name" in d:
        kinds = ", ".join(k.split("_")[0] for k in d["layers"])
        typer.echo(f"{'assistant':17} {d['name']} ({d['model_type']}, from {d['origin']}): "
                   f"width {d['hidden_size']}, {len(d['layers'])} layers ({kinds}) reading "
                   f"target layers {d['reads']}, {d['heads']} query heads, MLP "
                   f"{d['intermediate_size']}, head {d['head']}")
    typer.echo(f"{'speculative':17} up to {d['draft_tokens']} drafts: {d['verify']}"
               + (f", {d['draft']}" if d["draft"] else ""))


def _schedule_info(h100) -> dict:
    """What `inspect` shows of an h100 artifact's kernel schedule."""
    s = h100.schedule
    launches = [x for e in s.entries.values() for x in e.launches]
    return {
        "entry_points": sorted(s.entries), "slots": s.slots, "max_context": s.max_context,
        "nvcc": h100.nvcc, "arch": h100.arch,
        "schedule": {
            "version": s.version, "arena_bytes": s.arena_bytes,
            "regions": {"weights": s.weights_bytes, "constants": s.constants_bytes,
                        "kv": s.kv.pool_bytes, "io": s.io_bytes,
                        "activations": s.arena_bytes - s.io_offset - s.io_bytes},
            "kv": {"block_size": s.kv.block_size, "dtype": s.kv.kv_dtype,
                   "kinds": {k.name: {"table_width": k.table_width, "num_blocks": k.num_blocks,
                                      "window": k.window} for k in s.kv.kinds}},
            "entries": {name: {"rows": e.rows, "graph": e.graph, "launches": len(e.launches)}
                        for name, e in s.entries.items()},
            "launches": len(launches),
            "kernels": len({(x.module, x.kernel) for x in launches}),
            "modules": len(s.cubins),
        },
    }


def _echo_schedule(s: dict) -> None:
    """The kernel schedule: arena regions, KV pools, and each entry's launch count."""
    regions = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in s["regions"].items())
    typer.echo(f"{'schedule':17} version {s['version']}: arena {s['arena_bytes'] / 2**20:.1f} MiB "
               f"({regions} MiB); {s['launches']} launches of {s['kernels']} kernels from "
               f"{s['modules']} cubins")
    kinds = ", ".join(f"{n} {k['num_blocks']} x {k['table_width']}-wide"
                      + (f" (window {k['window']})" if k["window"] else "")
                      for n, k in s["kv"]["kinds"].items())
    typer.echo(f"  KV {s['kv']['dtype']}, blocks of {s['kv']['block_size']} tokens: {kinds}")
    for name, e in s["entries"].items():
        typer.echo(f"  {name:16} {e['rows']:>5} rows  {e['launches']:>5} launches"
                   f"{'  (CUDA graph)' if e['graph'] else ''}")


def _echo_mesh(mesh: dict) -> None:
    """The tensor-parallel mesh: its axis and size, then every split array and its spec."""
    arrays = {**mesh["weights"], **mesh["pools"]}
    split = {k: v for k, v in arrays.items() if any(v)}
    typer.echo(f"{'mesh':17} {mesh['axis']}={mesh['size']}: {len(split)} of {len(arrays)} "
               "weight arrays and KV pools split, the rest whole on every device")
    for key, spec in split.items():
        typer.echo(f"  {key:40} P({', '.join(repr(a) if a else 'None' for a in spec)})")


def _echo_precompiled(sets: dict) -> None:
    """Each topology's executables (what a runtime must match) and its cost estimate."""
    from rvcompile.targets.xla.cost_report import format_report

    typer.echo("precompiled:")
    for name, rec in sets.items():
        size = sum(e["size"] for e in rec["entries"].values())
        typer.echo(f"  {name}: {rec['device_kind']} x{len(rec['device_ids'])}, jax {rec['jax']}, "
                   f"jaxlib {rec['jaxlib']}, libtpu {rec['libtpu']}, KV blocks "
                   f"{rec['kv_blocks']}, {len(rec['entries'])} executables "
                   f"({size / 2**20:.1f} MiB)")
        if "cost" in rec:
            for line in format_report(name, rec["cost"]):
                typer.echo(line)


@app.command()
def verify(artifact: Path,
           trusted_key: list[Path] = typer.Option([], "--trusted-key", help=TRUSTED_KEY_HELP)
           ) -> None:
    """Re-hash every section and check what the manifest and sections hold
    (artifacts/contents.py: verify_artifact); with --trusted-key, first require a valid
    signature by one of the keys. Exit 0 when all checks pass, 2 otherwise."""
    from rvcompile.artifacts.contents import verify_artifact

    try:
        keys = [load_trusted_key(k) for k in trusted_key] or None
        with Artifact.open(artifact, trusted_keys=keys) as art:
            verify_artifact(art)
            n = len(art.sections)
            signed = "; ".join(f"signed by {s.who()}, {status(s, art.signable, keys or [])}"
                               for s in art.signatures) or "unsigned"
    except USER_ERRORS as e:
        fail(str(e))
    typer.echo(f"{artifact}: OK ({n} sections; {signed})")


@app.command()
def sign(artifact: Path,
         key: Path = typer.Option(..., "--key", help="PEM Ed25519 private key (see `keygen`)"),
         signer: str = typer.Option("", "--signer", help="a name shown with the signature")
         ) -> None:
    """Add an Ed25519 signature over the artifact's header and digest table (replacing one by
    the same key). Fast at any size: the sections are not re-hashed; `verify` them first if the
    file's history is unknown."""
    try:
        signatures = sign_artifact(artifact, load_signing_key(key), signer)
    except USER_ERRORS as e:
        fail(str(e))
    typer.echo(f"{artifact}: signed by {signatures[-1].who()} "
               f"({len(signatures)} signature{'s' if len(signatures) > 1 else ''})")


@app.command()
def keygen(out: Path = typer.Option(..., "--out", help="writes OUT.key (private, mode 0600) "
                                                       "and OUT.pub")) -> None:
    """Make an Ed25519 key pair for `sign` (private) and `rvrun --trusted-key` (public)."""
    try:
        private, public, kid = write_keypair(out)
    except USER_ERRORS as e:
        fail(str(e))
    typer.echo(f"wrote {private} (private, keep it secret) and {public}; key id {kid}")


@app.command()
def targets() -> None:
    """List the build targets and what each emits."""
    from rvcompile.build import TARGETS
    from rvcompile.model.presets import ASSISTANT_PRESETS, PRESETS

    for t in TARGETS.values():
        typer.echo(f"{t.name:10} {t.emits}; passes: {', '.join(n for n, _ in t.passes) or '-'}")
    typer.echo(f"presets: {', '.join(PRESETS)}")
    typer.echo(f"assistant presets (--assistant NAME --random-weights): "
               f"{', '.join(ASSISTANT_PRESETS)}")
