"""The .rvp on-disk format: constants, changelog, the header block and its (de)serialization.

An .rvp file holds one compiled model. Layout (all integers little-endian):

    offset  size  field
    0       8     magic, MAGIC
    8       4     format version, uint32
    12      4     length n of the header JSON, uint32
    16      32    sha256 of the header JSON bytes
    48      n     header JSON (canonical, see `canonical_json`)
    48+n    ...   zero padding up to HEADER_SIZE (4096), checked (v3)
    4096    ...   sections, each at a multiple of ALIGN (4096), in the order they were reserved;
                  the bytes between them are zero
    ...     ...   piece-digest table (v2), at a multiple of ALIGN after the last section: for
                  each section in file order, for each of its pieces in order, the 32-byte
                  sha256 of that piece
    ...     ...   manifest JSON (canonical), at a multiple of ALIGN after the piece-digest table;
                  an unsigned file ends where the manifest ends
    ...     4096  signature page (optional; v2 since 2026-11-24), at the first multiple of
                  ALIGN after the manifest; a signed file ends where it ends. Layout below.

Each region (section, table, manifest, signature page) starts at the first multiple of ALIGN
after the previous one ends, and the bytes between them are zero (readers check both), so that
no byte of a file lies outside what its hashes and signature cover.

A section of `size` bytes is cut into ceil(size / piece_size) pieces of `piece_size` bytes, the
last one shorter when `size` is not a multiple (an empty section has none). Pieces are hashed
independently so that writers and verifiers can hash them on many cores at once.

Header JSON fields (added in format v1 unless marked; strings are printable, 1 to 200
characters, since v3):
    compiler_version  str: version of rvcompile that wrote the file.
    target            str: compile target the programs were built by, e.g. "xla".
    platforms         list of str: platforms the programs run on, e.g. ["tpu", "cuda", "cpu"].
    requirements      dict, free-form: what a runtime must provide, e.g.
                      {"jax": ">=0.10", "min_devices": 1}.
    manifest          {"offset": int, "length": int, "sha256": hex str} locating the manifest.
    sections          list in file order of {"name": str, "offset": int, "size": int}; offsets
                      are absolute. (v1 entries also had "sha256" of the whole section; v2 has
                      per-piece digests instead.)
    piece_size        int > 0 (v2): bytes per piece.
    piece_digests     {"offset": int, "length": int, "sha256": hex str} (v2) locating the
                      piece-digest table; length is 32 times the total number of pieces.

Signature page (see `signature.py`): one ALIGN-byte page, so that `rvcompile sign` rewrites
exactly one page and never a byte before it:
    offset  size
    0       8     SIGNATURE_MAGIC (signature.py)
    8       4     length n of the signature JSON, uint32
    12      32    sha256 of the signature JSON
    44      n     signature JSON (canonical): {"signatures": [{"key_id": str, "signer": str,
                  "ed25519": str}, ...]}, at least one, at most one per key id
    44+n    ...   zeros up to 4096
Signature fields:
    key_id            str, 64 lowercase hex digits: sha256 of the signer's raw 32-byte Ed25519
                      public key (the key's fingerprint).
    signer            str: a name the signer chose, may be empty; at most 128 printable
                      characters (`inspect` prints it).
    ed25519           str, 128 lowercase hex digits: the Ed25519 signature of the message
                      MESSAGE_TAG | key_id (32 raw bytes) | uint32 length + UTF-8 signer |
                      the header block (all HEADER_SIZE bytes) | the piece-digest table.
The header block binds the format version, every header field and the sha256 of the table and
of the manifest; the table binds every section byte. Signatures are independent: adding one
leaves the others valid.

The section table lives in the header, not the manifest, so a loader can check the file size and
map sections before it reads (or trusts) anything past the first 4096 bytes, and a truncated
file is reported by the section it cuts. The price is a cap of a few dozen sections: sections are
coarse blobs (weights, programs, tokenizer); tensors are addressed by offsets inside a section,
recorded in the manifest. The manifest is exactly the caller's dict; it holds no layout (a
model artifact's manifest has the schema of `manifest.py`, checked by its readers). The piece
digests sit outside the header because a large section has hundreds of them; the header's
checksum covers the table's sha256, which covers each piece's. Every byte of the file is covered:
the header JSON by its checksum, the padding by being zeros (checked at open), sections by their
pieces (checked by `verify`), the table and the manifest by their sha256, the signature page by
its own checksum.

Readers accept MIN_READABLE_FORMAT <= version <= FORMAT_VERSION. Any change an older reader would
misread bumps FORMAT_VERSION and gets a CHANGELOG entry. Errors are `ArtifactError`, one line,
starting with the file name.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Any

FORMAT_VERSION = 7
# Older files are refused, not read serially: they are rebuilt in minutes, and one way to verify
# and one schema keep the reader and the section digest (a cache key) single-meaning.
MIN_READABLE_FORMAT = 7

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
    ("2026-11-22", 2, "sections are hashed in pieces of header piece_size bytes (default 256 "
                      "MiB), the digests in a table located by header piece_digests, so that "
                      "commit and verify hash on all cores; section entries lose their "
                      "whole-section sha256; v1 files are refused (rebuild them)"),
    ("2026-11-22", 2, "h100 artifacts carry header requirement kernel_launch = \"programmatic\" "
                      "(every kernel opens with griddepcontrol.wait, so the runtime launches "
                      "with programmatic stream serialization); absent: refused (rebuild)"),
    ("2026-11-24", 2, "optional signature page after the manifest: Ed25519 signatures over the "
                      "header block and the piece-digest table (signature.py); readers require "
                      "every region at the first ALIGN multiple after the previous one and zero "
                      "bytes between; unsigned files are unchanged, and earlier v2 readers "
                      "refuse signed ones (unexpected bytes after the manifest)"),
    ("2026-11-24", 3, "xla.precompiled executables are stored without pickle: each entry holds "
                      "the PJRT-serialized executable and JSON operands: its flat inputs and "
                      "outputs; records carry encoding EXECUTABLES_ENCODING; v2 records "
                      "(jax's pickle) are never loaded. A model artifact's manifest, header "
                      "requirements and generation_config have a schema (artifacts/manifest.py, "
                      "contents.py), checked field by field where a reader opens the file; the "
                      "h100 kernel schedule carries its own version "
                      "(kernel_schedule.SCHEDULE_VERSION); header strings are printable and the "
                      "header block's padding zero; v2 files are refused (rebuild them)"),
    ("2026-11-24", 4, "one name per concept: the decode width (rvcompile build --max-seqs) is "
                      "max_seqs everywhere: xla.slots -> xla.max_seqs, the kernel schedule's "
                      "slots -> max_seqs (SCHEDULE_VERSION 3), and in xla.precompiled costs "
                      "device.slots -> device.max_seqs, fits_at_slots -> fits_at_max_seqs; v3 "
                      "files are refused (rebuild them)"),
    ("2026-11-24", 4, "XLA manifest may carry xla.speculative (draft_tokens K, entry points "
                      "verify_{max_seqs}x{K+1} and draft_{max_seqs} or null, hidden_size, reads) "
                      "and, with a draft entry point, a top-level assistant {name, origin, "
                      "config} (speculative decoding with an assistant drafter, issue 15); "
                      "absent: no speculative entry points, as before. Readers before this entry "
                      "refuse such files (an entry point they do not know), never misread them"),
    ("2026-11-24", 4, "the manifest may carry provenance {recipe, toolchain, inputs}: the build "
                      "recipe, the versions of the tools that shaped its bytes (rvcompile, numpy, "
                      "ml_dtypes, jax, jaxlib, libtpu, nvcc), and the "
                      "sha256 of every input file (issue 21; `rvcompile recipe` and `rebuild` "
                      "read it); absent: built without one. Earlier readers ignore it"),
    ("2026-11-24", 5, "XLA manifest carries xla.sampler (top_logprobs K, penalty_ids P, "
                      "mask_words W): prefill_T and decode_B take, after the sampling arrays, a "
                      "token mask, penalty ids, counts and factors and the top log-probabilities "
                      "wanted, and return each token's log-probability and the top K (issue 16; "
                      "targets/xla/sampler.py); v4 files are refused (rebuild them), since v4 "
                      "readers would call such programs with too few arguments"),
    ("2026-11-24", 6, "speculative decoding's ratio rule on the XLA targets (issue 15): with an "
                      "assistant, draft_B also returns draft_probs [B, K, V] (the distribution "
                      "each draft was sampled from) and verify_BxR takes draft_probs and "
                      "draft_lane [B] after the sampling arrays, accepting the drafts of lanes "
                      "at temperature > 0 with probability min(1, p/q) on the device "
                      "(targets/xla/rejection.py); v5 files are refused (rebuild them), since "
                      "the programs' signatures changed"),
    ("2026-11-24", 6, "an xla.precompiled record's cost may carry traffic: the decode program's "
                      "bytes read and written a step from its optimized HLO, by class "
                      "(weights, embeddings, kv, io, temps, activations) and for the top "
                      "instructions, loops scaled by trip count (issue 19; "
                      "targets/xla/hlo_traffic.py, `rvcompile inspect --cost`); absent: built "
                      "before it. Earlier readers ignore it"),
    ("2026-11-24", 7, "h100 artifacts may be tensor parallel (rvcompile build --tp N, issue 20): "
                      "manifest h100.tensor_parallel {ranks, schedules of ranks 1..N-1, each "
                      "rank's weights and constants offsets}, the ranks' regions one after "
                      "another in sections weights and constants, and collective steps in the "
                      "ranks' schedules (kernel schedule version 5); header arena_bytes is the "
                      "largest rank's. One-GPU h100 artifacts are as in v6; v6 files are "
                      "refused (rebuild them), one way to read as before"),
    ("2026-11-25", 7, "h100 kernel schedules may carry draft_tokens K and verify_{R} entry "
                      "points (rvcompile build --num-draft-tokens K on an h100 target: "
                      "speculative decoding with n-gram drafts, issue 15), as kernel schedule "
                      "version 6; absent: no verify entries, and the schedule's version as "
                      "before. Readers before this entry refuse such files (a schedule version "
                      "outside their range), never misread them"),
    ("2026-11-25", 7, "h100 KV pools sized at load (issue 14, kernel schedule versions 7, 8 "
                      "and 9): header arena_bytes is the arena's fixed part (weights, constants, "
                      "io, activations); the pools follow it with the block counts the runtime "
                      "picks (rvrun serve --gpu-memory-utilization, --kv-blocks). Readers of "
                      "schedule versions up to 6 refuse such files by the schedule's version"),
    ("2026-11-25", 7, "one-GPU h100 kernel schedules (version 7) also carry the sampler's extras "
                      "(sampled_decode_{B} / sampled_prefill_{T}, the sample_io region) and, in "
                      "every decode entry, decode_advance over io fields loop_budget, loop_step "
                      "and loop_tokens (the device side of the decode loop); the container's "
                      "format is unchanged, readers before this entry refuse schedule version 7"),
    ("2026-11-29", 7, "h100 artifacts are hashed in pieces of 1 MiB (piece_size; "
                      "artifacts/piece_hash.py DEVICE_PIECE_SIZE) and carry the piece hash: a "
                      "sha256 kernel in their cubins, named by manifest h100.piece_hash, with "
                      "which the runtime checks the uploaded weights on the GPU (issue 18); "
                      "other targets keep PIECE_SIZE. Earlier readers ignore the field and hash "
                      "the small pieces on the CPU"),
    ("2026-11-29", 7, "an XLA int8 KV pool's scale pool (key \".scale\") may have block_shape "
                      "[1, S]: a block's scales as one row of S lanes, each device's heads' 16 "
                      "scales head-major in its own lanes (targets/xla/lower.scale_block_shape; "
                      "2 or more heads a device); [16, K] otherwise, as before. Readers before "
                      "this entry refuse such files (a block shape not starting with the block "
                      "size), never misread them"),
)
# xla.precompiled[topology]["encoding"] of sets a runtime may load (see the v3 changelog entry).
EXECUTABLES_ENCODING = "pjrt-1"

# The 0x89 byte and the CR LF / ^Z tail (the PNG trick) catch files mangled by text-mode copies
# and keep the file from being mistaken for text.
MAGIC = b"\x89RVP\r\n\x1a\n"
HEADER_SIZE = 4096
ALIGN = 4096
_PREFIX = struct.Struct("<8sII32s")  # magic, format version, header JSON length, its sha256
MAX_HEADER_JSON = HEADER_SIZE - _PREFIX.size
# Big enough that per-piece overhead (a task, a 32-byte digest) is nothing, small enough that a
# 30 GiB section splits into ~120 pieces to spread over any number of cores. The writer's
# default; h100 artifacts use 1 MiB pieces, one GPU thread each (artifacts/piece_hash.py).
PIECE_SIZE = 256 << 20
DIGEST_SIZE = 32  # bytes of one sha256
MAX_SIZE = 1 << 50  # of a section or the file: anything larger is damage, not a model


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
class Blob:
    """A small region the header locates and checksums whole: the manifest or the digest table."""

    offset: int  # absolute, a multiple of ALIGN
    size: int  # bytes
    sha256: str  # hex digest of the bytes


@dataclass(frozen=True)
class SectionSpan:
    """A section as the header table places it."""

    name: str
    offset: int  # absolute byte offset in the file, a multiple of ALIGN
    size: int  # bytes


@dataclass(frozen=True)
class HeaderBlock:
    """Everything the first HEADER_SIZE bytes of a file say."""

    header: ArtifactHeader
    sections: tuple[SectionSpan, ...]  # in file order
    piece_size: int
    piece_digests: Blob
    manifest: Blob

    def __post_init__(self) -> None:
        object.__setattr__(self, "sections", tuple(self.sections))


@dataclass(frozen=True)
class SectionInfo:
    """A section with the recorded sha256 of each of its pieces."""

    name: str
    offset: int  # absolute byte offset in the file, a multiple of ALIGN
    size: int  # bytes
    piece_size: int  # bytes per piece; the last piece may be shorter
    piece_sha256: tuple[bytes, ...]  # the 32-byte sha256 of each piece, in order

    @property
    def digest(self) -> str:
        """Hex sha256 of the piece digests in order: changes whenever any byte does, so it
        names the content (cache keys, `inspect`); it is not the sha256 of the section bytes."""
        return hashlib.sha256(b"".join(self.piece_sha256)).hexdigest()


def piece_count(size: int, piece_size: int) -> int:
    return -(-size // piece_size)


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def canonical_json(obj: Any) -> bytes:
    """One byte string per value: sorted keys, no whitespace, ASCII, no NaN."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def encode_header_block(block: HeaderBlock, fname: str) -> bytes:
    """The full HEADER_SIZE block."""
    doc = {
        "compiler_version": block.header.compiler_version,
        "target": block.header.target,
        "platforms": list(block.header.platforms),
        "requirements": block.header.requirements,
        "manifest": _blob_json(block.manifest),
        "sections": [{"name": s.name, "offset": s.offset, "size": s.size} for s in block.sections],
        "piece_size": block.piece_size,
        "piece_digests": _blob_json(block.piece_digests),
    }
    try:
        body = canonical_json(doc)
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"{fname}: header is not JSON-serializable: {e}") from e
    if len(body) > MAX_HEADER_JSON:
        raise ArtifactError(
            f"{fname}: header JSON is {len(body)} bytes, over the {MAX_HEADER_JSON} that fit in "
            f"the {HEADER_SIZE}-byte header block ({len(block.sections)} sections); "
            "use fewer, larger sections"
        )
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(body), hashlib.sha256(body).digest())
    return (prefix + body).ljust(HEADER_SIZE, b"\0")


def decode_header_block(block: bytes, fname: str) -> HeaderBlock:
    """Checks magic, then version, then the header checksum, then the layout it describes."""
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
            f"(formats {supported}); rebuild the artifact with this rvcompile"
        )
    body = block[_PREFIX.size : _PREFIX.size + length]
    if length > MAX_HEADER_JSON or hashlib.sha256(body).digest() != digest:
        raise ArtifactError(f"{fname}: header block is corrupt (checksum mismatch)")
    if block[_PREFIX.size + length :].count(0) != HEADER_SIZE - _PREFIX.size - length:
        raise ArtifactError(f"{fname}: header block is corrupt (its padding is not zeros)")
    try:
        doc = json.loads(body)
        header = ArtifactHeader(
            compiler_version=_word(doc["compiler_version"]),
            target=_word(doc["target"]),
            platforms=tuple(_word(p) for p in _typed(doc["platforms"], list)),
            requirements=_typed(doc["requirements"], dict),
            source=fname,
        )
        sections = tuple(
            SectionSpan(_word(d["name"]), _typed(d["offset"], int), _typed(d["size"], int))
            for d in _typed(doc["sections"], list)
        )
        decoded = HeaderBlock(
            header=header,
            sections=sections,
            piece_size=_typed(doc["piece_size"], int),
            piece_digests=_blob(doc["piece_digests"]),
            manifest=_blob(doc["manifest"]),
        )
    except (ValueError, TypeError, KeyError) as e:
        raise ArtifactError(f"{fname}: header JSON is malformed ({type(e).__name__}: {e})") from e
    except RecursionError:
        raise ArtifactError(f"{fname}: header JSON is malformed (nested too deeply)") from None
    _check_layout(decoded, fname)
    return decoded


def split_piece_digests(block: HeaderBlock, table: bytes) -> tuple[SectionInfo, ...]:
    """The sections with their piece digests, cut from the table `block.piece_digests` locates
    (whose size `decode_header_block` has checked against the section sizes)."""
    sections = []
    start = 0
    for s in block.sections:
        end = start + DIGEST_SIZE * piece_count(s.size, block.piece_size)
        digests = tuple(table[i : i + DIGEST_SIZE] for i in range(start, end, DIGEST_SIZE))
        sections.append(SectionInfo(s.name, s.offset, s.size, block.piece_size, digests))
        start = end
    return tuple(sections)


def _blob_json(blob: Blob) -> dict[str, Any]:
    return {"offset": blob.offset, "length": blob.size, "sha256": blob.sha256}


def _blob(d: Any) -> Blob:
    d = _typed(d, dict)
    return Blob(_typed(d["offset"], int), _typed(d["length"], int), _typed(d["sha256"], str))


def _typed(value: Any, kind: type) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"expected {kind.__name__}, got {value!r}")
    return value


def _word(value: Any) -> str:
    """A header string: printable and short, since errors quote them."""
    if not isinstance(value, str) or not value.isprintable() or not 0 < len(value) <= 200:
        raise ValueError(f"expected a printable string of 1 to 200 characters, got {value!r:.60}")
    return value


def _check_layout(block: HeaderBlock, fname: str) -> None:
    """Sections aligned, in file order, non-overlapping, uniquely named, of at most MAX_SIZE
    bytes; then the digest table, sized for every piece; then the manifest. (That each region
    starts at the first multiple of ALIGN after the previous one, with zeros between, the
    reader checks on the file.)"""
    sections = block.sections
    if len({s.name for s in sections}) != len(sections):
        raise ArtifactError(f"{fname}: header names a section twice")
    if not 0 < block.piece_size <= MAX_SIZE:
        raise ArtifactError(f"{fname}: header has a bad piece_size {block.piece_size}")
    end = HEADER_SIZE
    for s in [*sections, block.piece_digests, block.manifest]:
        if s.offset % ALIGN or s.offset < end or not 0 <= s.size <= MAX_SIZE:
            raise ArtifactError(f"{fname}: header has a bad section table entry {s}")
        end = s.offset + s.size
    pieces = sum(piece_count(s.size, block.piece_size) for s in sections)
    if block.piece_digests.size != DIGEST_SIZE * pieces:
        raise ArtifactError(
            f"{fname}: header is inconsistent: the piece-digest table is "
            f"{block.piece_digests.size} bytes but {pieces} pieces need {DIGEST_SIZE * pieces}"
        )
