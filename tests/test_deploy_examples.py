"""examples/deploy and docs/DEPLOY.md against the code: every command line they give names a
real command and real options (read from the CLIs themselves: typer's command tree for
`rvcompile`, `--help` for `rvrun`), the extras and files they install exist, every Prometheus
metric DEPLOY.md names is one the server exposes, and check_artifact.py (run by rollout.sh
before a swap) passes a signed artifact and refuses an unsigned, foreign-signed or damaged
one in one line."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from prometheus_client import generate_latest

from rvcompile.artifacts.signature import load_signing_key, sign_artifact, write_keypair
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.cli import app
from rvcompile.runtime.serve.server import Metrics

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "examples" / "deploy"
DOC = ROOT / "docs" / "DEPLOY.md"
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-o)(?![\w-])")


@functools.cache
def rvcompile_options() -> dict[str, set[str]]:
    """`rvcompile` subcommand -> its option names, from typer's command tree."""
    group = typer.main.get_command(app)
    return {name: {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
            for name, cmd in group.commands.items()}


@functools.cache
def rvrun_options(sub: str) -> set[str]:
    """The options `rvrun [sub] --help` lists ("" for the plain run)."""
    argv = [sub, "--help"] if sub else ["--help"]
    p = subprocess.run([sys.executable, "-c", "import sys; from rvcompile.runtime.cli import main;"
                        " sys.exit(main())", *argv], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    return set(FLAG.findall(p.stdout))


def check_command(words: list[str], where: str) -> None:
    """An `rvcompile ...` or `rvrun ...` command line uses a real subcommand and real options."""
    prog = Path(words[0]).name
    flags = [w.split("=")[0] for w in words[1:] if FLAG.fullmatch(w.split("=")[0])]
    if prog == "rvcompile":
        assert words[1] in rvcompile_options(), f"{where}: no command rvcompile {words[1]}"
        known = rvcompile_options()[words[1]]
    else:
        assert prog == "rvrun", where
        sub = words[1] if words[1] in ("serve", "ppl") else ""
        known = rvrun_options(sub)
    for f in flags:
        assert f in known, f"{where}: {prog} {words[1]} has no option {f}"


def doc_commands() -> list[list[str]]:
    """Every `rvcompile ...` / `rvrun ...` line of DEPLOY.md's code blocks (continuations
    joined, comments cut)."""
    text = DOC.read_text()
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            words = shlex.split(line) if line else []
            while words and "=" in words[0] and not words[0].startswith("-"):
                words = words[1:]  # VAR=value prefixes
            if words and Path(words[0]).name in ("rvcompile", "rvrun"):
                out.append(words)
    return out


def test_deploy_doc_commands_are_real() -> None:
    commands = doc_commands()
    assert {Path(c[0]).name for c in commands} == {"rvcompile", "rvrun"}
    assert any(c[1:2] == ["serve"] for c in commands)
    for words in commands:
        check_command(words, f"DEPLOY.md: {' '.join(words)}")


def test_dockerfile_installs_and_runs_real_things() -> None:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    (spec,) = re.findall(r"pip install [^&]*'/src\[([a-z0-9,-]+)\]'", text)
    assert spec.split(",") == ["h100", "serve"] and all(e in extras for e in spec.split(","))
    for line in re.findall(r"^COPY (.+) /src/?\S*$", text, re.M):
        for path in line.split():
            assert (ROOT / path).exists(), f"Dockerfile copies {path}, which is not in the repo"
    (cmd,) = re.findall(r"^CMD (\[.*\])$", text, re.M)
    words = json.loads(cmd)
    assert words[:2] == ["rvrun", "serve"]
    check_command(words, "Dockerfile CMD")
    assert words[words.index("--host") + 1] == "0.0.0.0"  # reachable from outside the container
    assert "/health" in text and "-v /srv/rvcompile/artifacts:/artifacts:ro" in text


def test_systemd_unit_runs_real_things() -> None:
    text = (DEPLOY / "rvrun.service").read_text().replace("\\\n", " ")
    (exec_start,) = re.findall(r"^ExecStart=(.+)$", text, re.M)
    words = shlex.split(exec_start)
    assert Path(words[0]).name == "rvrun" and words[1] == "serve"
    check_command(words, "rvrun.service ExecStart")
    drain = float(words[words.index("--drain-timeout") + 1])
    (stop,) = re.findall(r"^TimeoutStopSec=(\d+)$", text, re.M)
    assert int(stop) > drain, "systemd must wait longer than the drain before SIGKILL"
    # the key comes from the environment file: the variable rvrun serve reads
    assert "RVRUN_API_KEY" in text
    assert "RVRUN_API_KEY" in (ROOT / "rvcompile" / "runtime" / "cli.py").read_text()


def test_rollout_script_is_valid_sh_and_calls_the_checker() -> None:
    script = DEPLOY / "rollout.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["sh", "-n", str(script)], check=True)
    text = script.read_text()
    assert '"$here/check_artifact.py" "$dir/$name" --trusted-key "$key"' in text


def test_every_metric_deploy_md_names_is_exposed() -> None:
    stats = SimpleNamespace(running=0, waiting=0, kv_total={"full": 1}, kv_used={"full": 0},
                            prefix_queried=0, prefix_hit=0, preemptions=0)
    metrics = Metrics(SimpleNamespace(engine=SimpleNamespace(stats=lambda: stats)))
    metrics.requests.labels("/v1/completions", "200").inc()
    metrics.finished.labels("stop").inc()
    exposed = {line.split("{")[0].split(" ")[0]
               for line in generate_latest(metrics.registry).decode().splitlines()
               if line and not line.startswith("#")}
    exposed |= {n.removesuffix("_bucket") for n in exposed if n.endswith("_bucket")}  # histograms
    named = set(re.findall(r"\brvrun_[a-z_]+[a-z]\b", DOC.read_text()))
    assert len(named) >= 8
    assert named <= exposed, sorted(named - exposed)


@pytest.fixture(scope="module")
def signed(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(a tiny artifact signed by key a, a's public key, another key's public key)."""
    d = tmp_path_factory.mktemp("deploy")
    art = build_artifact("gemma-4-tiny", d / "tiny.rvp",
                         BuildOptions(target="tpu-bf16", max_context=64, prefill_buckets=(16,),
                                      max_seqs=1, platforms=("cpu",)),
                         random_weights=True, progress=False, log=lambda *_: None).path
    a_key, a_pub, _ = write_keypair(d / "a")
    _, b_pub, _ = write_keypair(d / "b")
    sign_artifact(art, load_signing_key(a_key), "release")
    return art, a_pub, b_pub


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEPLOY / "check_artifact.py"), *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_check_artifact_passes_a_signed_artifact(signed) -> None:
    art, a_pub, _ = signed
    p = check(str(art), "--trusted-key", str(a_pub))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"{art}: OK (tpu-bf16, signed by a trusted key)"


def test_check_artifact_refuses_in_one_line(signed, tmp_path: Path) -> None:
    art, a_pub, b_pub = signed
    damaged = tmp_path / "damaged.rvp"
    data = bytearray(art.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the weights
    damaged.write_bytes(bytes(data))
    for args, needle in (([str(art), "--trusted-key", str(b_pub)], "not by a trusted key"),
                         ([str(damaged), "--trusted-key", str(a_pub)], "sha256"),
                         ([str(tmp_path / "absent.rvp"), "--trusted-key", str(a_pub)],
                          "absent.rvp")):
        p = check(*args)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1, p.stderr
        assert lines[0].startswith("check_artifact: error: ") and needle in lines[0], lines[0]
