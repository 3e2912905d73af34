"""`rvcompile` and `rvrun` as a user runs them (subprocesses of the venv's console scripts):
build, inspect, verify, reproducible builds, generation, and every refusal, each a non-zero exit
with one stderr line naming the file (or tensor) and nothing left behind at the output path."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_output import without_progress
from safetensors.numpy import load_file, save_file

from rvcompile.artifacts import ArtifactError, ArtifactHeader, check_platform
from rvcompile.artifacts.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    decode_header_block,
    encode_header_block,
)

BIN = Path(sys.executable).parent
RVCOMPILE, RVRUN = str(BIN / "rvcompile"), str(BIN / "rvrun")
SMALL = ["--max-context", "128", "--prefill-buckets", "8,32", "--max-seqs", "2"]
TINY = ["gemma-4-tiny", "--target", "tpu-bf16", "--random-weights", "--seed", "0", *SMALL]


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"})


def one_error_line(p: subprocess.CompletedProcess, prog: str, *needles: str) -> str:
    """The process failed with exactly one stderr line `prog: error: ...` containing needles,
    after any progress lines of the phases it finished (`prog: PHASE done in 1.2 s`: stderr is
    not a terminal here)."""
    assert p.returncode != 0, p.stderr
    lines = without_progress(p.stderr)
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "tiny.rvp"
    p = run(RVCOMPILE, "build", *TINY, "-o", str(out))
    assert p.returncode == 0, p.stderr
    assert "wrote" in p.stderr
    return out


@pytest.fixture(scope="module")
def tiny_info(tiny) -> dict:
    p = run(RVCOMPILE, "inspect", str(tiny), "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def mutated(tiny: Path, tmp_path: Path, name: str = "bad.rvp") -> Path:
    dst = tmp_path / name
    shutil.copyfile(tiny, dst)
    return dst


# ---------------------------------------------------------------------------------------------
# Build, inspect, verify, run


def test_inspect_json(tiny, tiny_info):
    info = tiny_info
    assert info["model"] == "gemma-4-tiny"
    assert info["target"] == "tpu-bf16"
    assert info["passes"] == ["cast_bf16"]
    assert "cpu" in info["platforms"]
    assert info["entry_points"] == ["decode_2", "decode_loop_2", "logits_32", "prefill_32",
                                    "prefill_8"]  # the CLI builds the device-side loop
    assert info["max_seqs"] == 2 and info["max_context"] == 128
    assert info["requirements"]["runtime"] == "xla"
    assert info["jax_version"] and info["compiler_version"]
    assert sum(g["period"] * g["count"] for g in info["layer_groups"]) == 8  # tiny: 8 layers
    sections = info["sections"]
    assert {"weights", "programs", "tokenizer", "generation_config",
            "chat_template"} <= set(sections)
    data = tiny.read_bytes()
    step = info["piece_size"]
    for name, s in sections.items():
        assert s["offset"] % 4096 == 0 and s["offset"] >= HEADER_SIZE, name
        body = data[s["offset"]:s["offset"] + s["size"]]
        pieces = [hashlib.sha256(body[i:i + step]).digest() for i in range(0, len(body), step)]
        assert len(pieces) == s["pieces"], name
        assert hashlib.sha256(b"".join(pieces)).hexdigest() == s["digest"], name
    assert sections["weights"]["size"] > 1 << 20


def test_inspect_text_and_verify(tiny, tiny_info):
    p = run(RVCOMPILE, "inspect", str(tiny))
    assert p.returncode == 0, p.stderr
    for needle in ("gemma-4-tiny", "tpu-bf16", "cast_bf16", "sections:", "weights", "programs",
                   tiny_info["sections"]["weights"]["digest"][:16]):
        assert needle in p.stdout, needle
    p = run(RVCOMPILE, "verify", str(tiny))
    assert p.returncode == 0, p.stderr
    assert "OK" in p.stdout


def test_rebuild_is_byte_identical(tiny, tmp_path):
    again = tmp_path / "again.rvp"
    p = run(RVCOMPILE, "build", *TINY, "-o", str(again))
    assert p.returncode == 0, p.stderr
    assert sha256(again) == sha256(tiny)


def test_rvrun_generates(tiny):
    p = run(RVRUN, str(tiny), "--prompt", "Hello", "--max-tokens", "8", "--ignore-eos")
    assert p.returncode == 0, p.stderr
    summary = [line for line in p.stderr.splitlines() if line.startswith("[rvrun]")]
    assert len(summary) == 1, p.stderr
    assert "decode" in summary[0] and "new 8 tokens" in summary[0], summary[0]
    assert p.stdout.strip()


def test_rvrun_rejects_bad_arguments(tiny):
    p = run(RVRUN, str(tiny), "--prompt", "x", "--top-p", "0")
    one_error_line(p, "rvrun", "--top-p")


# ---------------------------------------------------------------------------------------------
# Refusals of damaged or foreign artifacts


def test_truncated_artifact_refused(tiny, tmp_path):
    bad = mutated(tiny, tmp_path, "truncated.rvp")
    with open(bad, "r+b") as f:
        f.truncate(bad.stat().st_size // 2)
    one_error_line(run(RVRUN, str(bad), "--prompt", "x"), "rvrun", "truncated.rvp", "truncated")
    one_error_line(run(RVCOMPILE, "inspect", str(bad)), "rvcompile", "truncated.rvp")
    one_error_line(run(RVCOMPILE, "verify", str(bad)), "rvcompile", "truncated.rvp")


def test_flipped_weight_byte_refused(tiny, tiny_info, tmp_path):
    bad = mutated(tiny, tmp_path, "flipped.rvp")
    w = tiny_info["sections"]["weights"]
    at = w["offset"] + w["size"] // 3
    with open(bad, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))
    one_error_line(run(RVRUN, str(bad), "--prompt", "x"), "rvrun", "flipped.rvp", "weights")
    one_error_line(run(RVCOMPILE, "verify", str(bad)), "rvcompile", "flipped.rvp", "weights")
    assert run(RVCOMPILE, "inspect", str(bad)).returncode == 0  # inspect does not hash


def test_newer_format_version_refused(tiny, tmp_path):
    bad = mutated(tiny, tmp_path, "future.rvp")
    with open(bad, "r+b") as f:
        f.seek(8)  # magic (8 bytes), then the uint32 format version
        assert struct.unpack("<I", f.read(4))[0] == FORMAT_VERSION
        f.seek(8)
        f.write(struct.pack("<I", FORMAT_VERSION + 1))
    line = one_error_line(run(RVRUN, str(bad), "--prompt", "x"), "rvrun", "future.rvp",
                          "newer")
    assert str(FORMAT_VERSION + 1) in line
    one_error_line(run(RVCOMPILE, "inspect", str(bad)), "rvcompile", "future.rvp", "newer")


def _with_platforms(src: Path, dst: Path, platforms: tuple[str, ...]) -> None:
    """A copy of `src` whose (checksummed) header lists only `platforms`."""
    data = bytearray(src.read_bytes())
    block = decode_header_block(bytes(data[:HEADER_SIZE]), src.name)
    header = dataclasses.replace(block.header, platforms=platforms)
    data[:HEADER_SIZE] = encode_header_block(dataclasses.replace(block, header=header), dst.name)
    dst.write_bytes(bytes(data))


def test_missing_platform_refused(tiny, tmp_path):
    bad = tmp_path / "tpuonly.rvp"
    _with_platforms(tiny, bad, ("tpu",))
    assert run(RVCOMPILE, "verify", str(bad)).returncode == 0  # a well-formed file ...
    line = one_error_line(run(RVRUN, str(bad), "--prompt", "x"), "rvrun", "tpuonly.rvp",
                          "platform")
    assert "cpu" in line  # ... built for tpu only, refused on this cpu machine


def test_check_platform():
    h = ArtifactHeader("0", "tpu-bf16", ("tpu", "cuda"), source="m.rvp")
    check_platform(h, "tpu")
    with pytest.raises(ArtifactError, match=r"^m\.rvp: built for platforms tpu, cuda; .* cpu$"):
        check_platform(h, "cpu")


# ---------------------------------------------------------------------------------------------
# Bad input to `rvcompile build`


@pytest.fixture
def ckpt(oracle_dir, tmp_path) -> Path:
    """A private copy of the "dense" oracle checkpoint, to damage."""
    _, src = oracle_dir("dense")
    return Path(shutil.copytree(src, tmp_path / "ckpt"))


def build_fails(model: str, tmp_path: Path, *needles: str, extra: tuple[str, ...] = ()) -> str:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "model.rvp"
    p = run(RVCOMPILE, "build", model, "--target", "xla-f32", *SMALL, *extra, "-o", str(out))
    line = one_error_line(p, "rvcompile", *needles)
    assert list(out_dir.iterdir()) == []  # no artifact, no temp file
    return line


def rewrite_tensor(ckpt: Path, name: str, fn) -> None:
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    tensors[name] = fn(tensors[name])
    save_file(tensors, path)


def test_unknown_preset(tmp_path):
    build_fails("gemma-4-nonesuch", tmp_path, "gemma-4-nonesuch", "preset",
                extra=("--random-weights",))


def test_missing_safetensors(ckpt, tmp_path):
    (ckpt / "model.safetensors").unlink()
    build_fails(str(ckpt), tmp_path, str(ckpt), "model.safetensors")


def test_corrupt_safetensors(ckpt, tmp_path):
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:40] = b"}" * 32  # the JSON header is no longer JSON
    path.write_bytes(bytes(data))
    build_fails(str(ckpt), tmp_path, str(path), "corrupt")


def test_truncated_safetensors(ckpt, tmp_path):
    path = ckpt / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1000)
    build_fails(str(ckpt), tmp_path, str(path), "truncated")


def test_tensor_shape_mismatch(ckpt, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_tensor(ckpt, name, lambda t: np.ascontiguousarray(t[:-2]))
    line = build_fails(str(ckpt), tmp_path, str(ckpt / "model.safetensors"), name, "shape")
    assert "[126, 64]" in line and "[128, 64]" in line


def test_config_shape_mismatch(ckpt, tmp_path):
    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["intermediate_size"] = 96
    cfg_path.write_text(json.dumps(cfg))
    line = build_fails(str(ckpt), tmp_path, "model.safetensors", ".mlp.", "shape")
    assert "96]" in line  # the expected shape comes from the edited config


@pytest.mark.parametrize("bad,kind", [(np.nan, "NaN"), (np.inf, "Inf"), (-np.inf, "Inf")])
def test_non_finite_weight(ckpt, tmp_path, bad, kind):
    name = "model.layers.4.self_attn.o_proj.weight"

    def poison(t):
        t = t.copy()
        t[3, 5] = bad
        return t

    rewrite_tensor(ckpt, name, poison)
    build_fails(str(ckpt), tmp_path, str(ckpt / "model.safetensors"), name, kind, "[3, 5]")


def test_unsupported_model_type(ckpt, tmp_path):
    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = "llama"
    cfg_path.write_text(json.dumps(cfg))
    build_fails(str(ckpt), tmp_path, str(cfg_path), "llama")


def test_failed_build_keeps_existing_artifact(ckpt, tiny, tmp_path):
    """A build that fails late (NaN found while streaming weights) leaves an existing file at
    the output path untouched and no temp file beside it."""
    out_dir = tmp_path / "keep"
    out_dir.mkdir()
    out = out_dir / "model.rvp"
    shutil.copyfile(tiny, out)
    before = sha256(out)
    rewrite_tensor(ckpt, "model.norm.weight", lambda t: np.full_like(t, np.nan))
    p = run(RVCOMPILE, "build", str(ckpt), "--target", "xla-f32", *SMALL, "-o", str(out))
    one_error_line(p, "rvcompile", "model.norm.weight", "NaN")
    assert [f.name for f in out_dir.iterdir()] == ["model.rvp"]
    assert sha256(out) == before
