"""How an artifact was made: its recipe, the toolchain that built it and a digest of every input
file, stored in the manifest's "provenance" (artifacts/manifest.py checks its schema), and the
build that writes them (`build_recipe`, what `rvcompile build` runs).

Input digests: for the model and for an assistant, the sha256 of each file the loader reads from
its checkpoint directory (sources/checkpoint.input_files: config, safetensors and their index,
tokenizer and generation config, chat template), and one digest over them all, the recipe's
`digest`:

    sha256 of the lines "<hex sha256>  <file name>\\n", sorted by name

(what `sha256sum FILES | sort -k2` prints, hashed), so a checkpoint's digest can be checked by
hand. A chat template file's digest is its own sha256 (`sha256sum FILE`). A recipe that names a
digest is refused at build when the files differ, naming the file
when the artifact it came from says what each one was. A preset with random weights reads no
file and has no digest.

Toolchain: rvcompile's version, and the versions of what shaped the bytes (`toolchain`): numpy
and ml_dtypes (weights), jax and jaxlib (the XLA programs), libtpu (precompiled executables),
nvcc (the h100 target's cubins); null for a tool the build did not use.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from rvcompile import __version__
from rvcompile.build import BuildReport, build_artifact, prepare
from rvcompile.model.presets import PRESETS
from rvcompile.progress import Phases
from rvcompile.recipe import Assistant, Recipe, Source
from rvcompile.sources.checkpoint import input_files, read_chat_template_file
from rvcompile.sources.model_source import CheckpointError

_READ = 16 << 20  # bytes per read while hashing a file


@dataclass(frozen=True)
class Inputs:
    """The files one source was read from: name -> sha256 hex, and their combined digest."""

    files: dict[str, str]
    digest: str  # "sha256:<hex>"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            h.update(chunk)  # hashlib releases the GIL on large updates: files hash in parallel
    return h.hexdigest()


def combined_digest(files: dict[str, str]) -> str:
    listing = "".join(f"{files[name]}  {name}\n" for name in sorted(files))
    return "sha256:" + hashlib.sha256(listing.encode()).hexdigest()


def digest_directory(directory: Path, *, weights: bool, phases: Phases | None = None) -> Inputs:
    """The digests of the files a load of `directory` reads (its weights too with `weights`),
    hashed on every core, a phase of `phases` counting bytes by finished file (a checkpoint's
    weights are read once more for this); the result does not depend on the order they finish
    in."""
    paths = input_files(directory, weights=weights)
    phases = phases or Phases("rvcompile", "off")
    sizes = {p: p.stat().st_size for p in paths}
    with phases.phase(f"digest {directory.name}", total=sum(sizes.values()), unit="B") as bar, \
            ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1) or 1) as pool:
        futures = {pool.submit(file_sha256, p): p for p in paths}
        for done in as_completed(futures):
            done.result()
            bar.advance(sizes[futures[done]])
        hexes = [f.result() for f in futures]
    files = {p.name: h for p, h in zip(futures.values(), hexes, strict=True)}
    return Inputs(files, combined_digest(files))


def read_directory(model: Source) -> Path | None:
    """The checkpoint directory the model's files come from; None for a preset with random
    weights, or a source that is neither a preset nor a model directory (which the load
    refuses, naming it). The same resolution as checkpoint.load_model_source: a directory wins
    over a preset of its name."""
    if model.weights is not None:
        return Path(model.weights).expanduser()
    path = Path(model.source).expanduser()
    return path if path.is_dir() and (path / "config.json").is_file() else None


def assistant_directory(assistant: Assistant) -> Path | None:
    path = Path(assistant.source).expanduser()
    return path if path.is_dir() and (path / "config.json").is_file() else None


def check_digest(role: str, want: str | None, got: Inputs | None,
                 recorded: dict[str, str] | None = None) -> None:
    """CheckpointError naming the first differing file (with `recorded`, the per-file digests
    the recipe's artifact stored) when `want` is given and the files have another digest."""
    if want is None:
        return
    if got is None:
        raise CheckpointError(f"{role}.digest: given, but {role} reads no checkpoint files "
                              "(a preset with random weights)")
    if got.digest == want:
        return
    why = ""
    if recorded is not None:
        names = sorted(set(recorded) | set(got.files))
        diff = next((n for n in names if recorded.get(n) != got.files.get(n)), None)
        if diff is not None:
            state = ("is new" if diff not in recorded else "is missing" if diff not in got.files
                     else "has other contents")
            why = f" ({diff} {state})"
    raise CheckpointError(f"{role}.digest: the checkpoint files have digest {got.digest}, the "
                          f"recipe says {want}{why}")


def toolchain(manifest: dict[str, Any]) -> dict[str, str | None]:
    """The versions of what shaped the bytes of the artifact `manifest` describes: rvcompile,
    numpy and ml_dtypes (weights), jax and jaxlib (XLA targets' programs), libtpu (their
    precompiled executables), nvcc (the h100 target's cubins, as it records it). None: not
    used by this build, so that a tool it did not use cannot make two builds differ."""
    xla = manifest.get("xla")
    h100 = manifest.get("h100")
    return {"rvcompile": __version__, "numpy": _version("numpy"),
            "ml_dtypes": _version("ml_dtypes"),
            "jax": _version("jax") if xla else None,
            "jaxlib": _version("jaxlib") if xla else None,
            "libtpu": _version("libtpu") if xla and xla.get("precompiled") else None,
            "nvcc": h100.get("nvcc") if isinstance(h100, dict) else None}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def build_recipe(recipe: Recipe, out: Path, *, dump_ir: str | None = None,
                 progress: bool = False, log: Callable[[str], None] = print,
                 read_from: Path | None = None,
                 recorded_inputs: dict[str, dict[str, str]] | None = None) -> BuildReport:
    """Build `recipe` into `out`, storing the recipe (every option as the target took it, each
    digest filled in), the toolchain and the input digests. `read_from`: read the model's
    checkpoint from this directory instead of the recipe's path (rebuild --weights), which
    stays what the artifact records. `recorded_inputs`: the per-file digests the recipe's
    artifact stored, to name the file that differs."""
    _, opts = prepare(recipe.build_options(dump_ir))  # the target checks and fills them in
    phases = Phases("rvcompile", Phases.mode_for(progress), write=log)
    recipe = recipe.with_options(opts)
    if recipe.model.random_weights and recipe.model.seed is None:  # recorded as used
        recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, seed=0))
    model = recipe.model
    directory = read_from or read_directory(model)
    if read_from is not None and directory is None:
        raise CheckpointError("--weights: the recipe's model is a preset with random weights; "
                              "it reads no checkpoint")
    if directory is not None and not directory.is_dir():
        raise CheckpointError(f"{directory}: no such model directory")
    weights_read = not model.random_weights
    model_inputs = (digest_directory(directory, weights=weights_read, phases=phases)
                    if directory is not None else None)
    if model_inputs is not None or model.source in PRESETS:  # else the load names the error
        check_digest("model", model.digest, model_inputs, (recorded_inputs or {}).get("model"))
    inputs = {"model": model_inputs.files} if model_inputs is not None else {}
    if model_inputs is not None:
        recipe = _replace_digest(recipe, "model", model_inputs.digest)
    assistant = recipe.assistant
    if assistant is not None:
        adir = assistant_directory(assistant)
        a_inputs = (digest_directory(adir, weights=weights_read, phases=phases)
                    if adir is not None else None)
        check_digest("assistant", assistant.digest, a_inputs,
                     (recorded_inputs or {}).get("assistant"))
        if a_inputs is not None:
            inputs["assistant"] = a_inputs.files
            recipe = _replace_digest(recipe, "assistant", a_inputs.digest)

    template = recipe.chat_template
    if template is not None:
        path = Path(template.source).expanduser()
        read_chat_template_file(path)  # one line naming --chat-template before any hashing
        hex_digest = file_sha256(path)
        t_inputs = Inputs({path.name: hex_digest}, "sha256:" + hex_digest)
        check_digest("chat_template", template.digest, t_inputs,
                     (recorded_inputs or {}).get("chat_template"))
        inputs["chat_template"] = t_inputs.files
        recipe = _replace_digest(recipe, "chat_template", t_inputs.digest)

    def provenance(manifest: dict[str, Any]) -> dict[str, Any]:
        return {"recipe": recipe.to_json(), "toolchain": toolchain(manifest),
                "inputs": inputs}

    if read_from is not None:
        source, weights = ((model.source, str(read_from)) if model.weights is not None
                           else (str(read_from), None))
    else:
        source, weights = model.source, model.weights
    return build_artifact(_home(source), out, opts,
                          weights=Path(weights).expanduser() if weights else None,
                          random_weights=model.random_weights, seed=model.seed or 0,
                          assistant=_home(assistant.source) if assistant else None,
                          chat_template=(Path(template.source).expanduser() if template
                                         else None),
                          progress=progress, log=log, provenance=provenance)


def _home(source: str) -> str:
    """A path's leading ~ as the home directory (a preset name has none)."""
    return str(Path(source).expanduser()) if source.startswith("~") else source


def _replace_digest(recipe: Recipe, role: str, digest: str) -> Recipe:
    source = getattr(recipe, role)
    return dataclasses.replace(recipe, **{role: dataclasses.replace(source, digest=digest)})
