"""What one `runtime.load` cost, phase by phase: `Model.load_report`, printed by `rvrun` and
`rvrun serve` when they start (one compact block on stderr) and written by
benchmarks/cold_start.py.

The phases, roughly in the order a load runs them: open (Artifact.open: header, tables, padding,
manifest digest), check (manifest schema and kernel schedule; the small sections hashed; an h100
artifact's cubins against its schedule), text check (the tokenizer and its vocabulary, the
generation config, the chat template parsed: on a thread of its own, alongside everything after
it, so it adds to the wall time only what the load waited for it: `text_waited_s`), import (the
runtime's own modules: jax, or cuda-python; an h100 one as soon as the file is open), context
(H100: the driver's context, opened on a thread of its own from the file's open, alongside the
checks, so this is what the load waited for it, and the GPU checked), verify (the other sections
re-hashed before any upload: on XLA all of them, on the H100 all but the weights), arena (H100:
allocated, zeroed, constants copied), upload (the weights to the device; on the H100 the weights
are read once through staging buffers the streaming threads allocate as they start, and the
read and hash seconds are thread-seconds summed over the streaming threads), gpu hash (H100,
when the artifact has the piece hash and small pieces: the weights' pieces hashed on the GPU
once uploaded, the digests compared with the artifact's; otherwise each piece is hashed on the
CPU as it streams, and the weights line says which ran), cubin load and graph capture (H100:
they run while the weights upload and are checked, so they add no wall time unless they
outlast it), warm-up (H100: the graphs uploaded, once every
check passed), finish (H100: staging freed, device synchronized), programs (XLA: the exported
programs deserialized and checked), compile (XLA: the programs compiled, from jax's persistent
cache when it has them, or prepared or precompiled executables checked: their sha256 and
operands; XLA deserializes each on its first call, which the report's last line says and that
call pays, about 0.2 s an entry for the default model on XLA:CPU); `other` is the wall time
no phase accounts for, and the CPU seconds say what the load cost on a machine busy with other
work.

Phases that ran alongside others are shown with their own seconds and how they overlapped, and
are not counted again in `other`. "Alongside" is not "free": the text check holds Python's GIL
while `tokenizers` parses, which stalls the streaming threads between their reads and hashes
(what it costs the upload shows as a lower upload rate) and any phase running Python meanwhile
(the cubins' check, which starts just after it, waits for it there).
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
    text_check_s: float = 0.0  # tokenizer, generation config, chat template parsed, on a
    # thread of its own alongside the rest of the load (wall seconds on that thread)
    text_waited_s: float = 0.0  # of which the load waited for it (what it added to total_s)

    @property
    def alongside(self) -> tuple[str, ...]:
        """The phases that ran alongside others: the text check, and what the executor did
        during its upload."""
        return ("text check", *self.executor.overlapped)

    @property
    def other_s(self) -> float:
        """Wall seconds no phase accounts for (the machine checks, KV pools sized, the model
        built, ...); phases that ran alongside others count once, in those (the text check:
        only what the load waited for it)."""
        counted = sum(s for name, s in self.phases() if name not in self.alongside)
        return max(0.0, self.total_s - counted - self.text_waited_s)

    @property
    def upload_gb_s(self) -> float:
        """Weight bytes per second of upload wall time, in GB/s (1e9)."""
        e = self.executor
        return e.weight_bytes / e.upload_s / 1e9 if e.upload_s > 0 else 0.0

    def phases(self) -> tuple[tuple[str, float], ...]:
        """(name, seconds) of the phases this runtime has, in load order."""
        e = self.executor
        rows = [("open", self.open_s), ("check", self.check_s),
                ("text check", self.text_check_s), ("import", self.import_s)]
        if self.runtime == "h100":
            rows += [("context", e.context_s), ("verify", e.verify_s), ("arena", e.arena_s),
                     ("upload", e.upload_s),
                     *((("gpu hash", e.gpu_hash_s),) if e.hashed_on == "gpu" else ()),
                     ("cubin load", e.cubin_load_s),
                     ("graph capture", e.graph_capture_s), ("warm-up", e.warm_up_s),
                     ("finish", e.finish_s)]
        else:
            rows += [("verify", e.verify_s), ("programs", e.programs_s), ("upload", e.upload_s),
                     ("compile", e.compile_s)]
        return tuple(rows)

    def lines(self, prefix: str = "rvrun") -> list[str]:
        """The compact block rvrun prints: the phases on one line, the weights on another."""
        e = self.executor

        def how(name: str) -> str:
            if name == "text check":
                during = e.checks_during_upload_s
                return (" (alongside" + (f", {during:.2f} during upload" if during else "")
                        + f"; waited {self.text_waited_s:.2f})")
            if name == "context" and e.context_open_s > e.context_s:
                return f" (opened in {e.context_open_s:.2f}, alongside the checks)"
            return " (during upload)" if name in e.overlapped else ""

        parts = [f"{name} {s:.2f}{how(name)}" for name, s in self.phases()]
        parts.append(f"other {self.other_s:.2f}")
        out = [f"{prefix}: load {self.total_s:.2f} s ({self.cpu_s:.2f} s CPU): "
               + " | ".join(parts)]
        how = ("read once, sha256-checked on the GPU once uploaded" if e.hashed_on == "gpu"
               else "read once, each piece sha256-checked as it streamed"
               if e.streamed and e.checked
               else "read once, not checked (--no-verify)" if e.streamed
               else "sha256-checked before the upload" if e.checked
               else "not checked (--no-verify)")
        line = (f"{prefix}: weights {e.weight_bytes / 1e9:.3f} GB uploaded in {e.upload_s:.2f} s "
                f"({self.upload_gb_s:.2f} GB/s), {how}")
        if e.hashed_on == "gpu":
            line += (f"; read {e.read_s:.2f} s over {e.threads} threads (thread-seconds), "
                     f"gpu hash {e.gpu_hash_s:.3f} s")
        elif e.streamed:
            line += (f"; read {e.read_s:.2f} s, hash {e.hash_s:.2f} s over {e.threads} "
                     "threads (thread-seconds)")
        out.append(line)
        if e.deferred:
            out.append(f"{prefix}: executables checked, not yet deserialized: "
                       f"{', '.join(e.deferred)} (each on its first call, which waits for it)")
        return out

    def as_json(self) -> dict:
        """Every field (the executor's flattened in), plus upload_gb_s."""
        d = dataclasses.asdict(self)
        d.update(d.pop("executor"))
        d["checked"] = self.executor.checked
        d["overlapped"] = list(self.executor.overlapped)
        d["deferred"] = list(self.executor.deferred)
        d["alongside"] = list(self.alongside)
        d["upload_gb_s"] = self.upload_gb_s
        d["other_s"] = self.other_s
        return d
