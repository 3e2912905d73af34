"""The H100 schedule on the CPU: a numpy arena and, per launch, its kernel entry's numpy reference
(registry.py; each declared beside its kernel, contract.py) applied to the launch's named
arguments exactly as the CUDA kernel reads them. CI checks the H100 plan (lowering, weight
layout, memory plan, KV paging, io) against the oracle with it, no GPU needed.

    dev = reference_device(artifact)        # write / read / run, like the CUDA device
    ex = ScheduledExecutor(dev.schedule, dev)   # the runtime's executor over it (tests compose
    m = Model(artifact, ex)                     # the two: targets never import the runtime)

The KV pools follow the arena's fixed part with the block counts the device is made with
(`kv_blocks`, by kind, as the runtime picks them at load; default: a whole context per decode
row, `default_blocks`), placed by the schedule's pool_offsets; a launch's pool argument reaches
the reference as that pool's arena offset.

`run_part(entry, part)` runs one part of a sampled entry (KernelSchedule.part: the launches
before its sampler, then the sampler), as the runtime's late masks ask (executor_api).

Every launch is checked against its entry when the device is made: the kernel declared, in the
module that defines it, with the entry's arguments in its order (ContractError otherwise). A
parameter block's argument (kind "params") reaches the reference as a contract.ParamsValue: the
schedule's template by its name, and the roles' arena offsets.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from rvcompile.artifacts import Artifact
from rvcompile.artifacts.kernel_schedule import Collective, KernelSchedule, Launch
from rvcompile.targets.h100.contract import Call, ContractError, Entry, ParamsValue
from rvcompile.targets.h100.registry import ENTRIES


def default_blocks(schedule: KernelSchedule) -> dict[str, int]:
    """A whole context per decode row: max_seqs tables' worth of blocks of every kind."""
    return {k.name: schedule.max_seqs * k.table_width for k in schedule.kv.kinds}


class ReferenceDevice:
    def __init__(self, schedule: KernelSchedule, weights: memoryview, constants: bytes,
                 kv_blocks: dict[str, int] | None = None):
        """`kv_blocks`: each KV kind's block count (default_blocks by default); a kind the
        schedule lacks, or a count below 1, is a ValueError."""
        self.schedule = schedule
        self.kv_blocks = dict(kv_blocks or default_blocks(schedule))
        unknown = set(self.kv_blocks) - {k.name for k in schedule.kv.kinds}
        if unknown:
            raise ValueError(f"no KV kind {sorted(unknown)[0]!r} in the schedule")
        self.pool_offsets, arena_bytes = schedule.pool_offsets(self.kv_blocks)
        self.entries = {x.kernel: _entry(x) for e in schedule.entries.values()
                        for x in e.launches if isinstance(x, Launch)}
        self.mem = np.zeros(arena_bytes, np.uint8)
        self.mem[:schedule.weights_bytes] = np.frombuffer(weights, np.uint8)
        c = schedule.constants_offset
        self.mem[c:c + len(constants)] = np.frombuffer(constants, np.uint8)

    def write(self, offset: int, data: bytes) -> None:
        self.mem[offset:offset + len(data)] = np.frombuffer(data, np.uint8)

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.mem[offset:offset + nbytes].tobytes()

    def run(self, entry: str) -> None:
        self._run(entry, self.schedule.entries[entry].launches)

    def run_part(self, entry: str, part: str) -> None:
        """One part of a sampled entry (KernelSchedule.part): "forward", then "sampler"."""
        self._run(entry, self.schedule.part(entry, part))

    def _run(self, entry: str, launches) -> None:
        for launch in launches:
            if isinstance(launch, Collective):
                raise ContractError(f"{entry} has collectives: a tensor-parallel rank's "
                                    "schedule runs beside its peers (TensorParallelDevice)")
            self.launch(launch)

    def launch(self, launch: Launch) -> None:
        """One launch's reference over the arena."""
        entry = self.entries[launch.kernel]
        args = {a.name: None if a.kind == "null" else self._params(a.value) if a.kind == "params"
                else self.pool_offsets[a.value] if a.kind == "pool" else a.value
                for a in launch.args}
        entry.reference(Call(entry, launch.grid, args, self.mem))

    def _params(self, block) -> ParamsValue:
        return ParamsValue(block.template, self.schedule.params_templates[block.template],
                           tuple(block.roles.items()))


def _entry(launch: Launch) -> Entry:
    entry = ENTRIES.get(launch.kernel)
    if entry is None or entry.source != launch.module:
        raise ContractError(f"the schedule launches {launch.kernel} of {launch.module}, which "
                            "no kernel module declares")
    if entry.reference is None:
        raise ContractError(f"kernel {entry.name} has no numpy reference to run on the CPU")
    entry.check_stored(tuple((a.name, a.kind) for a in launch.args))
    return entry


def reference_device(art: Artifact, kv_blocks: dict[str, int] | None = None
                     ) -> ReferenceDevice | TensorParallelDevice:
    """The CPU device for `art`'s kernel schedule, its arena holding the weights and constants
    and `kv_blocks` blocks of each KV kind (ReferenceDevice); for a --tp artifact every rank's,
    each over its part of the sections, in lockstep."""
    h100 = art.manifest["h100"]
    schedule = KernelSchedule.from_json(h100["schedule"])
    weights, constants = art.buffer("weights"), bytes(art.buffer("constants"))
    tp = h100.get("tensor_parallel")
    if tp is None:
        return ReferenceDevice(schedule, weights, constants, kv_blocks)
    schedules = [schedule, *(KernelSchedule.from_json(x) for x in tp["schedules"])]
    return TensorParallelDevice([
        ReferenceDevice(x, weights[w:w + x.weights_bytes], constants[c:c + x.constants_bytes],
                        kv_blocks)
        for x, w, c in zip(schedules, tp["weights"], tp["constants"], strict=True)])


class TensorParallelDevice:
    """The ranks of a tensor-parallel plan on the CPU, in lockstep: each step's launch on every
    rank, each collective over the ranks' arenas with numpy (float32 sums in rank order, the
    gathered column blocks side by side). The host's view is rank 0's schedule: an io write
    goes to every rank's io region (each rank's io region has the same fields at the same
    offsets inside it), results are read from rank 0 (the sampler runs replicated)."""

    def __init__(self, ranks: list[ReferenceDevice]):
        self.ranks = ranks
        self.schedule = ranks[0].schedule
        self.kv_blocks = ranks[0].kv_blocks
        for d in ranks[1:]:
            if d.schedule.io != _shifted(self.schedule, d.schedule.io_offset) \
                    or d.schedule.entries.keys() != self.schedule.entries.keys():
                raise ContractError("the ranks' schedules differ in io fields or entry points")

    def write(self, offset: int, data: bytes) -> None:
        base = self.schedule.io_offset
        if not (base <= offset and offset + len(data) <= base + self.schedule.io_bytes):
            raise ContractError("a tensor-parallel host writes only the io region")
        for d in self.ranks:
            d.write(d.schedule.io_offset + offset - base, data)

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.ranks[0].read(offset, nbytes)

    def run(self, entry: str) -> None:
        steps = [d.schedule.entries[entry].launches for d in self.ranks]
        if len({len(s) for s in steps}) != 1:
            raise ContractError(f"{entry}: the ranks' schedules have different step counts")
        for i, first in enumerate(steps[0]):
            at = [s[i] for s in steps]
            if isinstance(first, Collective):
                if not all(isinstance(x, Collective) and (x.op, x.rows, x.cols)
                           == (first.op, first.rows, first.cols) for x in at):
                    raise ContractError(f"{entry} step {i}: the ranks reach different steps")
                self.collective(at)
            else:
                for d, x in zip(self.ranks, at, strict=True):
                    if not isinstance(x, Launch):
                        raise ContractError(f"{entry} step {i}: the ranks reach different "
                                            "steps")
                    d.launch(x)

    def collective(self, steps: list[Collective]) -> None:
        c = steps[0]
        n = c.rows * c.cols
        parts = [d.mem[x.src:x.src + 4 * n].view(np.float32).reshape(c.rows, c.cols)
                 for d, x in zip(self.ranks, steps, strict=True)]
        if c.op == "all_reduce":
            out = parts[0].copy()
            for p in parts[1:]:
                out += p
        elif c.op == "all_gather":
            out = np.concatenate(parts, axis=1)
        else:
            raise ContractError(f"collective {c.op!r}")
        for d, x in zip(self.ranks, steps, strict=True):
            d.write(x.dst, out.tobytes())


def _shifted(schedule: KernelSchedule, io_offset: int) -> dict:
    """`schedule`'s io fields moved to an io region at `io_offset`."""
    return {k: replace(f, offset=f.offset - schedule.io_offset + io_offset)
            for k, f in schedule.io.items()}
