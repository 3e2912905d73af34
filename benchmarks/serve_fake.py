"""`rvrun serve` on the CPU over a simulated GPU: an h100 artifact's schedule driven by the real
ScheduledExecutor, engine and HTTP server, over a device whose entries take the time a cost
model gives them (by default the 31B's, measured on an H100) and return random tokens. The
device is asynchronous like the GPU: `run` queues the entry's time behind what is queued and
returns at once; `read` waits until everything queued is done; `read_later` waits only for what
was queued before it. So the engine's host work shows exactly where it keeps the device idle:
the report is serve_bench's (output tok/s, TTFT, ITL, the engine's host share) plus the
simulated device's busy share of the wall time.

The token rows are what decode_advance would log (targets/h100/rows.py's numpy rule, run on the
io in memory); every other output token is drawn at random from ids every vocabulary has.
Nothing else of the model runs, so any artifact of the target serves (the default model's,
built with the serving shapes: `--max-seqs 256 --prefill-buckets 16,64,128 --target h100-fp8`).

    python benchmarks/serve_fake.py ART --concurrency 64,256 --requests 512 \\
        [--prompt-tokens 128 --output-tokens 128] [--no-progress] [--json OUT]

`--no-progress` runs the decode loop as before the progressive loop (each call bounded to the
streaming interval, its tokens handed over after it), for an A/B on the same machine.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.artifacts.kernel_schedule import KernelSchedule
from rvcompile.runtime.executors.scheduled import ScheduledExecutor
from rvcompile.runtime.model import Model
from rvcompile.runtime.serve import server
from rvcompile.targets.h100.rows import advance

# 31B h100-fp8 on an H100 (docs/BENCHMARKS.md): decode steps by width (1, 64, 256: graph steps
# of the twelfth session's step profile at 48b5e80; 8, 32, 128: its bare sweep's tok/s, host io
# included), a 256-row prefill chunk (eighth session), and a mixed call's cost against its two
# parts (eleventh session: 10-22% saved)
DECODE_MS = {1: 12.76, 8: 16.73, 32: 21.26, 64: 19.11, 128: 26.02, 256: 32.90}
PREFILL_MS_PER_ROW = 25.74 / 256
MIXED_SAVING = 0.85  # a mixed call costs this share of its prefill and decode calls apart
TOKEN_IDS = (100, 8000)


def decode_ms(width: int) -> float:
    """The decode step's ms at `width` lanes, interpolated between the measured widths."""
    xs = sorted(DECODE_MS)
    return float(np.interp(width, xs, [DECODE_MS[x] for x in xs]))


class SimulatedGpu:
    """A ScheduleDevice whose entries take the cost model's time, asynchronously (module
    docstring). `busy_s` sums the time the simulated device computed."""

    def __init__(self, schedule: KernelSchedule, seed: int = 0):
        self.schedule = schedule
        self.kv_blocks = {k.name: schedule.max_seqs * k.table_width for k in schedule.kv.kinds}
        self.mem = np.zeros(schedule.arena_bytes, np.uint8)
        self.rng = np.random.default_rng(seed)
        self.free_at = 0.0  # when the queued work is done (perf_counter seconds)
        self.busy_s = 0.0
        self.runs: dict[str, list[float]] = {}  # entry kind -> [runs, seconds]
        self.lock = threading.Lock()

    def _field(self, name: str) -> np.ndarray:
        f = self.schedule.io[name]
        return self.mem[f.offset:f.offset + f.nbytes].view(f.dtype).reshape(f.shape)

    def _queue(self, kind: str, seconds: float) -> None:
        with self.lock:
            runs = self.runs.setdefault(kind, [0, 0.0])
            runs[0] += 1
            runs[1] += seconds
            now = time.perf_counter()
            self.free_at = max(now, self.free_at) + seconds
            self.busy_s += seconds

    def _wait(self, until: float) -> None:
        left = until - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def write(self, offset: int, data: bytes) -> None:
        self.mem[offset:offset + len(data)] = np.frombuffer(data, np.uint8)

    def read(self, offset: int, nbytes: int) -> bytes:
        self._wait(self.free_at)
        return self.mem[offset:offset + nbytes].tobytes()

    def read_later(self, offset: int, nbytes: int):
        data, ready = self.mem[offset:offset + nbytes].tobytes(), self.free_at

        def fetch() -> bytes:
            self._wait(ready)
            return data
        return fetch

    def run(self, entry: str) -> None:
        kind, *shape = entry.split("_")
        rows = [int(x) for x in shape]
        if kind == "decode":
            self._queue(kind, decode_ms(rows[0]) / 1e3)
            self._decode_advance(rows[0])
        elif kind == "prefill":
            self._queue(kind, rows[0] * PREFILL_MS_PER_ROW / 1e3)
        elif kind == "mixed":
            apart = rows[0] * PREFILL_MS_PER_ROW + decode_ms(rows[1])
            self._queue(kind, MIXED_SAVING * apart / 1e3)
        else:
            raise ValueError(f"the simulated device does not run {entry}")
        out = self.schedule.outputs.get(f"{entry}.out_tokens")
        if out is not None:
            tokens = self.rng.integers(*TOKEN_IDS, out.nbytes // 4, dtype=np.int32)
            self.mem[out.offset:out.offset + out.nbytes] = tokens.view(np.uint8)

    def _decode_advance(self, b: int) -> None:
        """rows.decode_advance on the io, the sampled tokens random."""
        f = {n: self._field(n) for n in ("tokens", "positions", "seq_len", "step",
                                         "loop_budget", "loop_step")}
        hist = self._field("loop_tokens")  # a decode entry of b rows logs [L, b]
        history = hist.reshape(-1)[:hist.shape[0] * b].reshape(hist.shape[0], b)
        sampled = self.rng.integers(*TOKEN_IDS, b, dtype=np.int32)
        advance(sampled, f["tokens"][:b], f["positions"][:b], f["seq_len"][:b], f["step"][:b],
                f["loop_budget"][:b], f["loop_step"], history)


def positive_ints(text: str) -> str:
    """A comma-separated list of positive integers (argparse type), kept as text."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, comma-separated: {text!r}")
    return text


def positive_int(text: str) -> int:
    return int(positive_ints(text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", help="an h100 artifact (its schedule; no GPU needed)")
    ap.add_argument("--concurrency", type=positive_ints, default="64,256")
    ap.add_argument("--requests", type=positive_int, default=512)
    ap.add_argument("--prompt-tokens", type=positive_int, default=128)
    ap.add_argument("--output-tokens", type=positive_int, default=128)
    ap.add_argument("--no-progress", action="store_true",
                    help="the decode loop without progress (the A/B's before)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        art = Artifact.open(args.artifact)
    except ArtifactError as e:
        ap.error(str(e))
    if "h100" not in art.manifest:
        ap.error(f"{args.artifact}: not an h100 artifact (target {art.manifest['target']})")
    schedule = KernelSchedule.from_json(art.manifest["h100"]["schedule"])
    device = SimulatedGpu(schedule)
    executor = ScheduledExecutor(schedule, device)
    if args.no_progress:
        executor.loop_progress = False
    model = Model(art, executor)
    app = server.create_app(model, server.ServeOptions(model_name="fake", max_waiting=100000))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    serving = threading.Thread(target=server.run, args=(app, sock, 1.0, print), daemon=True)
    serving.start()
    report = Path(args.json or f"/tmp/serve_fake_{port}.json")
    t0, busy0 = time.perf_counter(), device.busy_s
    bench = Path(__file__).with_name("serve_bench.py")
    subprocess.run([sys.executable, str(bench), "--url", f"http://127.0.0.1:{port}/v1",
                    "--concurrency", args.concurrency, "--requests", str(args.requests),
                    "--prompt-tokens", str(args.prompt_tokens), "--output-tokens",
                    str(args.output_tokens), "--json", str(report)], check=True)
    wall = time.perf_counter() - t0
    data = json.loads(report.read_text())
    data["simulated_device"] = {"busy_s": device.busy_s - busy0, "wall_s": wall,
                                "progress": not args.no_progress, "runs": device.runs}
    report.write_text(json.dumps(data, indent=1))
    print(f"simulated device busy {device.busy_s - busy0:.1f} s of {wall:.1f} s "
          f"({(device.busy_s - busy0) / wall:.0%}); progressive loop: {not args.no_progress}; "
          + ", ".join(f"{k} {n} runs {t:.1f} s" for k, (n, t) in sorted(device.runs.items())))


if __name__ == "__main__":
    main()
