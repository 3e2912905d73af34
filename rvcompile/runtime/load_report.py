"""What one `runtime.load` cost, phase by phase: `Model.load_report`, printed by `rvrun` and
`rvrun serve` when they start (one compact block on stderr) and written by
benchmarks/cold_start.py.

The phases, in the order a load runs them: open (Artifact.open: header, tables, padding,
manifest digest), check (manifest schema; the small sections hashed and parsed), import (the
runtime's own modules: jax, or cuda-python), verify (the
other sections re-hashed before any upload: on XLA all of them, on the H100 all but the
weights), upload (the weights to the device; on the H100 the weights are read once and each
piece hashed as it streams, and the read and hash seconds are thread-seconds summed over the
streaming threads), cubin load, graph capture and warm-up (H100: they run while the weights
upload, so they add no wall time unless they outlast it), programs (XLA: the exported programs
deserialized and checked), compile (XLA: the programs compiled, from jax's persistent cache
when it has them, or prepared or precompiled executables loaded); `other` is the wall time no
phase accounts for, and the CPU seconds say what the load cost on a machine busy with other
work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rvcompile.runtime.executor_api import LoadTimes


@dataclass(frozen=True)
class LoadReport:
    artifact: str  # the file's name
    runtime: str  # "xla" or "h100"
    open_s: float  # open + header checks
    check_s: float  # manifest schema, small sections hashed and parsed
    import_s: float  # the runtime's modules imported (jax for XLA; cuda-python for H100)
    executor: LoadTimes  # everything after: verify, upload, cubins, graphs, compile
    total_s: float  # runtime.load from call to return
    cpu_s: float  # this process's CPU seconds over the load, all threads (on a busy
    # machine: what the load itself cost, whatever the wall time)

    @property
    def other_s(self) -> float:
        """Wall seconds no phase accounts for (the machine checks, KV pools allocated, ...);
        phases that ran during the upload count once, in the upload."""
        e = self.executor
        counted = sum(s for name, s in self.phases() if name not in e.overlapped)
        return max(0.0, self.total_s - counted)

    @property
    def upload_gb_s(self) -> float:
        """Weight bytes per second of upload wall time, in GB/s (1e9)."""
        e = self.executor
        return e.weight_bytes / e.upload_s / 1e9 if e.upload_s > 0 else 0.0

    def phases(self) -> tuple[tuple[str, float], ...]:
        """(name, seconds) of the phases this runtime has, in load order."""
        e = self.executor
        rows = [("open", self.open_s), ("check", self.check_s), ("import", self.import_s),
                ("verify", e.verify_s)]
        if self.runtime == "h100":
            rows += [("upload", e.upload_s), ("cubin load", e.cubin_load_s),
                     ("graph capture", e.graph_capture_s), ("warm-up", e.warm_up_s)]
        else:
            rows += [("programs", e.programs_s), ("upload", e.upload_s),
                     ("compile", e.compile_s)]
        return tuple(rows)

    def lines(self, prefix: str = "rvrun") -> list[str]:
        """The compact block rvrun prints: the phases on one line, the weights on another."""
        e = self.executor
        parts = [f"{name} {s:.2f}" + (" (during upload)" if name in e.overlapped else "")
                 for name, s in self.phases()]
        parts.append(f"other {self.other_s:.2f}")
        out = [f"{prefix}: load {self.total_s:.2f} s ({self.cpu_s:.2f} s CPU): "
               + " | ".join(parts)]
        how = ("read once, each piece sha256-checked as it streamed" if e.streamed and e.checked
               else "read once, not checked (--no-verify)" if e.streamed
               else "sha256-checked before the upload" if e.checked
               else "not checked (--no-verify)")
        line = (f"{prefix}: weights {e.weight_bytes / 1e9:.3f} GB uploaded in {e.upload_s:.2f} s "
                f"({self.upload_gb_s:.2f} GB/s), {how}")
        if e.streamed:
            line += (f"; read {e.read_s:.2f} s, hash {e.hash_s:.2f} s over {e.threads} "
                     "threads (thread-seconds)")
        out.append(line)
        return out

    def as_json(self) -> dict:
        """Every field (the executor's flattened in), plus upload_gb_s."""
        d = dataclasses.asdict(self)
        d.update(d.pop("executor"))
        d["overlapped"] = list(self.executor.overlapped)
        d["upload_gb_s"] = self.upload_gb_s
        d["other_s"] = self.other_s
        return d
