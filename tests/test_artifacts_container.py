"""The .rvp container: round trip, determinism, and every refusal a loader or writer makes."""

from __future__ import annotations

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
from rvcompile.artifacts.format import ALIGN, HEADER_SIZE, MIN_READABLE_FORMAT

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
