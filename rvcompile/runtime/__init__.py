"""rvrun's runtime: `load(path)` checks and maps an artifact and returns a Model whose API
(generate, generate_stream, logits) is the same whatever target built it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.artifacts.contents import Contents, content_sections, read_contents
from rvcompile.artifacts.manifest import Manifest, read_manifest
from rvcompile.artifacts.signature import TrustedKey, load_trusted_key
from rvcompile.runtime.engine import engine_limits
from rvcompile.runtime.model import GenerationResult, Model

__all__ = ["load", "Model", "GenerationResult", "ArtifactError"]


def load(path: str | os.PathLike[str], *, verify: bool = True,
         kv_blocks: dict[str, int] | None = None, max_num_seqs: int | None = None,
         max_model_len: int | None = None,
         trusted_keys: Sequence[TrustedKey | str | os.PathLike[str]] | None = None,
         trust_executables: bool = False) -> Model:
    """Open `path` and check it, then load it on this machine. Raises ArtifactError with a
    one-line message when the file is damaged or does not fit.

    Order: with `trusted_keys` (TrustedKeys or PEM public key files), a valid signature by one
    of them, before anything past the header block and digest table is read (see
    rvcompile.artifacts.signature; the sections are then verified against the signed digests,
    so `verify=False` is refused with it); the header and the manifest's schema
    (artifacts/manifest.py); with `verify`, the sha256 of the small sections, which are then
    parsed (tokenizer, generation config, chat template, an h100 artifact's cubins against its
    schedule: artifacts/contents.py); then this machine (platform, devices, memory: refused
    before any weight is read); then, with `verify`, the sha256 of every other section; then
    the executor.
    `kv_blocks` sizes the KV pools by kind (XLA artifacts; default: a whole sequence per decode
    slot); `max_num_seqs` and `max_model_len` cap the engine (default: the artifact's).
    `trust_executables`: load the artifact's precompiled XLA executables, which XLA runs
    unchecked like a program (runtime/executors/precompiled.py), so only from a file one of
    `trusted_keys` signed; by default the StableHLO is compiled."""
    if trust_executables and trusted_keys is None:
        raise ArtifactError(f"{Path(path).name}: trust_executables needs trusted_keys: XLA runs "
                            "an executable unchecked, so only a signer you trust may supply one")
    keys = None
    if trusted_keys is not None:
        if not verify:
            raise ArtifactError(f"{Path(path).name}: trusted_keys needs verify: a signature "
                                "vouches for the sections only through their digests")
        keys = [k if isinstance(k, TrustedKey) else load_trusted_key(k) for k in trusted_keys]
    art = Artifact.open(Path(path), trusted_keys=keys)
    try:
        manifest = read_manifest(art)
        small = content_sections(manifest)
        if verify:
            art.verify(small)
        contents = read_contents(art, manifest)
        rest = [name for name in art.sections if name not in small] if verify else []
        if manifest.runtime == "h100":
            return _load_h100(art, manifest, contents, rest, kv_blocks, max_num_seqs,
                              max_model_len)
        return _load_xla(art, manifest, contents, rest, kv_blocks, max_num_seqs, max_model_len,
                         trust_executables)
    except BaseException:
        art.close()
        raise


def _load_h100(art: Artifact, manifest: Manifest, contents: Contents, verify: list[str],
               kv_blocks, max_num_seqs, max_model_len) -> Model:
    from rvcompile.runtime.executors.h100 import h100_executor, open_context
    from rvcompile.runtime.executors.scheduled import schedule_kinds

    schedule = manifest.h100.schedule
    if kv_blocks:
        raise ArtifactError(f"{art.path.name}: the KV pools of h100 artifacts are sized at "
                            "build; kv_blocks applies to XLA artifacts")
    _check_limits(art, schedule_kinds(schedule), schedule.kv.block_size, schedule.slots,
                  schedule.max_context, max_num_seqs, max_model_len)
    ctx = open_context(art)  # refuses a machine that doesn't fit before reading weights
    art.verify(verify)
    return Model(art, h100_executor(art, schedule, ctx), contents=contents,
                 max_num_seqs=max_num_seqs, max_model_len=max_model_len)


def _load_xla(art: Artifact, manifest: Manifest, contents: Contents, verify: list[str],
              kv_blocks, max_num_seqs, max_model_len, trust_executables: bool) -> Model:
    from rvcompile.runtime.executors.xla import XlaExecutor, check_fits, kv_kinds

    xla = manifest.xla
    check_fits(art, xla, kv_blocks)  # refuse impossible limits before compiling anything
    _check_limits(art, kv_kinds(xla, kv_blocks, art.path.name), xla.block_size, xla.slots,
                  xla.max_context, max_num_seqs, max_model_len)
    art.verify(verify)
    return Model(art, XlaExecutor(art, xla, kv_blocks, trust_executables=trust_executables),
                 contents=contents,
                 max_num_seqs=max_num_seqs, max_model_len=max_model_len)


def _check_limits(art: Artifact, kinds, block_size: int, slots: int, max_context: int,
                  max_num_seqs: int | None, max_model_len: int | None) -> None:
    try:
        engine_limits(kinds, block_size, slots, max_context, max_num_seqs, max_model_len)
    except ValueError as e:
        raise ArtifactError(f"{art.path.name}: {e}") from None
