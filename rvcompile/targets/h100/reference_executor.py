"""The H100 schedule on the CPU: a numpy arena and, per launch, its kernel entry's numpy reference
(registry.py; each declared beside its kernel, contract.py) applied to the launch's named
arguments exactly as the CUDA kernel reads them. CI checks the H100 plan (lowering, weight
layout, memory plan, KV paging, io) against the oracle with it, no GPU needed.

    dev = reference_device(artifact)        # write / read / run, like the CUDA device
    ex = ScheduledExecutor(dev.schedule, dev)   # the runtime's executor over it (tests compose
    m = Model(artifact, ex)                     # the two: targets never import the runtime)

Every launch is checked against its entry when the device is made: the kernel declared, in the
module that defines it, with the entry's arguments in its order (ContractError otherwise). A
parameter block's argument (kind "params") reaches the reference as a contract.ParamsValue: the
schedule's template by its name, and the roles' arena offsets.
"""

from __future__ import annotations

import numpy as np

from rvcompile.artifacts import Artifact
from rvcompile.artifacts.kernel_schedule import KernelSchedule, Launch
from rvcompile.targets.h100.contract import Call, ContractError, Entry, ParamsValue
from rvcompile.targets.h100.registry import ENTRIES


class ReferenceDevice:
    def __init__(self, schedule: KernelSchedule, weights: memoryview, constants: bytes):
        self.schedule = schedule
        self.entries = {x.kernel: _entry(x) for e in schedule.entries.values()
                        for x in e.launches}
        self.mem = np.zeros(schedule.arena_bytes, np.uint8)
        self.mem[:schedule.weights_bytes] = np.frombuffer(weights, np.uint8)
        c = schedule.constants_offset
        self.mem[c:c + len(constants)] = np.frombuffer(constants, np.uint8)

    def write(self, offset: int, data: bytes) -> None:
        self.mem[offset:offset + len(data)] = np.frombuffer(data, np.uint8)

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.mem[offset:offset + nbytes].tobytes()

    def run(self, entry: str) -> None:
        for launch in self.schedule.entries[entry].launches:
            self.launch(launch)

    def launch(self, launch: Launch) -> None:
        """One launch's reference over the arena."""
        entry = self.entries[launch.kernel]
        args = {a.name: None if a.kind == "null" else self._params(a.value) if a.kind == "params"
                else a.value for a in launch.args}
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


def reference_device(art: Artifact) -> ReferenceDevice:
    """The CPU device for `art`'s kernel schedule, its arena holding the weights and constants."""
    schedule = KernelSchedule.from_json(art.manifest["h100"]["schedule"])
    return ReferenceDevice(schedule, art.buffer("weights"), bytes(art.buffer("constants")))
