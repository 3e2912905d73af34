"""How many KV blocks of each kind an h100 artifact's pools hold, chosen at load (issue 14), as
vLLM's gpu_memory_utilization does: the arena's fixed part (weights, constants, io, activations)
is the build's; the pools after it take what is left of a share of the GPU's memory.

The budget is `utilization` (default DEFAULT_UTILIZATION) of the GPU's total memory, or its free
memory when that is less (another process holds some), less the fixed part, HEADROOM (driver,
modules, graphs) and each pool's alignment. Kinds given explicitly (`kv_blocks`, rvrun serve's
--kv-blocks / --kv-sliding-blocks) take exactly that many blocks, which must fit in free memory;
the other kinds share the rest of the budget evenly in block count (a sequence shorter than the
window holds as many blocks of each kind), none more than `max_num_seqs` (default: the artifact's
max_seqs) whole tables, the most the running sequences can hold at once: a capped kind's share goes
to the others, and what none can use stays free. Every kind must get at least one longest
sequence's blocks (the context, or `max_model_len`), else the load fails with one line naming the
numbers.

Pure arithmetic over the schedule and the memory figures: tests run it on the CPU.
"""

from __future__ import annotations

from rvcompile.artifacts import ArtifactError
from rvcompile.artifacts.kernel_schedule import POOL_ALIGN, KernelSchedule

DEFAULT_UTILIZATION = 0.90  # of the GPU's total memory, as vLLM's default
HEADROOM = 256 << 20  # driver and module memory beyond the arena


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def choose_blocks(schedule: KernelSchedule, *, free: int, total: int, name: str,
                  utilization: float | None = None, kv_blocks: dict[str, int] | None = None,
                  max_num_seqs: int | None = None,
                  max_model_len: int | None = None) -> dict[str, int]:
    """Blocks per KV kind of `schedule` on a GPU with `free` of `total` bytes free (module
    docstring); `name`: the artifact's file name, for the errors (ArtifactError, one line)."""
    u = DEFAULT_UTILIZATION if utilization is None else utilization
    if not 0 < u <= 1:
        raise ArtifactError(f"{name}: gpu_memory_utilization {u}: expected a fraction in (0, 1]")
    kinds = {k.name: k for k in schedule.kv.kinds}
    asked = dict(kv_blocks or {})
    unknown = sorted(set(asked) - set(kinds))
    if unknown:
        raise ArtifactError(f"{name}: has no KV kind {unknown[0]!r} (kinds: "
                            f"{', '.join(kinds)})")
    for kind, n in asked.items():
        if type(n) is not int or n < 1:
            raise ArtifactError(f"{name}: {n!r} {kind} KV blocks; need at least 1")
    per_block = {k: schedule.kv.block_bytes(k) for k in kinds}
    fixed = schedule.arena_bytes + HEADROOM + POOL_ALIGN * len(schedule.kv.pools)
    asked_bytes = sum(n * per_block[k] for k, n in asked.items())
    if fixed + asked_bytes > free:
        raise ArtifactError(
            f"{name}: the KV blocks asked for ({', '.join(f'{n} {k}' for k, n in asked.items())}"
            f": {_gib(asked_bytes)}) and the arena's fixed part ({_gib(schedule.arena_bytes)}) "
            f"need {_gib(fixed + asked_bytes)}; the GPU has {_gib(free)} free")
    budget = min(int(u * total), free) - fixed - asked_bytes
    blocks = dict(asked) | _share(max(budget, 0), {k: per_block[k] for k in kinds
                                                   if k not in asked},
                                  {k: (max_num_seqs or schedule.max_seqs) * kinds[k].table_width
                                   for k in kinds})
    length = max_model_len or schedule.max_context
    need = {k: min(kinds[k].table_width, -(-length // schedule.kv.block_size)) for k in kinds}
    if any(blocks[k] < need[k] for k in kinds if k not in asked):
        need_bytes = sum(need[k] * per_block[k] for k in kinds if k not in asked)
        raise ArtifactError(
            f"{name}: {_gib(min(int(u * total), free))} of GPU memory (utilization {u:g} of "
            f"{_gib(total)}, {_gib(free)} free) cannot hold the arena's fixed part "
            f"({_gib(schedule.arena_bytes)}), {_gib(asked_bytes)} of KV blocks asked for and "
            f"one {length}-token sequence's KV blocks ({_gib(need_bytes)}); raise "
            "gpu_memory_utilization or lower max_model_len")
    return {k: blocks[k] for k in kinds}


def _share(budget: int, per_block: dict[str, int], cap: dict[str, int]) -> dict[str, int]:
    """The same block count for every kind of `per_block` within `budget` bytes, but no kind
    beyond its cap; a capped kind's unused share goes to the rest."""
    out: dict[str, int] = {}
    left = dict(per_block)
    while left:
        n = budget // sum(left.values())
        capped = [k for k in left if cap[k] <= n]
        if not capped:
            return out | {k: n for k in left}
        for k in capped:
            out[k] = cap[k]
            budget -= cap[k] * left.pop(k)
    return out
