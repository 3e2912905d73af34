"""The engine's own host time per step, without a device: an h100 artifact's schedule driven by
the real ScheduledExecutor over a device whose kernels do nothing (its io is kept in memory),
so every millisecond measured is the engine's and the executor's Python and numpy work:
scheduling, block tables, io building, detokenizing. --requests requests of --prompt random
token ids and --tokens generated tokens each (streamed, EOS ignored), at most the artifact's
max_seqs at once; decode loops are sized as for a --step-ms device step. Reports the median over
--repeats runs of wall time per engine step. The KV pools get every sequence a whole table.

    python benchmarks/engine_host.py ART [--requests 512] [--prompt 128] [--tokens 128]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from rvcompile.artifacts import Artifact
from rvcompile.artifacts.kernel_schedule import KernelSchedule
from rvcompile.runtime.engine import Request
from rvcompile.runtime.executor_api import Sampling
from rvcompile.runtime.executors.scheduled import ScheduledExecutor
from rvcompile.runtime.model import Model


class NoKernelDevice:
    """A ScheduleDevice whose entries run nothing: io writes and reads only."""

    def __init__(self, schedule: KernelSchedule):
        self.kv_blocks = {k.name: schedule.max_seqs * k.table_width for k in schedule.kv.kinds}
        self.mem = np.zeros(schedule.arena_bytes, np.uint8)

    def write(self, offset: int, data: bytes) -> None:
        self.mem[offset:offset + len(data)] = np.frombuffer(data, np.uint8)

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.mem[offset:offset + nbytes].tobytes()

    def run(self, entry: str) -> None:
        pass


def one_run(art: Artifact, schedule: KernelSchedule, args) -> tuple[float, int]:
    eng = Model(art, ScheduledExecutor(schedule, NoKernelDevice(schedule))).engine
    rng = np.random.default_rng(0)
    for i in range(args.requests):
        eng.add(Request(f"r{i}", rng.integers(100, 8000, args.prompt).tolist(), args.tokens,
                        Sampling(), ignore_eos=True, stream=True))
    steps, t = 0, time.perf_counter()
    while eng.has_work():
        eng._loop_step_s = args.step_ms / 1e3  # as measured on a device: sizes streamed loops
        eng.step()
        steps += 1
    return (time.perf_counter() - t) / steps, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", help="an h100 artifact (its schedule; no GPU needed)")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    art = Artifact.open(args.artifact)
    schedule = KernelSchedule.from_json(art.manifest["h100"]["schedule"])
    runs = [one_run(art, schedule, args) for _ in range(args.repeats)]
    per_step = sorted(s for s, _ in runs)
    print(f"{art.path.name}: max_seqs {schedule.max_seqs}, {args.requests} requests, "
          f"{runs[0][1]} engine steps; host ms per step "
          + ", ".join(f"{s * 1e3:.2f}" for s in per_step)
          + f" (median {per_step[len(per_step) // 2] * 1e3:.2f})")


if __name__ == "__main__":
    main()
