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
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.artifacts.manifest import Provenance
from rvcompile.artifacts.signature import (
    load_signing_key,
    load_trusted_key,
    sign_artifact,
    status,
    write_keypair,
)
from rvcompile.ir.ops import SpecError
from rvcompile.model.config import ConfigError
from rvcompile.sources.model_source import CheckpointError

# Plain click help (no rich panels): it never cuts an option's name, and it uses up to 120
# columns of the terminal (80 when stdout is not one).
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  context_settings={"max_content_width": 120},
                  help="Compile Gemma 4 into one frozen artifact (.rvp).")
# a build also fails on its target's own (targets.input_errors)
USER_ERRORS = (ArtifactError, CheckpointError, ConfigError, SpecError, FileNotFoundError)


def warn(msg: str) -> None:
    """A clamp, replacement or other surprise the command goes on through: one line on stderr."""
    typer.echo(f"rvcompile: warning: {msg}", err=True)


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
    ctx: typer.Context,
    model: str | None = typer.Argument(None, help="preset name (see `targets`) or a HF model "
                                                  "directory (required unless --config gives "
                                                  "it)"),
    target: str | None = typer.Option(None, "--target", help="what to compile for (see "
                                                             "`targets`; required unless "
                                                             "--config gives it)"),
    output: Path = typer.Option(..., "-o", "--output", help="artifact path (.rvp)"),
    weights: Path | None = typer.Option(
        None, "--weights", help="HF checkpoint directory whose weights MODEL's shapes take "
                                "(default: MODEL's own, when MODEL is a directory)"),
    random_weights: bool = typer.Option(
        False, "--random-weights", help="seeded random weights of the real shapes, in place of "
                                        "any checkpoint's (default: off)"),
    seed: int | None = typer.Option(None, "--seed", help="with --random-weights: the seed, "
                                                          ">= 0 (default 0)"),
    max_context: int = typer.Option(2048, "--max-context", help="KV cache tokens per sequence"),
    max_seqs: int = typer.Option(4, "--max-seqs", help="sequences in the decode batch"),
    prefill_buckets: str = typer.Option("16,64,256", "--prefill-buckets",
                                        help="prefill chunk sizes; the largest is the chunk"),
    platforms: str = typer.Option("tpu,cuda,cpu", "--platforms",
                                  help="platforms to export for (subset of tpu,cuda,cpu)"),
    dump_ir: str | None = typer.Option(None, "--dump-ir",
                                       help="print the IR after 'frontend' or a pass name "
                                            "(default: none)"),
    progress: bool = typer.Option(True, "--progress/--no-progress",
                                  help="show the build's phases: a bar with an ETA on a "
                                       "terminal, else one line per finished phase"),
    topology: list[str] = typer.Option([], "--topology",
                                       help="TPU slice to precompile every entry point for, "
                                            "e.g. v6e:2x2 (repeatable; needs libtpu, no TPU; "
                                            "default: none)"),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel devices: heads, MLP columns, "
                                           "KV heads (and on XLA experts) split over N; h100: "
                                           "2, 4 or 8, one schedule per GPU"),
    kv_cache: str = typer.Option("auto", "--kv-cache",
                                 help="KV cache: float (the target's own dtype), int8 (+ a "
                                      "scale per token and KV head, blockwise global "
                                      "attention), fp8 (e4m3, unit scale, half the bytes), "
                                      "auto (the target's choice by context); `targets` "
                                      "lists what each target offers"),
    decode_loop_steps: int | None = typer.Option(
        None, "--decode-loop-steps",
        help="XLA targets: decode steps per device-side loop call, 0 to the largest prefill "
             "bucket (default 32, or that bucket if smaller); 0: no loop, one host round trip "
             "per token"),
    assistant: str | None = typer.Option(
        None, "--assistant",
        help="speculative decoding: a Gemma 4 assistant (MTP drafter) directory, or with "
             "--random-weights an assistant preset (e.g. gemma-4-31B-assistant, see `targets`), "
             "compiled into the artifact beside the target (XLA targets; default: none)"),
    draft_tokens: int | None = typer.Option(
        None, "--num-draft-tokens",
        help="most drafts one verify call checks (XLA: verify_{B}x{K+1}, draft_{B}; h100: "
             "verify_{R} up to max-seqs x (K+1) rows, n-gram drafts only); default 3 with "
             "--assistant, else 0 (no speculative entry points)"),
    chat_template: Path | None = typer.Option(
        None, "--chat-template",
        help="a Jinja chat template file: sets or replaces the model's (checked to render a "
             "sample conversation in the runtime's sandbox; default: the checkpoint's)"),
    config: Path | None = typer.Option(
        None, "--config", help="a build recipe (YAML: model, target, options, assistant; see "
                               "`rvcompile recipe`); options given here override it (default: "
                               "none)"),
) -> None:
    """Build MODEL into one artifact for TARGET (or as the --config recipe says). The artifact
    records its recipe, toolchain and input digests (`rvcompile recipe`, `rebuild`)."""
    from rvcompile.provenance import build_recipe
    from rvcompile.recipe import RecipeError, load_recipe, merge
    from rvcompile.targets import input_errors

    if seed is not None and seed < 0:
        fail(f"--seed {seed}: expected an integer >= 0")
    values = {"model": model, "target": target, "weights": weights and str(weights),
              "random_weights": random_weights, "seed": seed, "max_context": max_context,
              "max_seqs": max_seqs, "tp": tp, "kv_cache": kv_cache,
              "decode_loop_steps": decode_loop_steps, "assistant": assistant,
              "draft_tokens": draft_tokens, "topologies": tuple(topology),
              "chat_template": chat_template and str(chat_template)}
    params = {"topologies": "topology", "draft_tokens": "draft_tokens"}
    given = {k: v for k, v in values.items() if _given(ctx, params.get(k, k))}
    if _given(ctx, "prefill_buckets"):
        given["prefill_buckets"] = _buckets(prefill_buckets)
    if _given(ctx, "platforms"):
        given["platforms"] = tuple(p.strip() for p in platforms.split(",") if p.strip())
    try:
        recipe = merge(load_recipe(config) if config is not None else None, given)
        if recipe.model.seed is not None and not recipe.model.random_weights:
            fail(f"--seed {recipe.model.seed}: only --random-weights uses a seed")
        _warn_replaced_weights(recipe)
        with _signals_unwind():
            report = build_recipe(recipe, output, dump_ir=dump_ir,
                                  progress=progress,
                                  log=lambda s: typer.echo(s, err=True))
    except BuildInterrupted as e:
        typer.echo(f"rvcompile: error: interrupted by {e}; no temporary file left behind",
                   err=True)
        _die_of(e.signum)
    except (*USER_ERRORS, RecipeError, *input_errors()) as e:
        fail(str(e).splitlines()[0])
    typer.echo(f"wrote {report.path} ({report.artifact_bytes / 2**20:.1f} MiB, weights "
               f"{report.weight_bytes / 2**20:.1f} MiB) in {report.seconds:.1f} s", err=True)


def _warn_replaced_weights(recipe) -> None:
    """A warning when random weights replace a checkpoint directory's trained ones."""
    model = Path(recipe.model.source).expanduser()
    trained = sorted(model.glob("*.safetensors")) if model.is_dir() else []
    if recipe.model.random_weights and trained:
        warn(f"--random-weights: building {recipe.model.source} from random weights (seed "
             f"{recipe.model.seed or 0}), not the trained weights in its {len(trained)} "
             "safetensors file(s)")


def _given(ctx: typer.Context, param: str) -> bool:
    """Whether `param` was set on the command line (or its environment variable), not left at
    its default: what overrides a recipe."""
    source = ctx.get_parameter_source(param)  # an enum of typer's own click, by name
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


@app.command()
def recipe(artifact: Path) -> None:
    """Print the recipe ARTIFACT was built from (YAML for `build --config`), with its toolchain
    and input digests as comments."""
    from rvcompile.rebuild import stored_recipe
    from rvcompile.recipe import RecipeError

    try:
        stored = stored_recipe(artifact)
    except (*USER_ERRORS, RecipeError) as e:
        fail(str(e))
    typer.echo(stored.to_yaml(artifact.name), nl=False)


@app.command()
def rebuild(
    artifact: Path,
    weights: Path | None = typer.Option(None, "--weights", help="the model's checkpoint "
                                        "directory, if no longer where the recipe says "
                                        "(default: the recipe's)"),
    output: Path | None = typer.Option(None, "-o", "--output",
                                       help="the rebuilt artifact (default: ART.rebuilt.rvp)"),
) -> None:
    """Build ARTIFACT again from its stored recipe and compare: exit 0 when the new file is the
    same byte for byte (the signature page aside), 1 with each difference and its cause (a
    different toolchain is named), 2 when the build fails."""
    from rvcompile.rebuild import rebuild as run_rebuild
    from rvcompile.recipe import RecipeError
    from rvcompile.targets import input_errors

    out = output or artifact.with_name(f"{artifact.stem}.rebuilt{artifact.suffix or '.rvp'}")
    try:
        with _signals_unwind():
            report = run_rebuild(artifact, out, weights=weights,
                                 log=lambda s: typer.echo(s, err=True))
    except BuildInterrupted as e:
        typer.echo(f"rvcompile: error: interrupted by {e}; no temporary file left behind",
                   err=True)
        _die_of(e.signum)
    except (*USER_ERRORS, RecipeError, *input_errors()) as e:
        fail(str(e))
    if report.identical and report.signatures:
        typer.echo(f"{report.path}: identical to {artifact} up to its signature page "
                   f"({report.signatures} signature(s); signing the rebuild with the same key "
                   "gives the same page)")
        return
    if report.identical:
        typer.echo(f"{report.path}: identical to {artifact} (byte for byte)")
        return
    typer.echo(f"{report.path}: differs from {artifact}:")
    for line in report.differences:
        typer.echo(f"  {line}")
    raise typer.Exit(1)


TRUSTED_KEY_HELP = ("PEM Ed25519 public key to check signatures with (repeatable; default: "
                    "none)")


@app.command()
def inspect(artifact: Path = typer.Argument(..., help="the artifact (.rvp)"),
            as_json: bool = typer.Option(False, "--json", help="one JSON object instead of "
                                                                 "text (default: text)"),
            trusted_key: list[Path] = typer.Option([], "--trusted-key", help=TRUSTED_KEY_HELP),
            cost: bool = typer.Option(False, "--cost", help="also print each precompiled "
                                      "topology's traffic table: the bytes its decode step "
                                      "reads and writes, per HLO instruction and by class")
            ) -> None:
    """Show an artifact's model, target, platforms, sizes, hashes, versions and signers (each
    signature valid, INVALID, or not checked without its --trusted-key), then what its target
    summarizes (entry points; the XLA programs' mesh and precompiled sets, an h100 artifact's
    kernel schedule)."""
    from rvcompile.artifacts.manifest import read_manifest
    from rvcompile.targets import registry

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
            target = registry().get(h.target)
            summary = target.summarize(checked, m) if target is not None else None
            signed = [(s, status(s, art.signable, keys)) for s in art.signatures]
            info["signatures"] = [{"key_id": s.key_id, "signer": s.signer, "status": st}
                                  for s, st in signed]
            info["provenance"] = m.get("provenance")  # checked by read_manifest
    except USER_ERRORS as e:
        fail(str(e))
    if summary is not None:
        info.update(summary.info)
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    for key in ("file", "model", "target", "platforms", "compiler_version", "passes",
                "requirements"):
        typer.echo(f"{key:17} {info[key]}")
    for line in _provenance_lines(checked.provenance):
        typer.echo(line)
    lines = summary.lines if summary is not None else (
        f"{'summary':17} none: this rvcompile has no target {h.target!r}",)
    for line in lines:
        typer.echo(line)
    if cost:
        for line in (summary.cost_lines if summary is not None and summary.cost_lines else
                     (f"{'traffic':17} none (target {h.target} records no traffic table)",)):
            typer.echo(line)
    typer.echo(f"sections: (sha256 per {info['piece_size']:,}-byte piece)")
    for n, s in info["sections"].items():
        typer.echo(f"  {n:18} {s['size']:>14,} B  {s['pieces']:>4} pieces  "
                   f"digest {s['digest'][:16]}")
    typer.echo("signatures:" if signed else "signatures:      none (unsigned)")
    for sig, st in signed:
        typer.echo(f"  signed by {sig.who()}, {st}")


def _provenance_lines(provenance: Provenance | None) -> list[str]:
    """Where the weights came from and the build's options (the stored recipe), as `inspect`
    prints them; `rvcompile recipe ART` prints the whole recipe."""
    if provenance is None:
        return [f"{'weights':17} not recorded (built without a recipe: build_artifact called "
                "directly, or before rvcompile recorded one)"]
    model = provenance.recipe["model"]
    files = provenance.inputs.get("model", {})
    if model.get("random_weights"):
        lines = [f"{'weights':17} random, seed {model.get('seed') or 0} (shapes of "
                 f"{model['source']})"]
    else:
        where = model.get("weights") or model["source"]
        lines = [f"{'weights':17} checkpoint {where}",
                 f"{'':17} digest {model.get('digest')} ({len(files)} files hashed)"]
    for role in ("assistant", "chat_template"):
        extra = provenance.recipe.get(role)
        if extra:
            lines.append(f"{role:17} {extra['source']} digest {extra.get('digest')}")
    opts = " ".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
                    for k, v in provenance.recipe["options"].items())
    tools = " ".join(f"{k}={v}" for k, v in provenance.toolchain.items() if v is not None)
    return [*lines, textwrap.fill(opts, 100, initial_indent=f"{'build options':17} ",
                                  subsequent_indent=" " * 18, break_on_hyphens=False),
            textwrap.fill(tools, 100, initial_indent=f"{'toolchain':17} ",
                          subsequent_indent=" " * 18, break_on_hyphens=False)]


@app.command()
def verify(artifact: Path = typer.Argument(..., help="the artifact (.rvp)"),
           trusted_key: list[Path] = typer.Option([], "--trusted-key", help=TRUSTED_KEY_HELP)
           ) -> None:
    """Re-hash every section and check what the manifest and sections hold
    (artifacts/verify.py); with --trusted-key, first require a valid
    signature by one of the keys. Exit 0 when all checks pass, 2 otherwise."""
    from rvcompile.artifacts.verify import verify_artifact

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
def sign(artifact: Path = typer.Argument(..., help="the artifact (.rvp), signed in place"),
         key: Path = typer.Option(..., "--key", help="PEM Ed25519 private key (see `keygen`)"),
         signer: str = typer.Option("", "--signer", show_default=False,
                                    help="a name shown with the signature (default: none)")
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
    from rvcompile.model.presets import ASSISTANT_PRESETS, PRESETS
    from rvcompile.targets import registry

    for t in registry().values():
        auto = f"{t.kv.auto} beyond {t.kv.auto_above} tokens" if t.kv.auto != "float" else "float"
        typer.echo(f"{t.name:10} {t.emits}; passes: {', '.join(n for n, _ in t.passes) or '-'}; "
                   f"--kv-cache {', '.join(t.kv.choices())} (auto: {auto})")
    typer.echo(f"presets: {', '.join(PRESETS)}")
    typer.echo(f"assistant presets (--assistant NAME --random-weights): "
               f"{', '.join(ASSISTANT_PRESETS)}")
