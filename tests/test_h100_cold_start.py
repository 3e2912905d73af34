"""The H100 load path of issue 18: the weights read once from the file and streamed to the device
through pinned buffers on several streams, then hashed there by the artifact's piece hash (the
sha256 kernel, a GPU thread a 1 MiB piece), or, for an artifact without it or with large pieces,
each piece hashed on the CPU as it streams; meanwhile the cubins load and the graphs capture;
nothing but the piece hash runs before every piece checked out; a corrupt piece fails the load
with the container's one-line error and frees what was allocated.

On the CPU the whole of CudaScheduleDevice runs against a fake driver context that keeps device
memory as bytes (stub cubins: tests/stub_cubins.py; TMA descriptors zeroed) and runs the piece hash
as hashlib over the bytes delivered to it: the device image must be the artifact's weights and
constants, zeros elsewhere, every launch but the piece hash's only ever recorded into a graph, the
hash launched once every weight byte arrived and before any graph upload; open_executor sizes the
KV pools from the fake's free memory (or as asked) and refuses, in one line and before allocating,
pools that do not fit. Through runtime.load on the fake: the GPU's context opens while the manifest
is checked; the text check (tokenizer, template) runs alongside the upload, the graphs are uploaded
only once it passed, its failure stops the upload at its next chunk, frees everything and is the
load's error whatever else failed, as when it ran first; the load report's phases add up to the
load's time. On an H100 (marked gpu) the same with the real driver: the image read back, a corrupt
file or a tokenizer that does not parse refused with nothing leaked, and the load report's figures.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from h100_helpers import h100_context
from stub_cubins import build_h100

from rvcompile import runtime
from rvcompile.artifacts import Artifact, ArtifactError, ArtifactWriter
from rvcompile.artifacts.contents import parse_cubins, read_contents, read_texts
from rvcompile.artifacts.format import PIECE_SIZE
from rvcompile.artifacts.manifest import PieceHash, read_manifest
from rvcompile.build import BuildOptions
from rvcompile.runtime.executor_api import LoadOptions, SampleExtras, SeqChunk
from rvcompile.runtime.executors import cuda_upload, h100, tma
from rvcompile.runtime.executors.cuda_driver import CudaError, DeviceBuffer, pack_args

TINY = {"max_context": 64, "prefill_buckets": (8,), "max_seqs": 1}
BASE = 1 << 32  # the fake device's first address (aligned as TMA wants): the arena's
OTHER = 1 << 40  # where the fake places any other allocation (the piece hash's digests)
MIB = 1 << 20


class FakeContext:
    """The CudaContext calls the load makes, on host memory: copies land at once."""

    def __init__(self):
        self.memory = bytearray()
        self.others: dict[int, bytearray] = {}  # allocations after the arena, by address
        self.live: set[int] = set()  # device allocations not freed
        self.pinned: dict[int, np.ndarray] = {}  # by id, not freed
        self.capturing: set[int] = set()  # threads inside capture()
        self.captured_launches = 0
        self.launched_outside_capture = 0
        self.thread_local_captures = 0
        self.graph_uploads = 0
        self.modules = 0  # loaded, not unloaded
        self.graphs = 0  # instantiated, not destroyed
        self.lock = threading.Lock()
        self.cu = None
        self.weight_copies = 0  # copies into the arena's weights (the stream's deliveries)
        self.weights_end = 0  # set by a test: the arena's weights end here
        self.on_weight_copy = None  # a test's hook, called (with this lock not held) per copy
        self.uploaded_when = []  # per graph upload: what a test's `ready()` said then
        self.ready = lambda: True
        self.events: list[str] = []  # "hash" (a piece hash launch) and "graph upload", in order
        self.copies_when_hashed: list[int] = []  # weight copies made by each piece hash launch

    compute_capability = (9, 0)

    def driver_version(self):
        return 13000

    def device_name(self):
        return "Fake GPU"

    def mem_info(self):
        """(free, total): room for a tiny arena, HEADROOM and its pools at the default share."""
        return 320 << 20, 320 << 20

    def stream(self, non_blocking=False):
        return object()

    def alloc(self, nbytes):
        if not self.memory:  # the arena
            self.memory = bytearray(b"\xa5" * nbytes)  # garbage: the load must set every byte
            self.live.add(BASE)
            return DeviceBuffer(BASE, nbytes)
        ptr = OTHER + sum(len(b) for b in self.others.values())
        self.others[ptr] = bytearray(b"\x5a" * nbytes)
        self.live.add(ptr)
        return DeviceBuffer(ptr, nbytes)

    def free(self, buf):
        self.live.remove(buf.ptr)

    def view(self, ptr, nbytes):
        """The bytes at device address `ptr` (the arena's, or another allocation's)."""
        if ptr >= OTHER:
            base = max(p for p in self.others if p <= ptr)
            return memoryview(self.others[base])[ptr - base:ptr - base + nbytes]
        return memoryview(self.memory)[ptr - BASE:ptr - BASE + nbytes]

    def copy_to_host(self, host, src, stream=0):
        host[:] = np.frombuffer(self.view(src, host.nbytes), np.uint8)

    def memset_range(self, ptr, nbytes, stream=0):
        self.memory[ptr - BASE:ptr - BASE + nbytes] = bytes(nbytes)

    def copy_to_device(self, dst, host, stream=0):
        with self.lock:
            self.memory[dst - BASE:dst - BASE + host.nbytes] = host.tobytes()
            weight = dst - BASE < self.weights_end
            self.weight_copies += weight
        if weight and self.on_weight_copy is not None:
            self.on_weight_copy()

    def alloc_pinned(self, nbytes):
        a = np.zeros(nbytes, np.uint8)
        self.pinned[id(a)] = a
        return a

    def free_pinned(self, host):
        del self.pinned[id(host)]

    def event_without_timing(self):
        return object()

    def launch_config(self, grid, block, smem, stream=0):
        return (grid, block, smem)

    def launch_configured(self, fn, config, packed):
        if fn == "sha256_pieces":  # the piece hash (get_function gives the name): hashlib
            assert threading.get_ident() not in self.capturing
            data, piece, total, count, out = (a.value for a in packed[1])
            for i in range(count):
                start = i * piece
                self.view(out + 32 * i, 32)[:] = hashlib.sha256(
                    self.view(data + start, max(0, min(piece, total - start)))).digest()
            with self.lock:
                self.events.append("hash")
                self.copies_when_hashed.append(self.weight_copies)
        elif threading.get_ident() in self.capturing:
            self.captured_launches += 1
        else:
            self.launched_outside_capture += 1

    def launch(self, fn, grid, block, smem, args, stream=0):
        self.launch_configured(fn, self.launch_config(grid, block, smem, stream), pack_args(args))

    def capture(self, stream, record, *, thread_local=False):
        self.thread_local_captures += thread_local
        self.capturing.add(threading.get_ident())
        try:
            record()
        finally:
            self.capturing.discard(threading.get_ident())
        self.graphs += 1
        return object()

    def graph_upload(self, graph_exec, stream):
        self.events.append("graph upload")
        self.graph_uploads += 1
        self.uploaded_when.append(self.ready())

    def load_module(self, cubin):
        self.modules += 1
        return cubin

    def unload_module(self, module):
        self.modules -= 1

    def destroy_graph(self, graph_exec):
        self.graphs -= 1

    def get_function(self, module, name):
        return name

    def noop(self, *args, **kwargs):
        return None

    make_current = synchronize = stream_synchronize = event_synchronize = record = noop
    destroy_event = destroy_stream = set_max_dynamic_smem = noop


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cold") / "tiny.rvp"
    return build_h100(out, "gemma-4-tiny", BuildOptions("h100-fp8", **TINY))


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(tma, "encode_tiled", lambda cu, d, address: bytes(tma.DESCRIPTOR_BYTES))
    monkeypatch.setattr(cuda_upload, "CHUNK_BYTES", 64 << 10)  # many chunks: buffers reused
    return FakeContext()


def _corrupt_copy(src: Path, dst: Path, offset_in_weights: int) -> Path:
    with Artifact.open(src) as art:
        at = art.sections["weights"].offset + offset_in_weights
    data = bytearray(src.read_bytes())
    data[at] ^= 0x40
    dst.write_bytes(bytes(data))
    return dst


def _executor(art, fake, check_weights=True):
    """h100_executor as open_executor calls it: with the manifest's piece hash."""
    h = read_manifest(art).h100
    return h100.h100_executor(art, h.schedule, fake, check_weights=check_weights,
                              piece_hash=h.piece_hash)


def test_the_tiny_artifact_has_small_pieces_and_the_piece_hash(artifact):
    """An h100 build hashes in 1 MiB pieces (not format.PIECE_SIZE) and carries the sha256
    kernel's cubin, named in the manifest, which contents.py checks against the cubin."""
    with Artifact.open(artifact) as art:
        m = read_manifest(art)
        read_contents(art, m)
        assert art.piece_size == MIB < PIECE_SIZE
        assert len(art.sections["weights"].piece_sha256) == -(-art.sections["weights"].size // MIB)
        assert (m.h100.piece_hash.module, m.h100.piece_hash.kernel) == ("sha256.cu",
                                                                        "sha256_pieces")
        assert "sha256.cu" in m.h100.schedule.cubins


@pytest.mark.parametrize("module, kernel, error", [
    ("sha256.cu", "sha256_nothing", "kernel 'sha256_nothing' is not in sha256.cu"),
    ("rows.cu", None, "takes parameters of"),  # a launched kernel of another signature
])
def test_a_piece_hash_that_does_not_fit_is_refused(artifact, module, kernel, error):
    """contents.py refuses, in one line naming the field, a manifest whose piece hash names a
    kernel its cubin lacks or one that takes other parameters than the runtime passes."""
    with Artifact.open(artifact) as art:
        m = read_manifest(art)
        if kernel is None:  # any kernel of that module
            from rvcompile.artifacts.cubin import kernels

            c = m.h100.schedule.cubins[module]
            kernel = sorted(kernels(bytes(art.buffer("cubins")[c.offset:c.offset + c.size])))[0]
        bad = replace(m, h100=replace(m.h100, piece_hash=PieceHash(module, kernel)))
        with pytest.raises(ArtifactError, match="manifest.h100.piece_hash") as e:
            parse_cubins(bad, art.buffer("cubins"), art.path.name)
        assert error in str(e.value) and "\n" not in str(e.value)


def test_the_device_image_is_the_file_and_nothing_runs(artifact, fake):
    with Artifact.open(artifact) as art:
        schedule = read_manifest(art).h100.schedule
        fake.weights_end = schedule.weights_bytes
        ex = _executor(art, fake)
        weights = bytes(art.buffer("weights"))
        consts = bytes(art.buffer("constants"))
    mem = fake.memory
    assert len(weights) == schedule.weights_bytes and len(weights) > 4 * (64 << 10)
    assert mem[:len(weights)] == weights
    c = schedule.constants_offset
    assert mem[c:c + len(consts)] == consts
    rest = bytes(mem[schedule.weights_bytes:])
    assert rest.replace(consts, b"", 1).count(0) == len(rest) - len(consts)
    assert fake.launched_outside_capture == 0 and fake.captured_launches > 0
    # each entry's graph, and the two parts of each sampled one (run_part) as their own
    graphs = sum(e.graph * (1 + 2 * (schedule.sampler_split(name) is not None))
                 for name, e in schedule.entries.items())
    assert fake.thread_local_captures == fake.graph_uploads == fake.graphs == graphs > 0
    assert fake.modules > 0  # kept, with the graphs, by a load that succeeded
    t = ex.load_times
    assert t.streamed and t.checked and t.weight_bytes == len(weights) and t.threads >= 1
    assert t.upload_s > 0 and t.read_s > 0 and t.hash_s == 0  # the CPU hashed nothing
    assert t.hashed_on == "gpu" and t.gpu_hash_s > 0
    # the piece hash ran once, after every weight byte arrived, before any graph upload
    assert fake.events[0] == "hash" and fake.events.count("hash") == 1
    assert fake.copies_when_hashed == [fake.weight_copies]
    assert fake.live == {BASE}  # the digests' buffer freed, the arena kept
    assert t.overlapped == ("cubin load", "graph capture")  # warm-up: once all passed
    assert t.arena_s > 0 and t.finish_s > 0 and t.warm_up_s > 0
    # the io buffers and the decode loop's two read_later slots the executor keeps; staging freed
    assert len(fake.pinned) == 4
    sizes = [a.nbytes for a in fake.pinned.values()]
    assert sizes.count(schedule.io["loop_tokens"].nbytes) >= 2
    assert "sha256 checked on the GPU in " in ex.load_note
    # the default share of the fake's memory holds more than every decode row's whole context:
    # each kind gets max_seqs tables of blocks, the pools after the fixed part
    assert {k.name: k.num_blocks for k in ex.kinds.values()} == {
        k.name: schedule.max_seqs * k.table_width for k in schedule.kv.kinds}
    assert len(mem) == schedule.pool_offsets(ex.device.kv_blocks)[1] > schedule.arena_bytes


def test_late_mask_calls_replay_the_parts_and_stage_sample_io_apart(artifact, fake):
    """A late-mask decode (executor_api's "Late masks") on the CUDA device: the io copied, the
    forward part's graph replayed, masks() asked, sample_io copied, the sampler part's graph
    replayed, then the read; sample_io is staged in the pinned buffer after the io, so it
    never overwrites io bytes whose copy may still be pending."""
    with Artifact.open(artifact) as art:
        schedule = read_manifest(art).h100.schedule
        ex = h100.h100_executor(art, schedule, fake)
    dev = ex.device
    assert ex.late_masks
    events: list = []
    fake.graph_launch = lambda graph, stream: events.append(
        next(k for k, g in dev.graphs.items() if g is graph))
    copy = fake.copy_to_device

    def copy_to_device(dst, host, stream=0):
        staged = host.ctypes.data - dev.io_host.ctypes.data  # where in the pinned buffer
        events.append(("copy", dst - BASE - schedule.io_offset, staged, host.nbytes))
        copy(dst, host, stream)

    fake.copy_to_device = copy_to_device
    fake.copy_to_host = lambda host, src, stream=0: host.__setitem__(
        slice(None), np.frombuffer(fake.memory[src - BASE:src - BASE + host.nbytes], np.uint8))
    lane = SeqChunk([5], 3, {k.name: [0] * k.table_width for k in schedule.kv.kinds},
                    extras=SampleExtras(0))
    mask = np.zeros(schedule.sampler.mask_words, np.int32)
    mask[0] = 1 << 7  # token 7 alone

    def given():
        events.append("masks")
        return [mask]

    ex.decode_late_masks([lane], given)
    io, extras = events[0], events[3]
    assert events[1:3] == [("sampled_decode_1", "forward"), "masks"]
    assert events[4] == ("sampled_decode_1", "sampler")
    # ("copy", arena offset past io_offset, pinned offset, bytes)
    assert io[1:3] == (0, 0) and extras[1:3] == (schedule.io_bytes, schedule.io_bytes)
    assert io[3] <= schedule.io_bytes
    at = schedule.sampler.fields["pool"].offset - schedule.io_offset
    assert bytes(dev.io_host[at:at + mask.nbytes]) == mask.tobytes()  # staged apart


def _repacked(src: Path, dst: Path) -> Path:
    """`src` rewritten as a build before the piece hash wrote it: 256 MiB pieces (each section
    one piece), the manifest unchanged (an older build's has no h100.piece_hash either way)."""
    with Artifact.open(src) as art, ArtifactWriter(dst, art.header) as w:
        for name in art.sections:
            w.add(name, art.buffer(name))
        w.commit(art.manifest)
    return dst


@pytest.mark.parametrize("path", ["gpu", "cpu: no piece hash", "cpu: 256 MiB pieces"])
def test_a_corrupt_weight_piece_fails_the_load_and_frees_everything(artifact, fake, tmp_path,
                                                                    path):
    """A flipped weight byte fails the load with the container's line naming the section and
    the piece, whichever side hashed it (the load report says which), nothing but the piece
    hash having run and everything freed."""
    src = _repacked(artifact, tmp_path / "old.rvp") if "256 MiB" in path else artifact
    bad = _corrupt_copy(src, tmp_path / "bad.rvp", MIB + 1234)
    with Artifact.open(bad) as art:
        h = read_manifest(art).h100
        pieces = len(art.sections["weights"].piece_sha256)
        with pytest.raises(ArtifactError) as e:
            h100.h100_executor(art, h.schedule, fake, check_weights=True,
                               piece_hash=None if "no piece hash" in path else h.piece_hash)
    if path == "gpu":
        assert pieces == 4 and fake.events == ["hash"]
        want = "piece 1 of 4 (bytes [1048576, 2097152)) has sha256 "
    else:
        assert fake.events == []
        want = ("piece 1 of 4 (bytes [1048576, 2097152)) has sha256 " if pieces == 4
                else "piece 0 of 1 (bytes [0, ")
    assert str(e.value).startswith(f"bad.rvp: section 'weights' is corrupt: {want}")
    assert "\n" not in str(e.value)
    assert fake.live == set() and fake.pinned == {} and fake.modules == fake.graphs == 0
    assert fake.launched_outside_capture == 0 and fake.graph_uploads == 0


@pytest.mark.parametrize("path", ["cpu: no piece hash", "cpu: 256 MiB pieces"])
def test_the_cpu_hashes_what_the_gpu_cannot(artifact, fake, tmp_path, path):
    """The path choice: without the piece hash (an older build) or with pieces too large for a
    thread each, every piece is hashed on the CPU as it streams, as before, and the report says
    so; nothing is launched outside a graph."""
    src = _repacked(artifact, tmp_path / "old.rvp") if "256 MiB" in path else artifact
    with Artifact.open(src) as art:
        h = read_manifest(art).h100
        ex = h100.h100_executor(art, h.schedule, fake, check_weights=True,
                                piece_hash=None if "no piece hash" in path else h.piece_hash)
        assert fake.memory[:h.schedule.weights_bytes] == bytes(art.buffer("weights"))
    t = ex.load_times
    assert t.checked and t.hashed_on == "cpu" and t.hash_s > 0 and t.gpu_hash_s == 0
    assert fake.events.count("hash") == 0 and fake.launched_outside_capture == 0
    assert "sha256 checked while streaming" in ex.load_note


def test_a_failure_on_the_loading_thread_stops_the_upload(artifact, fake, monkeypatch):
    """A cubin the driver refuses (this thread) stops the stream at its next chunk instead of
    letting it read the rest of the file, and everything is freed."""
    with Artifact.open(artifact) as art:
        schedule = read_manifest(art).h100.schedule
        fake.weights_end = schedule.weights_bytes
        uploading, refusing = threading.Event(), threading.Event()

        def slowly():  # the stream starts, then waits for the refusal and goes on slowly
            uploading.set()
            assert refusing.wait(10)
            time.sleep(0.005)

        fake.on_weight_copy = slowly

        def refused(cubin):
            assert uploading.wait(10)
            refusing.set()
            raise CudaError("cuModuleLoadData failed: CUDA_ERROR_INVALID_IMAGE")

        monkeypatch.setattr(fake, "load_module", refused)
        with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_IMAGE"):
            h100.h100_executor(art, schedule, fake, check_weights=True)
    chunks = -(-fake.weights_end // cuda_upload.CHUNK_BYTES)
    assert fake.weight_copies < chunks // 2
    assert fake.live == set() and fake.pinned == {} and fake.graph_uploads == 0


def test_unchecked_stream_loads_a_corrupt_file(artifact, fake, tmp_path):
    """--no-verify: delivered as it is (the operator's choice), said so in the report."""
    bad = _corrupt_copy(artifact, tmp_path / "bad.rvp", 99)
    with Artifact.open(bad) as art:
        schedule = read_manifest(art).h100.schedule
        ex = _executor(art, fake, check_weights=False)
        assert fake.memory[:schedule.weights_bytes] == bytes(art.buffer("weights"))
    assert not ex.load_times.checked and ex.load_times.hashed_on == ""
    assert "hash" not in fake.events


@pytest.mark.parametrize("opts,message", [
    (LoadOptions(kv_blocks={"full": 1 << 24}), "tiny.rvp: the KV blocks asked for (16777216 "
                                                "full: "),
    (LoadOptions(gpu_memory_utilization=0.5), "tiny.rvp: 160.0 MiB of GPU memory (utilization "
                                               "0.5 of 320.0 MiB, 320.0 MiB free) cannot hold"),
    (LoadOptions(max_num_seqs=2), "tiny.rvp: max_num_seqs 2: the artifact decodes 1 to 1"),
    (LoadOptions(kv_blocks={"full": 1}), "tiny.rvp: 1 full KV blocks cannot hold one sequence "
                                         "of 64 tokens; need 4"),
])
def test_open_executor_refuses_pools_that_do_not_fit_before_allocating(artifact, fake,
                                                                       monkeypatch, opts,
                                                                       message):
    monkeypatch.setattr(h100, "CudaContext", lambda: fake)
    with Artifact.open(artifact) as art:
        with pytest.raises(ArtifactError) as e:
            h100.open_executor(art, read_manifest(art), opts)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert fake.live == set() and not fake.memory


def test_open_executor_takes_explicit_blocks_and_shares_the_rest(artifact, fake, monkeypatch):
    monkeypatch.setattr(h100, "CudaContext", lambda: fake)
    with Artifact.open(artifact) as art:
        schedule = read_manifest(art).h100.schedule
        ex = h100.open_executor(art, read_manifest(art), LoadOptions(kv_blocks={"full": 6}))
    ring = next(k.table_width for k in schedule.kv.kinds if k.ring)
    assert {k.name: k.num_blocks for k in ex.kinds.values()} == {"full": 6, "sliding": ring}
    assert len(fake.memory) == schedule.pool_offsets({"full": 6, "sliding": ring})[1]
    assert "KV pools 6 full, " in ex.load_note


# ---- runtime.load: the text check alongside the upload ---------------------------------------

def _broken_tokenizer(src: Path, dst: Path) -> Path:
    """A copy whose tokenizer no longer parses (nor matches its digest: only a load with
    verify=False reaches the parser with it, or one whose check a test replaces)."""
    with Artifact.open(src) as art:
        at = art.sections["tokenizer"].offset
    data = bytearray(src.read_bytes())
    data[at] = ord("!")
    dst.write_bytes(bytes(data))
    return dst


def _todays_error(path: Path) -> str:
    """The error the contents check gives when it runs alone (as it did before the upload)."""
    with Artifact.open(path) as art, pytest.raises(ArtifactError) as e:
        read_contents(art, read_manifest(art))
    return str(e.value)


@pytest.fixture
def loading(artifact, fake, monkeypatch):
    """runtime.load on the fake GPU, the executor's PendingChecks kept in `seen["checks"]`, and
    every graph upload recording whether they had passed by then."""
    monkeypatch.setattr(h100, "CudaContext", lambda: fake)
    with Artifact.open(artifact) as art:
        fake.weights_end = read_manifest(art).h100.schedule.weights_bytes
    seen = {}
    real = h100.h100_executor

    def spy(*args, **kwargs):
        seen["checks"] = kwargs["checks"]
        return real(*args, **kwargs)

    monkeypatch.setattr(h100, "h100_executor", spy)
    fake.ready = lambda: seen["checks"].done() and not seen["checks"].failed()
    return seen


def _texts_once_uploading(monkeypatch, fake, then=None):
    """The text check starts only once the weights stream (so it certainly runs alongside
    the upload), then runs `then` (default: the real check)."""
    uploading = threading.Event()
    fake.on_weight_copy = uploading.set
    then = then or runtime.read_texts

    def texts(art, manifest):
        assert uploading.wait(10), "the upload never started while the text check waited"
        return then(art, manifest)

    monkeypatch.setattr(runtime, "read_texts", texts)
    return uploading


def test_load_checks_the_texts_alongside_the_upload_and_reports_it(artifact, fake, loading,
                                                                   monkeypatch):
    def slow(art, manifest):  # outlasts the tiny upload: the load must wait for it
        time.sleep(0.2)
        return read_texts(art, manifest)

    _texts_once_uploading(monkeypatch, fake, slow)
    m = runtime.load(artifact)
    checks = loading["checks"]
    assert checks.done() and not checks.failed()
    assert fake.uploaded_when and all(fake.uploaded_when)  # graphs uploaded once it passed
    assert fake.launched_outside_capture == 0
    assert m.tokenizer.encode("hello").ids  # the contents it parsed are the model's
    r = m.load_report
    assert 0.1 < r.text_waited_s <= r.text_check_s
    assert r.alongside == ("text check", "cubin load", "graph capture")
    assert [n for n, _ in r.phases()] == [
        "open", "check", "text check", "import", "context", "verify", "arena", "upload",
        "gpu hash", "cubin load", "graph capture", "warm-up", "finish"]
    assert r.executor.hashed_on == "gpu" and r.executor.gpu_hash_s > 0
    assert "sha256-checked on the GPU once uploaded" in r.lines()[1]
    counted = sum(s for n, s in r.phases() if n not in r.alongside)
    assert counted + r.text_waited_s + r.other_s == pytest.approx(r.total_s)
    # it started once the weights streamed, so it all ran during the upload, which waited
    during = r.executor.checks_during_upload_s
    assert 0 < during <= r.text_check_s
    assert (f"text check {r.text_check_s:.2f} (alongside, {during:.2f} during upload; waited "
            f"{r.text_waited_s:.2f})") in r.lines()[0]
    data = r.as_json()
    assert data["text_check_s"] == r.text_check_s and data["alongside"] == list(r.alongside)


def test_a_text_check_failing_during_the_upload_stops_it_and_frees_everything(
        artifact, fake, loading, monkeypatch, tmp_path):
    bad = _broken_tokenizer(artifact, tmp_path / "bad.rvp")
    today = _todays_error(bad)
    assert today.startswith("bad.rvp: tokenizer: not a tokenizers tokenizer.json (")
    _texts_once_uploading(monkeypatch, fake)

    def hold_the_stream():  # each worker's weight chunk waits until the check has failed
        deadline = time.monotonic() + 10
        while not loading["checks"].failed():
            assert time.monotonic() < deadline, "the text check never failed"
            time.sleep(0.001)

    first = fake.on_weight_copy
    fake.on_weight_copy = lambda: (first(), hold_the_stream())
    with pytest.raises(ArtifactError) as e:
        runtime.load(bad, verify=False)  # the tokenizer's digest no longer matches
    assert str(e.value) == today  # the same line as when it was checked first
    chunks = -(-fake.weights_end // cuda_upload.CHUNK_BYTES)
    # every streaming thread stopped at its next chunk: one copy each at most
    assert 1 <= fake.weight_copies <= h100.stream_workers() < chunks
    assert fake.live == set() and fake.pinned == {} and fake.modules == fake.graphs == 0
    assert fake.launched_outside_capture == 0 and fake.graph_uploads == 0


@pytest.mark.parametrize("case", ["pools do not fit", "corrupt weights"])
def test_a_failed_text_check_is_the_error_whatever_else_failed(artifact, fake, loading,
                                                               monkeypatch, tmp_path, case):
    """A load that fails on the machine or the weights while the text check runs still fails
    with the text check's error, as when that check ran first."""
    bad = _broken_tokenizer(artifact, tmp_path / "bad.rvp")
    today = _todays_error(bad)
    if case == "pools do not fit":  # the main thread fails before any upload
        opts = {"kv_blocks": {"full": 1}, "verify": False}
    else:  # the stream fails, then the text check; the tokenizer's digest is replaced
        _corrupt_copy(bad, bad, 1234)
        freed = threading.Event()
        real_free = h100.CudaScheduleDevice._free

        def free(self):
            real_free(self)
            freed.set()

        monkeypatch.setattr(h100.CudaScheduleDevice, "_free", free)
        real_verify = Artifact.verify
        monkeypatch.setattr(Artifact, "verify", lambda art, names: real_verify(
            art, [n for n in names if n != "tokenizer"]))

        def after_the_stream_failed(art, manifest):
            assert freed.wait(10), "the corrupt weights never failed the upload"
            return read_texts(art, manifest)

        monkeypatch.setattr(runtime, "read_texts", after_the_stream_failed)
        opts = {}
    with pytest.raises(ArtifactError) as e:
        runtime.load(bad, **opts)
    assert str(e.value) == today
    assert fake.live == set() and fake.pinned == {} and fake.launched_outside_capture == 0


def test_the_context_opens_alongside_the_checks(artifact, fake, loading, monkeypatch):
    """runtime.load starts the GPU's context (h100.begin) on a thread of its own as soon as the
    file is open: the manifest's check here waits until it has started opening."""
    opening = threading.Event()
    threads = []

    def context():
        threads.append(threading.get_ident())
        opening.set()
        return fake

    monkeypatch.setattr(h100, "CudaContext", context)
    real = runtime.read_manifest

    def read_manifest(art):
        assert opening.wait(10), "the context did not open while the manifest was checked"
        return real(art)

    monkeypatch.setattr(runtime, "read_manifest", read_manifest)
    r = runtime.load(artifact).load_report
    assert threads and threads[0] != threading.get_ident()
    assert r.executor.context_open_s >= 0 and r.executor.context_s >= 0


def test_no_gpu_is_refused_as_before_and_after_the_checks(artifact, fake, loading, monkeypatch,
                                                          tmp_path):
    def no_gpu():
        raise CudaError("cuInit failed: CUDA_ERROR_NO_DEVICE")

    monkeypatch.setattr(h100, "CudaContext", no_gpu)
    with pytest.raises(ArtifactError) as e:
        runtime.load(artifact)
    assert str(e.value) == ("tiny.rvp: needs an NVIDIA H100 (CUDA): cuInit failed: "
                            "CUDA_ERROR_NO_DEVICE")
    bad = _broken_tokenizer(artifact, tmp_path / "bad.rvp")
    with pytest.raises(ArtifactError) as e:  # a broken file says so first, GPU or not
        runtime.load(bad, verify=False)
    assert str(e.value) == _todays_error(bad)


# ---- on an H100 ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_artifact(oracle_dir, tmp_path_factory) -> Path:
    from rvcompile.build import build_artifact

    _, ckpt = oracle_dir("dense")
    out = tmp_path_factory.mktemp("cold-gpu") / "dense.rvp"
    build_artifact(str(ckpt), out, BuildOptions("h100-fp8", max_context=128,
                                                prefill_buckets=(8, 32), max_seqs=3),
                   progress=False, log=lambda s: None)
    return out


@pytest.mark.gpu
def test_gpu_streamed_weights_are_the_file(real_artifact):
    ctx = h100_context()
    m = runtime.load(real_artifact)
    r = m.load_report
    print("\n[measured] " + "\n[measured] ".join(r.lines()))
    assert r.runtime == "h100" and r.executor.streamed and r.executor.checked
    assert r.executor.hashed_on == "gpu" and r.executor.gpu_hash_s > 0  # the piece hash ran
    counted = sum(s for n, s in r.phases() if n not in r.alongside)
    assert counted + r.text_waited_s + r.other_s == pytest.approx(r.total_s)
    assert r.text_check_s > 0 and r.executor.context_open_s > 0 and r.executor.arena_s > 0
    dev = m.executor.device
    with Artifact.open(real_artifact) as art:
        weights = np.frombuffer(bytes(art.buffer("weights")), np.uint8)
    back = np.empty_like(weights)
    ctx.copy_to_host(back, dev.arena.ptr, dev.stream)
    ctx.stream_synchronize(dev.stream)
    assert np.array_equal(back, weights)


@pytest.mark.gpu
def test_gpu_corrupt_weights_refused_and_freed(real_artifact, tmp_path):
    ctx = h100_context()
    with Artifact.open(real_artifact) as art:
        size = art.sections["weights"].size
    at = min(MIB + 777, size - 1)  # the second 1 MiB piece, where there is one
    bad = _corrupt_copy(real_artifact, tmp_path / "bad.rvp", at)
    runtime.load(real_artifact)  # the driver's own allocations made once, before measuring
    free_before, _ = ctx.mem_info()
    with pytest.raises(ArtifactError, match=rf"^bad.rvp: section 'weights' is corrupt: piece "
                                            rf"{at // MIB} of {-(-size // MIB)} \(bytes "):
        runtime.load(bad)  # found by the piece hash on the GPU
    free_after, _ = ctx.mem_info()
    assert free_after >= free_before - (8 << 20)  # the arena went back


@pytest.mark.gpu
def test_gpu_text_check_failure_refused_and_freed(real_artifact, tmp_path):
    """A tokenizer that does not parse (verify off, so only the text check alongside the
    upload finds it): the same error as when it was checked first, the arena freed."""
    ctx = h100_context()
    bad = _broken_tokenizer(real_artifact, tmp_path / "bad.rvp")
    today = _todays_error(bad)
    runtime.load(real_artifact)  # the driver's own allocations made once, before measuring
    free_before, _ = ctx.mem_info()
    with pytest.raises(ArtifactError) as e:
        runtime.load(bad, verify=False)
    assert str(e.value) == today
    free_after, _ = ctx.mem_info()
    assert free_after >= free_before - (8 << 20)  # the arena went back


@pytest.mark.gpu
def test_gpu_upload_sink_many_pieces(tmp_path):
    """The sink alone over a 96 MiB section of 8 MiB pieces: 4 streams, 16 workers, the bytes
    read back equal the file's."""
    from rvcompile.artifacts import ArtifactHeader, ArtifactWriter
    from rvcompile.artifacts.stream import stream_section

    ctx = h100_context()
    path = tmp_path / "big.rvp"
    data = np.random.default_rng(0).integers(0, 256, 96 << 20, dtype=np.uint8)
    with ArtifactWriter(path, ArtifactHeader("0", "h100", ("cuda",)), piece_size=8 << 20) as w:
        w.add("weights", data)
        w.commit({})
    buf = ctx.alloc(data.nbytes)
    try:
        with Artifact.open(path) as art:
            sink = cuda_upload.CudaUploadSink(ctx, buf.ptr, 16, chunk_bytes=2 << 20)
            try:
                stats = stream_section(art, "weights", sink, workers=16)
            finally:
                sink.close()
        back = np.empty_like(data)
        ctx.copy_to_host(back, buf.ptr, 0)
        ctx.synchronize()
        assert np.array_equal(back, data)
        print(f"\n[measured] 96 MiB through the sink: {stats.gb_s:.1f} GB/s")
    finally:
        ctx.free(buf)
