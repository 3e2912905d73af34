"""benchmarks/serve_fake.py (rvrun serve over a simulated device): bad flags and an artifact it
cannot serve are refused with one error line after argparse's usage, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "serve_fake.py"


def test_the_simulated_server_refuses_bad_arguments_in_one_line(tmp_path) -> None:
    junk = tmp_path / "junk.rvp"
    junk.write_bytes(b"not an artifact")
    cases = [([str(junk)], "junk.rvp"), ([str(tmp_path / "none.rvp")], "none.rvp"),
             ([str(junk), "--concurrency", "0,8"], "--concurrency"),
             ([str(junk), "--concurrency", "x"], "--concurrency"),
             ([str(junk), "--requests", "-1"], "--requests"),
             ([str(junk), "--prompt-tokens", "nan"], "--prompt-tokens"),
             ([str(junk), "--output-tokens", "0"], "--output-tokens")]
    for args, says in cases:
        r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2, (args, r.stderr)
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("serve_fake.py: error:") and says in last, (args, r.stderr)
        assert "Traceback" not in r.stderr
