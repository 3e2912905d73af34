"""Writing and reading .rvp files (layout in `format.py`).

`ArtifactWriter` builds a file in a temp file beside `path` and renames it into place only on
`commit`, so `path` holds either the old file or a complete new one, never a partial one.
Sections are planned with `reserve` and filled with `write` in pieces, in any order, without
holding a section in memory; `commit` refuses gaps and overlaps, hashes what is on disk, and the
same inputs always give the same bytes (for the same piece size).

`Artifact.open` refuses anything but a regular file (a FIFO would block it), then checks the
header block (magic, format version, checksum, zero padding), then the file size against the
section table, then the shape of the signature page if there is one (and, given trusted keys,
the signatures: see `signature.py`), then that the padding between regions is zero, then the
sha256 of the piece-digest table and of the manifest, which must parse as a JSON object;
sections are served zero-copy from a read-only mmap. Section bytes are only hashed on `verify`,
since that reads the whole file. What a model artifact's manifest and sections mean is checked
by manifest.py and contents.py.

`commit` and `verify` hash the pieces of every section (see `format.py`) on a thread pool, one
thread per core by default: hashlib and os.preadv release the GIL, so a 30 GB file hashes at
many times the ~1 GB/s of one sha256 stream. A task hashes a batch of consecutive pieces of up to
_BATCH_BYTES (at least one piece), so small pieces (an h100 artifact's 1 MiB: ~30K for a 31B
model) cost a few hundred tasks, not one each.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import math
import mmap
import operator
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rvcompile.artifacts.format import (
    ALIGN,
    HEADER_SIZE,
    PIECE_SIZE,
    ArtifactError,
    ArtifactHeader,
    Blob,
    HeaderBlock,
    SectionInfo,
    SectionSpan,
    align_up,
    canonical_json,
    decode_header_block,
    encode_header_block,
    piece_count,
    split_piece_digests,
)
from rvcompile.artifacts.schema import SchemaError, parse_json
from rvcompile.artifacts.signature import (
    Signable,
    Signature,
    TrustedKey,
    decode_page,
    require_trusted,
)

_CHUNK = 8 << 20  # bytes per read when hashing: large enough to stream, small enough to not matter
# Bytes of pieces one hashing task takes: a task (a future, its result) costs ~15 us, nothing
# beside 30 ms of hashing; 32 MiB tasks still spread a few GB over any number of cores.
_BATCH_BYTES = 32 << 20
_thread_buffers = threading.local()  # each hashing thread reads into its own _CHUNK buffer


@contextmanager
def _os_errors(what: str) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        raise ArtifactError(f"{what}: {e.strerror or e}") from e


@dataclass(frozen=True)
class _Piece:
    section: str
    index: int  # of the piece within its section
    count: int  # pieces in the section
    start: int  # relative to the section
    size: int
    offset: int  # absolute


def _cut(name: str, offset: int, size: int, piece_size: int) -> list[_Piece]:
    count = piece_count(size, piece_size)
    return [
        _Piece(name, i, count, i * piece_size, min(piece_size, size - i * piece_size),
               offset + i * piece_size)
        for i in range(count)
    ]


def section_pieces(section: SectionInfo) -> list[_Piece]:
    """The hashed pieces of `section`, in order (what its piece digests cover)."""
    return _cut(section.name, section.offset, section.size, section.piece_size)


def corrupt_piece_error(fname: str, piece: _Piece, got: bytes, want: bytes) -> ArtifactError:
    """The one-line error of a piece whose sha256 is not the recorded one."""
    return ArtifactError(
        f"{fname}: section '{piece.section}' is corrupt: piece {piece.index} of {piece.count} "
        f"(bytes [{piece.start}, {piece.start + piece.size})) has sha256 {got.hex()}, "
        f"recorded {want.hex()}"
    )


def _sha256_piece(fd: int, piece: _Piece, fname: str) -> bytes:
    buf = getattr(_thread_buffers, "buf", None)
    if buf is None:
        buf = _thread_buffers.buf = memoryview(bytearray(_CHUNK))
    h = hashlib.sha256()
    offset, size = piece.offset, piece.size
    what = f"{fname}: section '{piece.section}' piece {piece.index}"
    while size:
        with _os_errors(f"{what}: cannot read"):
            n = os.preadv(fd, [buf[: min(size, _CHUNK)]], offset)
        if n == 0:
            raise ArtifactError(f"{what}: file ended while hashing it")
        h.update(buf[:n])
        offset += n
        size -= n
    return h.digest()


def _sha256_batch(fd: int, batch: Sequence[_Piece], fname: str) -> list[bytes]:
    return [_sha256_piece(fd, p, fname) for p in batch]


def piece_runs(pieces: Sequence[_Piece], max_bytes: int) -> list[list[_Piece]]:
    """`pieces` in order, cut into runs of consecutive pieces of at most `max_bytes` together
    (a larger piece alone)."""
    out: list[list[_Piece]] = []
    size = 0
    for p in pieces:
        if not out or size + p.size > max_bytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.size
    return out


def _cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _check_threads(threads: int | None, what: str) -> int | None:
    if threads is not None and (_index(threads, what) < 1):
        raise ArtifactError(f"{what} must be at least 1, not {threads}")
    return threads


@contextmanager
def _hashing(
    fd: int, pieces: Sequence[_Piece], threads: int | None, fname: str
) -> Iterator[Iterator[bytes]]:
    """Starts hashing `pieces` on `threads` threads (default: one per core), in batches of
    _BATCH_BYTES (piece_runs); yields an iterator of the 32-byte sha256 of each piece, in
    order, each waited for as it is taken. Leaving the block early (say, on the first
    mismatch) cancels the batches not started and waits only for the running ones."""
    batches = piece_runs(pieces, _BATCH_BYTES)
    workers = max(1, min(threads or _cores(), len(batches)))
    with ThreadPoolExecutor(workers, thread_name_prefix="rvp-sha256") as pool:
        futures: list[Future[list[bytes]]] = [
            pool.submit(_sha256_batch, fd, b, fname) for b in batches]
        try:
            yield (digest for f in futures for digest in f.result())
        finally:
            for f in futures:
                f.cancel()


def _as_bytes(data: Any) -> memoryview:
    """A flat byte view of `data` without copying; TypeError/ValueError if that is impossible."""
    if isinstance(data, np.ndarray):
        # memoryview() rejects ml_dtypes arrays (bfloat16 ...), so view them as bytes via numpy;
        # reshape would silently copy a non-contiguous array, hence the check first.
        if not data.flags.c_contiguous:
            raise ValueError("numpy array is not C-contiguous")
        return memoryview(data.reshape(-1).view(np.uint8))
    return memoryview(data).cast("B")


def _index(value: Any, what: str) -> int:
    """`value` as an int; numpy integers (from shape arithmetic) count, floats do not."""
    try:
        return operator.index(value)
    except TypeError as e:
        raise ArtifactError(f"{what} must be an integer, not {value!r}") from e


@dataclass
class _Reservation:
    offset: int  # absolute
    size: int
    # Written [start, end) ranges relative to the section: sorted, disjoint, touching ones merged.
    written: list[tuple[int, int]] = field(default_factory=list)

    def mark(self, start: int, end: int) -> None:
        """Records a write; ValueError if it overlaps an earlier one."""
        spans = self.written
        i = bisect.bisect_left(spans, (start, start))
        if (i > 0 and spans[i - 1][1] > start) or (i < len(spans) and spans[i][0] < end):
            raise ValueError(f"bytes [{start}, {end}) overlap an earlier write")
        if i > 0 and spans[i - 1][1] == start:
            i -= 1
            start = spans.pop(i)[0]
        if i < len(spans) and spans[i][0] == end:
            end = spans.pop(i)[1]
        spans.insert(i, (start, end))

    def first_gap(self) -> tuple[int, int] | None:
        done = 0
        for start, end in [*self.written, (self.size, self.size)]:
            if start > done:
                return done, start
            done = end
        return None


class ArtifactWriter:
    """Builds one .rvp at `path`; use as `with ArtifactWriter(path, header) as w: ... w.commit(m)`.

    Leaving the `with` block without a successful `commit` (an exception, or no commit at all)
    removes the temp file and leaves `path` as it was. After `commit` the file is in place.
    `piece_size` is the bytes per hashed piece (the default suits files of any size; tests use
    small ones); `threads` hashes that many pieces at once on commit (default: one per core).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        header: ArtifactHeader,
        *,
        piece_size: int = PIECE_SIZE,
        threads: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.header = header
        self._fname = self.path.name
        self.piece_size = _index(piece_size, f"{self._fname}: piece_size")
        if self.piece_size < 1:
            raise ArtifactError(f"{self._fname}: piece_size must be at least 1, not {piece_size}")
        self._threads = _check_threads(threads, f"{self._fname}: threads")
        self._tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self._fd: int | None = None
        self._sections: dict[str, _Reservation] = {}  # insertion order is file order
        self._committed = False
        fields = (header.compiler_version, header.target, *header.platforms)
        if not all(isinstance(f, str) for f in fields) or not isinstance(header.requirements, dict):
            raise ArtifactError(f"{self._fname}: header fields have the wrong types: {header}")
        self._check_header_fits(self._sections)

    def __enter__(self) -> ArtifactWriter:
        if self._fd is not None or self._committed:
            raise ArtifactError(f"{self._fname}: an ArtifactWriter can be entered only once")
        with _os_errors(f"{self._fname}: cannot create {self._tmp}"):
            # 0o666 less the umask, as for any file a program writes (0644 under umask 022):
            # an artifact is data, not an executable.
            self._fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                               0o666)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._committed:
            return
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._tmp.unlink(missing_ok=True)

    def reserve(self, name: str, size: int) -> None:
        """Plans section `name` of `size` bytes after the previously reserved ones."""
        self._open_fd()
        if not isinstance(name, str) or not name or name in self._sections:
            raise ArtifactError(f"{self._fname}: bad or already reserved section name {name!r}")
        size = _index(size, f"{self._fname}: section '{name}' size")
        if size < 0:
            raise ArtifactError(f"{self._fname}: section '{name}' has a negative size {size}")
        last = next(reversed(self._sections.values()), None)
        end = HEADER_SIZE if last is None else last.offset + last.size
        planned = {**self._sections, name: _Reservation(align_up(end), size)}
        self._check_header_fits(planned)
        self._sections = planned

    def write(self, name: str, offset: int, data: Any) -> None:
        """Writes bytes / a memoryview / a C-contiguous numpy array at `offset` in section `name`.

        Every byte of a section must be written exactly once, in any order of pieces.
        """
        fd = self._open_fd()
        res = self._reservation(name)
        try:
            view = _as_bytes(data)
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"{self._fname}: cannot write to section '{name}': {e}") from e
        offset = _index(offset, f"{self._fname}: section '{name}' write offset")
        end = offset + view.nbytes
        if offset < 0 or end > res.size:
            raise ArtifactError(
                f"{self._fname}: write of bytes [{offset}, {end}) falls outside section "
                f"'{name}' of {res.size} bytes"
            )
        if not view.nbytes:
            return
        try:
            res.mark(offset, end)
        except ValueError as e:
            raise ArtifactError(f"{self._fname}: section '{name}': {e}") from e
        position = res.offset + offset
        with _os_errors(f"{self._fname}: writing section '{name}'"):
            while len(view):
                n = os.pwrite(fd, view, position)
                view = view[n:]
                position += n

    def add(self, name: str, data: Any) -> None:
        """Reserves section `name` and writes `data` (any `write` input) as all of it."""
        try:
            size = _as_bytes(data).nbytes
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"{self._fname}: cannot add section '{name}': {e}") from e
        self.reserve(name, size)
        self.write(name, 0, data)

    def size(self) -> int:
        """Bytes of the sections reserved so far (what commit hashes)."""
        return sum(r.size for r in self._sections.values())

    def commit(self, manifest: dict[str, Any],
               on_hashed: Callable[[int], None] | None = None) -> None:
        """Checks coverage, hashes sections' pieces, writes digest table, manifest and header,
        renames into place. `on_hashed(n)` after each piece of n bytes is hashed (progress)."""
        fd = self._open_fd()
        if not isinstance(manifest, dict):
            raise ArtifactError(f"{self._fname}: manifest must be a dict, not {type(manifest)}")
        try:
            body = canonical_json(manifest)
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"{self._fname}: manifest is not JSON-serializable: {e}") from e
        for name, res in self._sections.items():
            gap = res.first_gap()
            if gap is not None:
                raise ArtifactError(
                    f"{self._fname}: section '{name}' has unwritten bytes [{gap[0]}, {gap[1]}) "
                    f"of {res.size}"
                )
        spans = [SectionSpan(name, r.offset, r.size) for name, r in self._sections.items()]
        pieces = [p for s in spans for p in _cut(s.name, s.offset, s.size, self.piece_size)]
        with _os_errors(f"{self._fname}: committing"):
            with _hashing(fd, pieces, self._threads, self._fname) as digests:
                hashed = []
                for piece, d in zip(pieces, digests, strict=True):
                    hashed.append(d)
                    if on_hashed is not None:
                        on_hashed(piece.size)
                table = b"".join(hashed)
            end = max((s.offset + s.size for s in spans), default=HEADER_SIZE)
            tinfo = Blob(align_up(end), len(table), hashlib.sha256(table).hexdigest())
            minfo = Blob(
                align_up(tinfo.offset + tinfo.size), len(body), hashlib.sha256(body).hexdigest()
            )
            block = encode_header_block(
                HeaderBlock(self.header, tuple(spans), self.piece_size, tinfo, minfo), self._fname
            )
            # Sections were written in place; holes between regions read back as zeros.
            for position, chunk in ((tinfo.offset, table), (minfo.offset, body), (0, block)):
                if os.pwrite(fd, chunk, position) != len(chunk):
                    raise OSError(f"short write at byte {position}")
            os.fsync(fd)
            os.close(fd)
            self._fd = None
            os.replace(self._tmp, self.path)
            self._committed = True
            # The rename is durable only once the directory entry is on disk.
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def _open_fd(self) -> int:
        if self._fd is None:
            state = "already committed" if self._committed else "not entered with `with`"
            raise ArtifactError(f"{self._fname}: writer is {state}")
        return self._fd

    def _reservation(self, name: str) -> _Reservation:
        if name not in self._sections:
            raise ArtifactError(f"{self._fname}: section '{name}' was never reserved")
        return self._sections[name]

    def _check_header_fits(self, planned: dict[str, _Reservation]) -> None:
        """Raises now, before gigabytes are written, if the final header could not fit."""
        big, zero = 1 << 60, "0" * 64  # wider than any real blob offset/length, or digest
        sections = tuple(SectionSpan(n, r.offset, r.size) for n, r in planned.items())
        widest = Blob(big, big, zero)
        encode_header_block(
            HeaderBlock(self.header, sections, self.piece_size, widest, widest), self._fname
        )


class Artifact:
    """An open .rvp: header and manifest checked, sections mapped read-only. Use `open`."""

    def __init__(
        self,
        path: Path,
        file: io.FileIO,
        mm: mmap.mmap,
        header: ArtifactHeader,
        piece_size: int,
        sections: dict[str, SectionInfo],
        manifest: dict[str, Any],
        signable: Signable,
        signatures: tuple[Signature, ...],
    ) -> None:
        self.path = path
        self.header = header
        self.piece_size = piece_size  # bytes per hashed piece of every section
        self.sections = sections  # name -> SectionInfo (with piece digests), in file order
        self.manifest = manifest  # the dict given to ArtifactWriter.commit, as JSON round-trips it
        self.signable = signable  # what signatures sign, and where the signature page goes
        self.signatures = signatures  # as the signature page lists them, not checked; () unsigned
        self._file = file  # for streaming reads in verify; closes itself if never closed
        self._mm: mmap.mmap | None = mm

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], *, trusted_keys: Sequence[TrustedKey] | None = None
    ) -> Artifact:
        """With `trusted_keys`, refuses the file unless it is signed by one of them and every
        signature by one of them is valid; that check runs on the header block and the digest
        table as read, before the table or the manifest is trusted or the manifest read."""
        path = Path(path)
        fname = path.name
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
        with _os_errors(f"{fname}: cannot open"):
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise ArtifactError(f"{fname}: not a regular file (a {_file_kind(st)}); an "
                                        "artifact is a file")
                os.set_blocking(fd, True)
            except BaseException:
                os.close(fd)
                raise
        file = open(fd, "rb", buffering=0)  # closed by close(), or below on error
        try:
            with _os_errors(f"{fname}: cannot read"):
                block = os.pread(fd, HEADER_SIZE, 0)
                file_size = st.st_size
            layout = decode_header_block(block, fname)
            tinfo, minfo = layout.piece_digests, layout.manifest
            for label, s in [
                *((f"section '{s.name}'", s) for s in layout.sections),
                ("piece-digest table", tinfo),
                ("manifest", minfo),
            ]:
                if s.offset + s.size > file_size:
                    raise ArtifactError(
                        f"{fname}: truncated: {label} ends at byte {s.offset + s.size} but the "
                        f"file is {file_size} bytes"
                    )
            page_offset = align_up(minfo.offset + minfo.size)
            signatures = _read_signatures(fd, file_size, minfo, page_offset, fname)
            with _os_errors(f"{fname}: cannot read the piece-digest table"):
                table = os.pread(fd, tinfo.size, tinfo.offset)
            signable = Signable(block, table, page_offset)
            if trusted_keys is not None:
                require_trusted(signatures, signable, trusted_keys, fname)
            _check_padding(fd, layout, file_size, fname)
            if hashlib.sha256(table).hexdigest() != tinfo.sha256:
                raise ArtifactError(f"{fname}: piece-digest table is corrupt (sha256 mismatch)")
            sections = split_piece_digests(layout, table)
            with _os_errors(f"{fname}: cannot read the manifest"):
                body = os.pread(fd, minfo.size, minfo.offset)
            if hashlib.sha256(body).hexdigest() != minfo.sha256:
                raise ArtifactError(f"{fname}: manifest is corrupt (sha256 mismatch)")
            try:
                manifest = parse_json(body, "manifest")
            except SchemaError as e:
                raise ArtifactError(f"{fname}: {e}") from None
            if not isinstance(manifest, dict):
                raise ArtifactError(f"{fname}: manifest is not a JSON object")
            with _os_errors(f"{fname}: cannot map"):
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            return cls(
                path, file, mm, layout.header, layout.piece_size, {s.name: s for s in sections},
                manifest, signable, signatures,
            )
        except BaseException:
            file.close()
            raise

    def buffer(self, name: str) -> memoryview:
        """Read-only, zero-copy view of section `name`."""
        s = self._section(name)
        return memoryview(self._mmap())[s.offset : s.offset + s.size]

    def array(self, name: str, offset: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """Read-only, zero-copy array at byte `offset` of section `name`; ml_dtypes work too."""
        s = self._section(name)
        dt = np.dtype(dtype)
        count = math.prod(shape)
        end = offset + count * dt.itemsize
        if offset < 0 or end > s.size:
            raise ArtifactError(
                f"{self.path.name}: array bytes [{offset}, {end}) fall outside section '{name}' "
                f"of {s.size} bytes"
            )
        flat = np.frombuffer(self._mmap(), dtype=dt, count=count, offset=s.offset + offset)
        return flat.reshape(shape)

    def verify(self, names: Iterable[str] | None = None, *, threads: int | None = None) -> None:
        """Re-hashes every piece of the sections (all, by default) on `threads` threads (default:
        one per core); raises on the first corrupt piece in section order, naming it."""
        fname = self.path.name
        self._mmap()  # raises if closed
        threads = _check_threads(threads, f"{fname}: verify threads")
        sections = [self._section(n) for n in (self.sections if names is None else names)]
        pieces = [p for s in sections for p in section_pieces(s)]
        recorded = [d for s in sections for d in s.piece_sha256]
        with _hashing(self._file.fileno(), pieces, threads, fname) as digests:
            for piece, want, got in zip(pieces, recorded, digests, strict=True):
                if got != want:
                    raise corrupt_piece_error(fname, piece, got, want)

    def fileno(self) -> int:
        """The open file's descriptor (for positioned reads: artifacts/stream.py)."""
        self._mmap()  # raises if closed
        return self._file.fileno()

    def close(self) -> None:
        if self._mm is None:
            return
        try:
            self._mm.close()
        except BufferError:
            pass  # arrays/views handed out still use the mapping; it is unmapped when they go
        self._mm = None
        self._file.close()

    def __enter__(self) -> Artifact:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _mmap(self) -> mmap.mmap:
        if self._mm is None:
            raise ArtifactError(f"{self.path.name}: artifact is closed")
        return self._mm

    def _section(self, name: str) -> SectionInfo:
        if name not in self.sections:
            raise ArtifactError(
                f"{self.path.name}: no section '{name}' (has: {', '.join(self.sections)})"
            )
        return self.sections[name]


def _file_kind(st: os.stat_result) -> str:
    kinds = [(stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
             (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")]
    return next((name for test, name in kinds if test(st.st_mode)), "special file")


def _read_signatures(
    fd: int, file_size: int, manifest: Blob, page_offset: int, fname: str
) -> tuple[Signature, ...]:
    """The signatures on the page after the manifest; () when the file ends with the manifest."""
    end = manifest.offset + manifest.size
    if file_size == end:
        return ()
    if file_size != page_offset + ALIGN:
        raise ArtifactError(
            f"{fname}: {file_size - end} unexpected bytes after the manifest (a signature page "
            f"is {ALIGN} bytes at byte {page_offset})"
        )
    with _os_errors(f"{fname}: cannot read the signature page"):
        page = os.pread(fd, ALIGN, page_offset)
    return decode_page(page, end, fname)


def _check_padding(fd: int, layout: HeaderBlock, file_size: int, fname: str) -> None:
    """Every region starts at the first multiple of ALIGN after the previous one ends, and the
    bytes between them are zero: no byte of the file lies outside what hashes and signatures
    cover. Reads less than ALIGN bytes per region."""
    regions = [
        *((f"section '{s.name}'", s.offset, s.size) for s in layout.sections),
        ("piece-digest table", layout.piece_digests.offset, layout.piece_digests.size),
        ("manifest", layout.manifest.offset, layout.manifest.size),
    ]
    end_of_manifest = layout.manifest.offset + layout.manifest.size
    if file_size > end_of_manifest:  # _read_signatures accepted a page there
        regions.append(("signature page", align_up(end_of_manifest), ALIGN))
    end = HEADER_SIZE
    for label, offset, size in regions:
        if offset != align_up(end):
            raise ArtifactError(f"{fname}: {label} starts at byte {offset}, not at the first "
                                f"multiple of {ALIGN} after byte {end}")
        with _os_errors(f"{fname}: cannot read the padding before the {label}"):
            padding = os.pread(fd, offset - end, end)
        if any(padding):
            raise ArtifactError(f"{fname}: the padding before the {label} is not zero")
        end = offset + size


def check_platform(header: ArtifactHeader, platform: str) -> None:
    """Raises unless the artifact was built for `platform` (e.g. "cpu", "cuda", "tpu")."""
    if platform not in header.platforms:
        raise ArtifactError(
            f"{header.source or '<artifact>'}: built for platforms {', '.join(header.platforms)}; "
            f"this machine's platform is {platform}"
        )
