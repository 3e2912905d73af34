"""The small sections of a model artifact, parsed and checked once (after their hashes, when the
reader verifies): what the runtime then uses without looking again.

    tokenizer          tokenizer.json text: parsed by `tokenizers`; every id it can produce lies
                       inside the model's vocabulary (an id past it would read past the
                       embedding table)
    generation_config  a JSON object (format v3): optional bos_token_id (an id), eos_token_id (an
                       id or a non-empty list of ids) and pad_token_id (an id or null), each
                       inside the vocabulary; absent ids fall back to the model config's; other
                       keys (a checkpoint's sampling defaults) are kept and unused
    chat_template      UTF-8 Jinja text, or empty for none: parsed (not rendered) by jinja2's
                       sandboxed environment, so a syntax error is found at load, not at the
                       first chat request
    cubins (h100)      each module's sha256, then every launch of the schedule against the
                       kernels its cubin's ELF declares (artifacts/cubin.py): the kernel exists,
                       takes exactly the launch's arguments (count and sizes) and allows its
                       threads per block; and the piece hash (manifest h100.piece_hash), the
                       same way against piece_hash.PARAM_BYTES and THREADS

An XLA artifact's programs are checked by xla_programs.py (it needs jax); `verify.py` is
everything a reader can check without running anything (`rvcompile verify`); `rvrun` makes the
same checks, the machine's in between.

The build runs the same checks on the bytes it is about to write (`parse_contents`), so a
checkpoint with a broken tokenizer or template is refused there, not at its first load.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

from tokenizers import Tokenizer

from rvcompile.artifacts.container import Artifact
from rvcompile.artifacts.cubin import CubinError, Kernel, kernels
from rvcompile.artifacts.format import ArtifactError
from rvcompile.artifacts.kernel_schedule import Collective, KernelSchedule
from rvcompile.artifacts.manifest import (
    TEXT_SECTIONS,
    H100Manifest,
    Manifest,
    token_ids,
)
from rvcompile.artifacts.piece_hash import PARAM_BYTES, THREADS
from rvcompile.artifacts.schema import At, SchemaError, parse_json


@dataclass(frozen=True)
class Contents:
    tokenizer: Tokenizer
    vocab_size: int  # the model's; every id above lies below it
    eos_ids: frozenset[int]  # generation stops at any of these
    bos_id: int
    chat_template: str | None  # Jinja source, None when the artifact has none


def content_sections(manifest: Manifest) -> tuple[str, ...]:
    """The sections `read_contents` reads: what a loader hashes before it."""
    return (*TEXT_SECTIONS, *(("cubins",) if manifest.h100 else ()))


def read_contents(art: Artifact, manifest: Manifest) -> Contents:
    """`art`'s tokenizer, generation config and chat template (and cubins, for h100), checked
    against `manifest` (from read_manifest); one-line ArtifactError otherwise. The same as
    read_texts, then check_cubins (runtime.load runs them on two threads)."""
    return parse_contents(manifest, {n: art.buffer(n) for n in content_sections(manifest)},
                          art.path.name)


def read_texts(art: Artifact, manifest: Manifest) -> Contents:
    """read_contents but the cubins: what the runtime reads from the text sections, checked."""
    return parse_texts(manifest, {n: art.buffer(n) for n in TEXT_SECTIONS}, art.path.name)


def check_cubins(art: Artifact, manifest: Manifest) -> None:
    """read_contents' check of an h100 artifact's cubins against its schedules (nothing for
    other artifacts)."""
    if manifest.h100:
        parse_cubins(manifest, art.buffer("cubins"), art.path.name)


def parse_contents(manifest: Manifest, sections: Mapping[str, bytes | memoryview],
                   fname: str) -> Contents:
    """The same check on section bytes not yet written (the build)."""
    contents = parse_texts(manifest, sections, fname)
    if manifest.h100:
        parse_cubins(manifest, sections["cubins"], fname)
    return contents


def parse_texts(manifest: Manifest, sections: Mapping[str, bytes | memoryview],
                fname: str) -> Contents:
    """read_texts on the text sections' bytes."""
    try:
        return _contents(manifest, sections)
    except SchemaError as e:
        raise ArtifactError(f"{fname}: {e}") from None


def parse_cubins(manifest: Manifest, blob: bytes | memoryview, fname: str) -> None:
    """check_cubins on the cubins section's bytes (`manifest` an h100 one)."""
    tp = manifest.h100.tensor_parallel
    try:
        for schedule in tp.schedules if tp else (manifest.h100.schedule,):
            _check_cubins(schedule, blob)
        _check_piece_hash(manifest.h100, blob)
    except SchemaError as e:
        raise ArtifactError(f"{fname}: {e}") from None


def _contents(manifest: Manifest, sections: Mapping[str, bytes | memoryview]) -> Contents:
    model = manifest.model
    vocab = model.vocab_size
    gen = At(parse_json(bytes(sections["generation_config"]), "generation_config"),
             "generation_config")
    gen.obj()
    eos = gen.get("eos_token_id")
    bos = gen.get("bos_token_id")
    pad = gen.get("pad_token_id")
    if pad is not None and pad.value is not None:
        pad.int(0, vocab - 1)
    template = _text(sections["chat_template"], "chat_template")
    if template:
        _parse_template(template)
    return Contents(
        tokenizer=_tokenizer(_text(sections["tokenizer"], "tokenizer"), vocab),
        vocab_size=vocab,
        eos_ids=frozenset(token_ids(eos, vocab) if eos is not None else model.eos_ids),
        bos_id=bos.int(0, vocab - 1) if bos is not None else model.bos_id,
        chat_template=template or None)


def first_line(error: BaseException | str | None) -> str:
    """A one-line, bounded rendering of a third-party parser's error."""
    text = str(error or "").strip()
    head = text.splitlines()[0][:160] if text else ""
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {head}" if head else type(error).__name__
    return head


def _text(data: bytes | memoryview, section: str) -> str:
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise SchemaError(f"{section}: not UTF-8 ({e.reason} at byte {e.start})") from None


def _tokenizer(text: str, vocab: int) -> Tokenizer:
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # the Rust parser's errors come as plain Exception
        raise SchemaError(f"tokenizer: not a tokenizers tokenizer.json ({first_line(e)})"
                          ) from None
    ids = tok.get_vocab(with_added_tokens=True).values()
    if not ids:
        raise SchemaError("tokenizer: has no tokens")
    if max(ids) >= vocab:
        raise SchemaError(f"tokenizer: token id {max(ids)} lies outside the model's vocabulary "
                          f"of {vocab}")
    return tok


def _parse_template(text: str) -> None:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise SchemaError(f"chat_template: line {e.lineno}: {first_line(e.message)}") from None
    except (jinja2.TemplateError, RecursionError) as e:
        raise SchemaError(f"chat_template: cannot be parsed ({type(e).__name__})") from None


def _check_cubins(schedule: KernelSchedule, blob: bytes | memoryview) -> None:
    where = "manifest.h100.schedule"
    found: dict[str, dict[str, Kernel]] = {}
    for module, c in schedule.cubins.items():
        data = bytes(blob[c.offset:c.offset + c.size])
        if hashlib.sha256(data).hexdigest() != c.sha256:
            raise SchemaError(f"{where}.cubins.{module}: the cubin's sha256 does not match")
        try:
            found[module] = kernels(data)
        except CubinError as e:
            raise SchemaError(f"{where}.cubins.{module}: not a readable cubin: {e}") from None
    for entry in schedule.entries.values():
        for i, x in enumerate(entry.launches):
            if isinstance(x, Collective):  # no kernel: checked with the manifest
                continue
            at = f"{where}.entries.{entry.name}.launches[{i}]"
            kernel = found[x.module].get(x.kernel)
            if kernel is None:
                raise SchemaError(f"{at}: kernel {x.kernel!r} is not in {x.module}")
            sizes = tuple(schedule.arg_bytes(a) for a in x.args)
            if sizes != kernel.param_sizes:
                raise SchemaError(f"{at}: kernel {x.kernel} takes parameters of "
                                  f"{list(kernel.param_sizes)} bytes; the launch passes "
                                  f"{list(sizes)}")
            threads = math.prod(x.block)
            if kernel.max_threads is not None and threads > kernel.max_threads:
                raise SchemaError(f"{at}: {threads} threads per block; kernel {x.kernel} was "
                                  f"compiled for at most {kernel.max_threads}")


def _check_piece_hash(h100: H100Manifest, blob: bytes | memoryview) -> None:
    """The piece hash's kernel, in a cubin _check_cubins has hashed, takes what the runtime
    passes it (PARAM_BYTES) in blocks of THREADS."""
    ph = h100.piece_hash
    if ph is None:
        return
    where = "manifest.h100.piece_hash"
    c = h100.schedule.cubins[ph.module]
    kernel = kernels(bytes(blob[c.offset:c.offset + c.size])).get(ph.kernel)
    if kernel is None:
        raise SchemaError(f"{where}: kernel {ph.kernel!r} is not in {ph.module}")
    if kernel.param_sizes != PARAM_BYTES:
        raise SchemaError(f"{where}: kernel {ph.kernel} takes parameters of "
                          f"{list(kernel.param_sizes)} bytes; the runtime passes "
                          f"{list(PARAM_BYTES)}")
    if kernel.max_threads is not None and kernel.max_threads < THREADS:
        raise SchemaError(f"{where}: kernel {ph.kernel} was compiled for at most "
                          f"{kernel.max_threads} threads per block; the runtime launches "
                          f"{THREADS}")
