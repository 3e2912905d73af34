"""What a build costs: run `rvcompile build ARGS...` in a child process and report its wall time,
its peak resident memory and its CPU time and the artifact's size; optionally as JSON.

Two peaks: `peak_rss_gb`, the largest of the build and the programs it ran (ru_maxrss from
wait4, what /usr/bin/time -v reports: on h100 targets a cold cubin cache's nvcc is in it), and
`build_process_peak_rss_gb`, the build's own Python process (its VmHWM, polled), which is where
the weights go through.

    python benchmarks/build_cost.py --json out.json -- /data/g12-hf --target tpu-int8 -o g12.rvp

Page cache is not resident memory: reading a 24 GB checkpoint and writing its artifact leaves
the kernel's cache full, but the process itself holds only what it has mapped or allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

BUILD = "from rvcompile.cli import app; app()"


def run_build(build_args: list[str]) -> dict:
    """Run the build; its cost as a dict (exit status included: a failed build is reported)."""
    out = Path(build_args[build_args.index("-o") + 1]) if "-o" in build_args else None
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", BUILD, "build", *build_args])
    own_peak = 0
    while True:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            break
        own_peak = max(own_peak, _vm_hwm_kib(child.pid))
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4: tell Popen
    return {
        "build_args": build_args,
        "exit_status": child.returncode,
        "wall_s": round(wall, 1),
        "cpu_user_s": round(usage.ru_utime, 1),
        "cpu_sys_s": round(usage.ru_stime, 1),
        "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 2),  # ru_maxrss is in KiB on Linux
        "build_process_peak_rss_gb": round(own_peak * 1024 / 1e9, 2),
        "artifact_gb": (round(out.stat().st_size / 1e9, 2)
                        if out is not None and out.is_file() else None),
        "cores": len(os.sched_getaffinity(0)),
        "machine": platform.node(),
    }


def _vm_hwm_kib(pid: int) -> int:
    """The process's resident high-water mark so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument("build_args", nargs=argparse.REMAINDER,
                    help="after --: what `rvcompile build` is given")
    args = ap.parse_args(argv)
    build_args = args.build_args[1:] if args.build_args[:1] == ["--"] else args.build_args
    if not build_args:
        ap.error("give the build's arguments after --")
    result = run_build(build_args)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
