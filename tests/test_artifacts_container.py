"""The .rvp container: round trip, determinism, and every refusal a loader or writer makes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from rvcompile.artifacts import (
    FORMAT_VERSION,
    Artifact,
    ArtifactError,
    ArtifactHeader,
    ArtifactWriter,
    check_platform,
)
from rvcompile.artifacts.format import (
    ALIGN,
    DIGEST_SIZE,
    HEADER_SIZE,
    MIN_READABLE_FORMAT,
    align_up,
    decode_header_block,
    encode_header_block,
)

HEADER = ArtifactHeader(
    compiler_version="0.1.0",
    target="xla",
    platforms=("tpu", "cuda"),
    requirements={"min_devices": 1, "jax": ">=0.10"},
)
WEIGHTS = np.arange(6 * 8, dtype=np.float32).reshape(6, 8).astype(ml_dtypes.bfloat16)
MANIFEST = {"model": "tiny", "tensors": {"w": {"offset": 0, "shape": [6, 8], "dtype": "bfloat16"}}}


def build(path: Path, piece_order: tuple[int, ...] = (2, 0, 1), manifest: dict = MANIFEST) -> Path:
    """tiny.rvp: a small `program` section, WEIGHTS written in 3 pieces in `piece_order`."""
    rows = [WEIGHTS[0:2], WEIGHTS[2:5], WEIGHTS[5:6]]
    row_bytes = WEIGHTS[0].nbytes
    starts = [0, 2 * row_bytes, 5 * row_bytes]
    with ArtifactWriter(path, HEADER) as w:
        w.add("program", b"stablehlo bytes")
        w.reserve("weights", WEIGHTS.nbytes)
        for i in piece_order:
            w.write("weights", starts[i], rows[i])
        w.add("tokenizer", memoryview(b'{"vocab": {}}'))
        w.commit(manifest)
    return path


def patched(path: Path, offset: int, new: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + len(new)] = new
    path.write_bytes(bytes(data))


def test_round_trip(tmp_path: Path) -> None:
    path = build(tmp_path / "tiny.rvp")
    with Artifact.open(path) as art:
        assert art.header == HEADER
        assert art.manifest == MANIFEST
        assert list(art.sections) == ["program", "weights", "tokenizer"]
        assert all(s.offset % ALIGN == 0 for s in art.sections.values())
        assert bytes(art.buffer("program")) == b"stablehlo bytes"
        assert bytes(art.buffer("tokenizer")) == b'{"vocab": {}}'
        w = art.array("weights", 0, (6, 8), ml_dtypes.bfloat16)
        np.testing.assert_array_equal(w, WEIGHTS)
        tail = art.array("weights", 5 * WEIGHTS[0].nbytes, (8,), "bfloat16")
        np.testing.assert_array_equal(tail, WEIGHTS[5])
        art.verify()


def test_rebuild_is_byte_identical(tmp_path: Path) -> None:
    first = build(tmp_path / "a.rvp", (2, 0, 1)).read_bytes()
    reordered = dict(reversed(list(MANIFEST.items())))
    second = build(tmp_path / "b.rvp", (0, 1, 2), manifest=reordered).read_bytes()
    assert first == second
    assert first[:8] == b"\x89RVP\r\n\x1a\n"


def test_verify_names_the_corrupt_section(tmp_path: Path) -> None:
    path = build(tmp_path / "tiny.rvp")
    with Artifact.open(path) as art:
        art.verify()
        offset = art.sections["weights"].offset + 7
    patched(path, offset, bytes([path.read_bytes()[offset] ^ 0xFF]))
    with Artifact.open(path) as art:  # open does not hash sections, only verify does
        art.verify(["program", "tokenizer"])
        with pytest.raises(ArtifactError, match=r"^tiny\.rvp: section 'weights' is corrupt"):
            art.verify()


def test_truncated_file_names_the_section(tmp_path: Path) -> None:
    path = build(tmp_path / "tiny.rvp")
    with Artifact.open(path) as art:
        weights = art.sections["weights"]
    cut = weights.offset + 10
    path.write_bytes(path.read_bytes()[:cut])
    end = weights.offset + weights.size
    with pytest.raises(ArtifactError) as e:
        Artifact.open(path)
    assert str(e.value) == (
        f"tiny.rvp: truncated: section 'weights' ends at byte {end} but the file is {cut} bytes"
    )


def test_bad_magic(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}" + bytes(5000))
    with pytest.raises(ArtifactError, match=r"^model\.safetensors: not an rvcompile artifact"):
        Artifact.open(path)
    short = tmp_path / "empty.rvp"
    short.write_bytes(b"")
    with pytest.raises(ArtifactError, match=r"^empty\.rvp: not an rvcompile artifact"):
        Artifact.open(short)


@pytest.mark.parametrize(
    ("version", "words"),
    [
        (FORMAT_VERSION + 1, "newer than this rvcompile reads"),
        (MIN_READABLE_FORMAT - 1, "older than this rvcompile reads"),
    ],
)
def test_unsupported_format_version(tmp_path: Path, version: int, words: str) -> None:
    path = build(tmp_path / "tiny.rvp")
    patched(path, 8, struct.pack("<I", version))
    with pytest.raises(ArtifactError) as e:
        Artifact.open(path)
    msg = str(e.value)
    assert msg.startswith(f"tiny.rvp: artifact format version {version} is {words}")
    assert f"formats {MIN_READABLE_FORMAT}..{FORMAT_VERSION}" in msg
    if version > FORMAT_VERSION:
        assert msg.endswith("upgrade rvcompile")


def test_corrupt_header_and_manifest_refused(tmp_path: Path) -> None:
    path = build(tmp_path / "tiny.rvp")
    good = path.read_bytes()
    patched(path, 60, bytes([good[60] ^ 1]))
    with pytest.raises(ArtifactError, match=r"^tiny\.rvp: header block is corrupt"):
        Artifact.open(path)
    path.write_bytes(good[:-2] + b"0}")
    with pytest.raises(ArtifactError, match=r"^tiny\.rvp: manifest is corrupt"):
        Artifact.open(path)
    path.write_bytes(good + b"\0")
    with pytest.raises(ArtifactError, match=r"^tiny\.rvp: 1 unexpected bytes after the manifest"):
        Artifact.open(path)


def test_missing_platform_refused(tmp_path: Path) -> None:
    with Artifact.open(build(tmp_path / "tiny.rvp")) as art:
        check_platform(art.header, "cuda")
        with pytest.raises(ArtifactError) as e:
            check_platform(art.header, "cpu")
    assert str(e.value) == "tiny.rvp: built for platforms tpu, cuda; this machine's platform is cpu"


def test_exception_or_no_commit_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "tiny.rvp"
    with pytest.raises(RuntimeError), ArtifactWriter(path, HEADER) as w:
        w.add("program", b"x" * 100)
        raise RuntimeError("compile failed")
    with ArtifactWriter(path, HEADER) as w:
        w.add("program", b"x")
    assert list(tmp_path.iterdir()) == []

    path.write_bytes(b"previous build")
    with pytest.raises(ArtifactError), ArtifactWriter(path, HEADER) as w:
        w.reserve("weights", 10)
        w.commit({})  # gap: nothing written
    assert list(tmp_path.iterdir()) == [path]
    assert path.read_bytes() == b"previous build"


def test_write_outside_reservation_raises(tmp_path: Path) -> None:
    with ArtifactWriter(tmp_path / "tiny.rvp", HEADER) as w:
        w.reserve("weights", 16)
        with pytest.raises(ArtifactError, match=r"^tiny\.rvp: write of bytes \[10, 18\) falls"):
            w.write("weights", 10, b"12345678")
        with pytest.raises(ArtifactError, match="outside section"):
            w.write("weights", -1, b"1")
        with pytest.raises(ArtifactError, match="never reserved"):
            w.write("bias", 0, b"1")
        w.write("weights", 0, b"12345678")
        with pytest.raises(ArtifactError, match=r"bytes \[4, 12\) overlap an earlier write"):
            w.write("weights", 4, b"12345678")
        with pytest.raises(ArtifactError, match="not C-contiguous"):
            w.write("weights", 8, np.zeros((2, 4), np.uint8).T)


def test_commit_with_gap_raises(tmp_path: Path) -> None:
    with ArtifactWriter(tmp_path / "tiny.rvp", HEADER) as w:
        w.reserve("weights", 30)
        w.write("weights", 0, b"a" * 10)
        w.write("weights", 20, b"c" * 10)
        with pytest.raises(ArtifactError) as e:
            w.commit({})
    assert str(e.value) == "tiny.rvp: section 'weights' has unwritten bytes [10, 20) of 30"


def test_header_overflow_refused_at_reserve(tmp_path: Path) -> None:
    with ArtifactWriter(tmp_path / "tiny.rvp", HEADER) as w:
        with pytest.raises(ArtifactError, match="use fewer, larger sections"):
            for i in range(1000):
                w.reserve(f"section_{i}", 1)
        w.write("section_0", 0, b"x")  # the table that fit is still usable


def test_arrays_are_read_only_and_zero_copy(tmp_path: Path) -> None:
    art = Artifact.open(build(tmp_path / "tiny.rvp"))
    w = art.array("weights", 0, (6, 8), ml_dtypes.bfloat16)
    raw = art.buffer("weights")
    assert raw.readonly
    assert not w.flags.writeable and not w.flags.owndata
    assert np.shares_memory(w, np.frombuffer(raw, np.uint8))
    with pytest.raises(ValueError):
        w[0, 0] = 1
    with pytest.raises(ValueError):
        w.setflags(write=True)
    with pytest.raises(ArtifactError, match="fall outside section 'weights'"):
        art.array("weights", 2, (6, 8), ml_dtypes.bfloat16)
    art.close()  # views still alive keep the mapping valid
    np.testing.assert_array_equal(w, WEIGHTS)
    with pytest.raises(ArtifactError, match="closed"):
        art.buffer("weights")


def test_layout_starts_sections_after_header(tmp_path: Path) -> None:
    with Artifact.open(build(tmp_path / "tiny.rvp")) as art:
        offsets = [s.offset for s in art.sections.values()]
    assert offsets == [HEADER_SIZE, 2 * ALIGN, 3 * ALIGN]


# ---------------------------------------------------------------------------------------------
# Pieces: each section is hashed in pieces of `piece_size` bytes, in parallel

PIECE = 64  # bytes per piece in these tests


def build_pieces(path: Path, sizes: dict[str, int], threads: int | None = None) -> Path:
    """Sections of the given sizes filled with distinct bytes, hashed in PIECE-byte pieces."""
    rng = np.random.default_rng(0)
    with ArtifactWriter(path, HEADER, piece_size=PIECE, threads=threads) as w:
        for name, size in sizes.items():
            w.add(name, rng.integers(0, 256, size, dtype=np.uint8))
        w.commit(MANIFEST)
    return path


def flip(path: Path, at: int) -> None:
    patched(path, at, bytes([path.read_bytes()[at] ^ 0x01]))


@pytest.mark.parametrize(
    ("at", "piece", "span"),
    [(0, 0, "[0, 64)"), (5 * PIECE + 9, 5, "[320, 384)"), (10 * PIECE + 16, 10, "[640, 657)")],
    ids=["first", "middle", "last-short"],
)
@pytest.mark.parametrize("threads", [1, 3])
def test_corrupt_piece_is_named(tmp_path: Path, at: int, piece: int, span: str,
                                threads: int) -> None:
    path = build_pieces(tmp_path / "p.rvp", {"program": 10, "weights": 10 * PIECE + 17})
    with Artifact.open(path) as art:
        weights = art.sections["weights"]
        assert len(weights.piece_sha256) == 11
        art.verify(threads=threads)
    flip(path, weights.offset + at)
    with Artifact.open(path) as art:
        art.verify(["program"], threads=threads)
        with pytest.raises(ArtifactError) as e:
            art.verify(threads=threads)
    msg = str(e.value)
    assert msg.startswith(
        f"p.rvp: section 'weights' is corrupt: piece {piece} of 11 (bytes {span}) has sha256 "
    )
    assert "\n" not in msg


@pytest.mark.parametrize(("at", "piece"), [(2 * PIECE - 1, 1), (2 * PIECE, 2), (4 * PIECE - 1, 3)])
def test_piece_boundaries_at_exact_multiples(tmp_path: Path, at: int, piece: int) -> None:
    sizes = {"empty": 0, "one": PIECE, "one_more": PIECE + 1, "weights": 4 * PIECE}
    path = build_pieces(tmp_path / "p.rvp", sizes)
    data = path.read_bytes()
    with Artifact.open(path) as art:
        counts = {n: len(s.piece_sha256) for n, s in art.sections.items()}
        assert counts == {"empty": 0, "one": 1, "one_more": 2, "weights": 4}
        for s in art.sections.values():
            body = data[s.offset : s.offset + s.size]
            want = [hashlib.sha256(body[i : i + PIECE]).digest() for i in range(0, s.size, PIECE)]
            assert list(s.piece_sha256) == want, s.name
            assert s.digest == hashlib.sha256(b"".join(want)).hexdigest()
        weights = art.sections["weights"]
    flip(path, weights.offset + at)
    with Artifact.open(path) as art, pytest.raises(ArtifactError) as e:
        art.verify()
    start = piece * PIECE
    assert f"piece {piece} of 4 (bytes [{start}, {start + PIECE}))" in str(e.value)


def test_many_small_pieces_hash_in_batches(tmp_path: Path, monkeypatch) -> None:
    """30K pieces (an h100 artifact's 1 MiB pieces of a 31B model): commit and verify hash
    them in batches of consecutive pieces, a few tasks rather than one a piece, and a corrupt
    piece is still named alone."""
    from rvcompile.artifacts import container

    monkeypatch.setattr(container, "_BATCH_BYTES", 1000 * PIECE)
    tasks = []
    real = container._sha256_batch

    def batch(fd, pieces, fname):
        tasks.append(len(pieces))
        return real(fd, pieces, fname)

    monkeypatch.setattr(container, "_sha256_batch", batch)
    path = build_pieces(tmp_path / "p.rvp", {"weights": 30_000 * PIECE - 5}, threads=2)
    assert tasks == [1000] * 30
    with Artifact.open(path) as art:
        assert len(art.sections["weights"].piece_sha256) == 30_000
        art.verify(threads=2)
        at = art.sections["weights"].offset + 12_345 * PIECE + 7
    flip(path, at)
    with Artifact.open(path) as art, pytest.raises(ArtifactError) as e:
        art.verify(threads=2)
    assert "piece 12345 of 30000 (bytes [790080, 790144))" in str(e.value)


def test_first_corrupt_piece_in_order_is_reported(tmp_path: Path) -> None:
    path = build_pieces(tmp_path / "p.rvp", {"a": 3 * PIECE, "b": 50 * PIECE})
    with Artifact.open(path) as art:
        a, b = art.sections["a"], art.sections["b"]
    for at in (b.offset + 40 * PIECE, b.offset + 7 * PIECE, a.offset + 2 * PIECE + 1):
        flip(path, at)
    with Artifact.open(path) as art:
        for threads in (1, 2, 8):
            with pytest.raises(ArtifactError, match=r"section 'a' is corrupt: piece 2 of 3 "):
                art.verify(threads=threads)
        with pytest.raises(ArtifactError, match=r"section 'b' is corrupt: piece 7 of 50 "):
            art.verify(["b"], threads=4)


def test_thread_count_does_not_change_bytes(tmp_path: Path) -> None:
    sizes = {"program": 5, "weights": 20 * PIECE + 3}
    one = build_pieces(tmp_path / "one.rvp", sizes, threads=1).read_bytes()
    many = build_pieces(tmp_path / "many.rvp", sizes, threads=8).read_bytes()
    assert one == many


def test_truncated_after_open_fails_verify(tmp_path: Path) -> None:
    path = build_pieces(tmp_path / "p.rvp", {"weights": 10 * PIECE})
    with Artifact.open(path) as art:
        cut = art.sections["weights"].offset + 3 * PIECE + 5
        os.truncate(path, cut)
        with pytest.raises(ArtifactError) as e:
            art.verify(threads=2)
    assert str(e.value) == "p.rvp: section 'weights' piece 3: file ended while hashing it"
    with pytest.raises(ArtifactError, match=r"^p\.rvp: truncated: section 'weights' ends at"):
        Artifact.open(path)


def test_truncated_digest_table_refused(tmp_path: Path) -> None:
    path = build_pieces(tmp_path / "p.rvp", {"weights": 10 * PIECE})
    with Artifact.open(path) as art:
        weights = art.sections["weights"]
    table_at = align_up(weights.offset + weights.size)
    path.write_bytes(path.read_bytes()[: table_at + 100])
    with pytest.raises(ArtifactError) as e:
        Artifact.open(path)
    assert str(e.value) == (
        f"p.rvp: truncated: piece-digest table ends at byte {table_at + 320} but the file is "
        f"{table_at + 100} bytes"
    )


def test_corrupt_digest_table_refused(tmp_path: Path) -> None:
    path = build_pieces(tmp_path / "p.rvp", {"weights": 10 * PIECE})
    with Artifact.open(path) as art:
        weights = art.sections["weights"]
    flip(path, align_up(weights.offset + weights.size) + 33)
    with pytest.raises(ArtifactError, match=r"^p\.rvp: piece-digest table is corrupt"):
        Artifact.open(path)


def test_digest_table_size_must_match_pieces(tmp_path: Path) -> None:
    path = build_pieces(tmp_path / "p.rvp", {"weights": 10 * PIECE})
    data = bytearray(path.read_bytes())
    block = decode_header_block(bytes(data[:HEADER_SIZE]), "p.rvp")
    table = dataclasses.replace(block.piece_digests, size=9 * DIGEST_SIZE)
    data[:HEADER_SIZE] = encode_header_block(dataclasses.replace(block, piece_digests=table), "p")
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"^p\.rvp: header is inconsistent: the piece-digest "
                                            r"table is 288 bytes but 10 pieces need 320$"):
        Artifact.open(path)


def test_version_1_artifact_refused_with_rebuild(tmp_path: Path) -> None:
    """A file as format v1 wrote it (whole-section sha256, no piece digests) is refused, not
    verified serially."""
    body = json.dumps({
        "compiler_version": "0.1.0", "target": "xla", "platforms": ["cpu"], "requirements": {},
        "manifest": {"offset": 8192, "length": 2, "sha256": hashlib.sha256(b"{}").hexdigest()},
        "sections": [{"name": "weights", "offset": 4096, "size": 4,
                      "sha256": hashlib.sha256(b"\0" * 4).hexdigest()}],
    }).encode()
    prefix = struct.pack("<8sII32s", b"\x89RVP\r\n\x1a\n", 1, len(body),
                         hashlib.sha256(body).digest())
    path = tmp_path / "old.rvp"
    path.write_bytes((prefix + body).ljust(8192, b"\0") + b"{}")
    with pytest.raises(ArtifactError) as e:
        Artifact.open(path)
    assert str(e.value) == (
        f"old.rvp: artifact format version 1 is older than this rvcompile reads (formats "
        f"{MIN_READABLE_FORMAT}..{FORMAT_VERSION}); rebuild the artifact with this rvcompile"
    )


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"piece_size": 0}, "piece_size must be at least 1, not 0"),
    ({"piece_size": 1.5}, "piece_size must be an integer"),
    ({"threads": 0}, "threads must be at least 1, not 0"),
])
def test_writer_refuses_bad_hashing_options(tmp_path: Path, kwargs: dict, words: str) -> None:
    with pytest.raises(ArtifactError, match=rf"^tiny\.rvp: {words}"):
        ArtifactWriter(tmp_path / "tiny.rvp", HEADER, **kwargs)


def test_verify_refuses_bad_thread_count(tmp_path: Path) -> None:
    with Artifact.open(build(tmp_path / "tiny.rvp")) as art:
        with pytest.raises(ArtifactError, match=r"^tiny\.rvp: verify threads must be at least 1"):
            art.verify(threads=0)
