"""The .rvp on-disk format: constants, changelog, the header block and its (de)serialization.

An .rvp file holds one compiled model. Layout (all integers little-endian):

    offset  size  field
    0       8     magic, MAGIC
    8       4     format version, uint32
    12      4     length n of the header JSON, uint32
    16      32    sha256 of the header JSON bytes
    48      n     header JSON (canonical, see `canonical_json`)
    48+n    ...   zero padding up to HEADER_SIZE (4096)
    4096    ...   sections, each at a multiple of ALIGN (4096), in the order they were reserved;
                  the bytes between them are zero
    ...     ...   manifest JSON (canonical), at a multiple of ALIGN after the last section;
                  the file ends where the manifest ends

Header JSON fields (every one added in format v1):
    compiler_version  str: version of rvcompile that wrote the file.
    target            str: compile target the programs were built by, e.g. "xla".
    platforms         list of str: platforms the programs run on, e.g. ["tpu", "cuda", "cpu"].
    requirements      dict, free-form: what a runtime must provide, e.g.
                      {"jax": ">=0.10", "min_devices": 1}.
    manifest          {"offset": int, "length": int, "sha256": hex str} locating the manifest.
    sections          list in file order of {"name": str, "offset": int, "size": int,
                      "sha256": hex str}; offsets are absolute.

The section table lives in the header, not the manifest, so a loader can check the file size and
map sections before it reads (or trusts) anything past the first 4096 bytes, and a truncated
file is reported by the section it cuts. The price is a cap of a few dozen sections: sections are
coarse blobs (weights, programs, tokenizer); tensors are addressed by offsets inside a section,
recorded in the manifest. The manifest is exactly the caller's dict; it holds no layout.

Readers accept MIN_READABLE_FORMAT <= version <= FORMAT_VERSION. Any change a v1 reader would
misread bumps FORMAT_VERSION and gets a CHANGELOG entry. Errors are `ArtifactError`, one line,
starting with the file name.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Any

FORMAT_VERSION = 1
MIN_READABLE_FORMAT = 1

# (date, version, change); newest last.
CHANGELOG: tuple[tuple[str, int, str], ...] = (
    ("2026-11-22", 1, "first format: 4096-byte header block, aligned sections, JSON manifest"),
    ("2026-11-22", 1, "XLA manifest may carry xla.mesh (tensor parallelism: axis, size, the "
                      "PartitionSpec of every weight array and KV pool) with header requirement "
                      "min_devices; absent means one device, as before"),
    ("2026-11-22", 1, "XLA artifacts may carry an \"executables\" section and manifest "
                      "xla.precompiled: per TPU topology, serialized executables of every entry "
                      "point (offset, size, sha256), what a runtime must match (platform, device "
                      "kind, ids, coords, jax/jaxlib/libtpu, KV blocks) and a cost estimate; "
                      "absent means compile the StableHLO, as before"),
)

# The 0x89 byte and the CR LF / ^Z tail (the PNG trick) catch files mangled by text-mode copies
# and keep the file from being mistaken for text.
MAGIC = b"\x89RVP\r\n\x1a\n"
HEADER_SIZE = 4096
ALIGN = 4096
_PREFIX = struct.Struct("<8sII32s")  # magic, format version, header JSON length, its sha256
MAX_HEADER_JSON = HEADER_SIZE - _PREFIX.size


class ArtifactError(ValueError):
    """A file that is not a readable .rvp, or a misuse of the writer; the message names the file."""


@dataclass(frozen=True)
class ArtifactHeader:
    """The caller-facing header fields; see the module docstring for their meaning."""

    compiler_version: str
    target: str
    platforms: tuple[str, ...]
    requirements: dict[str, Any] = field(default_factory=dict)
    # Not stored: the name of the file the reader read this header from, for error messages.
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "platforms", tuple(self.platforms))


@dataclass(frozen=True)
class SectionInfo:
    name: str
    offset: int  # absolute byte offset in the file, a multiple of ALIGN
    size: int  # bytes
    sha256: str  # hex digest of the section's bytes


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def canonical_json(obj: Any) -> bytes:
    """One byte string per value: sorted keys, no whitespace, ASCII, no NaN."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def encode_header_block(
    header: ArtifactHeader, sections: list[SectionInfo], manifest: SectionInfo, fname: str
) -> bytes:
    """The full HEADER_SIZE block; `manifest` reuses SectionInfo (offset, size=length, sha256)."""
    doc = {
        "compiler_version": header.compiler_version,
        "target": header.target,
        "platforms": list(header.platforms),
        "requirements": header.requirements,
        "manifest": {"offset": manifest.offset, "length": manifest.size, "sha256": manifest.sha256},
        "sections": [
            {"name": s.name, "offset": s.offset, "size": s.size, "sha256": s.sha256}
            for s in sections
        ],
    }
    try:
        body = canonical_json(doc)
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"{fname}: header is not JSON-serializable: {e}") from e
    if len(body) > MAX_HEADER_JSON:
        raise ArtifactError(
            f"{fname}: header JSON is {len(body)} bytes, over the {MAX_HEADER_JSON} that fit in "
            f"the {HEADER_SIZE}-byte header block ({len(sections)} sections); "
            "use fewer, larger sections"
        )
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(body), hashlib.sha256(body).digest())
    return (prefix + body).ljust(HEADER_SIZE, b"\0")


def decode_header_block(
    block: bytes, fname: str
) -> tuple[ArtifactHeader, list[SectionInfo], SectionInfo]:
    """Checks magic, then version, then the header checksum; returns header, sections, manifest."""
    if len(block) < _PREFIX.size or block[:8] != MAGIC:
        raise ArtifactError(f"{fname}: not an rvcompile artifact (bad magic {block[:8]!r})")
    _, version, length, digest = _PREFIX.unpack_from(block)
    supported = f"{MIN_READABLE_FORMAT}..{FORMAT_VERSION}"
    if version > FORMAT_VERSION:
        raise ArtifactError(
            f"{fname}: artifact format version {version} is newer than this rvcompile reads "
            f"(formats {supported}); upgrade rvcompile"
        )
    if version < MIN_READABLE_FORMAT:
        raise ArtifactError(
            f"{fname}: artifact format version {version} is older than this rvcompile reads "
            f"(formats {supported}); recompile the model or use an older rvcompile"
        )
    body = block[_PREFIX.size : _PREFIX.size + length]
    if length > MAX_HEADER_JSON or hashlib.sha256(body).digest() != digest:
        raise ArtifactError(f"{fname}: header block is corrupt (checksum mismatch)")
    try:
        doc = json.loads(body)
        header = ArtifactHeader(
            compiler_version=_typed(doc["compiler_version"], str),
            target=_typed(doc["target"], str),
            platforms=tuple(_typed(p, str) for p in _typed(doc["platforms"], list)),
            requirements=_typed(doc["requirements"], dict),
            source=fname,
        )
        sections = [
            _section(d["name"], d["offset"], d["size"], d["sha256"])
            for d in _typed(doc["sections"], list)
        ]
        m = doc["manifest"]
        manifest = _section("manifest", m["offset"], m["length"], m["sha256"])
    except (ValueError, TypeError, KeyError) as e:
        raise ArtifactError(f"{fname}: header JSON is malformed ({type(e).__name__}: {e})") from e
    _check_layout(sections, manifest, fname)
    return header, sections, manifest


def _typed(value: Any, kind: type) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"expected {kind.__name__}, got {value!r}")
    return value


def _section(name: Any, offset: Any, size: Any, sha256: Any) -> SectionInfo:
    return SectionInfo(
        _typed(name, str), _typed(offset, int), _typed(size, int), _typed(sha256, str)
    )


def _check_layout(sections: list[SectionInfo], manifest: SectionInfo, fname: str) -> None:
    """Sections aligned, in file order, non-overlapping, uniquely named; manifest after them."""
    if len({s.name for s in sections}) != len(sections):
        raise ArtifactError(f"{fname}: header names a section twice")
    end = HEADER_SIZE
    for s in [*sections, manifest]:
        if s.offset % ALIGN or s.offset < end or s.size < 0:
            raise ArtifactError(f"{fname}: header has a bad section table entry {s}")
        end = s.offset + s.size
