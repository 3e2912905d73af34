"""`rvcompile build` refuses what is wrong: one test per bad input, each a one-line error naming
the config.json key, file or CLI option, exit status 2, no traceback and nothing at the output
path; a build stopped by SIGTERM/SIGINT leaves no temp file; artifacts are 0666 less the umask.

Bad inputs tried (the parametrized lists below): BAD_CONFIG (config.json fields), BAD_HEADERS
(safetensors headers), BAD_TOKENIZERS (tokenizer.json and generation_config.json), BAD_OPTIONS
(build options).
"""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cli_output import without_progress
from tokenizers import Tokenizer
from typer.testing import CliRunner

from rvcompile.artifacts import ArtifactHeader, ArtifactWriter
from rvcompile.cli import app
from rvcompile.model.config import ConfigError, Gemma4Config
from rvcompile.model.presets import get_preset
from rvcompile.sources.checkpoint import load_model_source
from rvcompile.sources.model_source import CheckpointError
from rvcompile.sources.safetensors_file import read_safetensors_header
from rvcompile.sources.tokenizer_files import synthetic_tokenizer_json

SMALL = ["--max-context", "128", "--prefill-buckets", "8,32", "--max-seqs", "2"]


def build_refused(tmp_path: Path, model: str, *args: str, needles: tuple[str, ...]) -> str:
    """`rvcompile build MODEL ARGS` (in process): exit 2, one stderr line `rvcompile: error:`
    containing every needle, no traceback, and an empty output directory."""
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    r = CliRunner().invoke(app, ["build", model, *args, "-o", str(out_dir / "m.rvp")])
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert isinstance(r.exception, SystemExit), r.exception  # no traceback
    lines = without_progress(r.output)  # the phases done before the refusal set aside
    assert len(lines) == 1, r.output
    assert lines[0].startswith("rvcompile: error: "), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert list(out_dir.iterdir()) == []  # no artifact, no temp file
    return lines[0]


# ---------------------------------------------------------------------------------------------
# config.json fields


def tiny_config() -> dict[str, Any]:
    """gemma-4-tiny's config.json: every feature on (K=V, PLE, KV sharing, MoE)."""
    return get_preset("gemma-4-tiny").to_hf_dict()


def at(d: dict, path: str, value: Any) -> dict:
    """A copy of `d` with the dotted `path` set to `value`."""
    d = copy.deepcopy(d)
    *parents, leaf = path.split(".")
    node = d
    for p in parents:
        node = node[p]
    node[leaf] = value
    return d


def without(d: dict, key: str) -> dict:
    d = copy.deepcopy(d)
    del d[key]
    return d


LAYERS8 = ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3
# (config.json key set, bad value, what the error line must contain)
BAD_CONFIG = [
    ("num_key_value_heads", 0, "num_key_value_heads is 0"),
    ("num_key_value_heads", -2, "num_key_value_heads is -2"),
    ("num_attention_heads", 0, "num_attention_heads is 0"),
    ("num_attention_heads", 3, "num_attention_heads 3 is not a multiple"),
    ("hidden_size", 0, "hidden_size is 0"),
    ("hidden_size", 128.5, "hidden_size is 128.5"),
    ("hidden_size", "128", 'hidden_size is "128"'),
    ("vocab_size", 0, "vocab_size is 0"),
    ("vocab_size", True, "vocab_size is true"),
    ("num_hidden_layers", 0, "num_hidden_layers is 0"),
    ("num_hidden_layers", 7, "layer_types has 8 entries but num_hidden_layers is 7"),
    ("head_dim", 0, "head_dim is 0"),
    ("head_dim", 33, "head_dim 33 must be even"),
    ("global_head_dim", 0, "global_head_dim is 0"),
    ("global_head_dim", 63, "head_dim 63 must be even"),
    ("num_global_key_value_heads", 0, "num_global_key_value_heads is 0"),
    ("intermediate_size", 0, "intermediate_size is 0"),
    ("sliding_window", 0, "sliding_window is 0"),
    ("sliding_window", -1, "sliding_window is -1"),
    ("max_position_embeddings", 0, "max_position_embeddings is 0"),
    ("rms_norm_eps", 0, "rms_norm_eps is 0"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps is -1e-06"),
    ("rms_norm_eps", math.nan, "rms_norm_eps is NaN"),
    ("rms_norm_eps", "1e-6", 'rms_norm_eps is "1e-6"'),
    ("final_logit_softcapping", 0, "final_logit_softcapping is 0"),
    ("final_logit_softcapping", -30.0, "final_logit_softcapping is -30.0"),
    ("final_logit_softcapping", math.inf, "final_logit_softcapping is Infinity"),
    ("rope_parameters.sliding_attention.rope_theta", 0,
     "rope_parameters.sliding_attention.rope_theta is 0"),
    ("rope_parameters.full_attention.rope_theta", -1e6,
     "rope_parameters.full_attention.rope_theta is -1000000.0"),
    ("rope_parameters.full_attention.partial_rotary_factor", 1.5,
     "rope_parameters.full_attention.partial_rotary_factor is 1.5"),
    ("rope_parameters.full_attention.factor", 0, "rope_parameters.full_attention.factor is 0"),
    ("rope_parameters.sliding_attention.rope_type", "yarn",
     'rope_parameters.sliding_attention.rope_type "yarn"'),
    ("rope_parameters.sliding_attention.factor", 8.0,
     "rope_parameters.sliding_attention.factor is 8.0"),
    ("rope_parameters", "default", 'rope_parameters is "default"'),
    ("hidden_activation", "gelu", 'hidden_activation "gelu"'),
    ("hidden_activation", "silu", 'hidden_activation "silu"'),
    ("attention_bias", True, "attention_bias is true"),
    ("use_bidirectional_attention", "all", 'use_bidirectional_attention is "all"'),
    ("layer_types", [*LAYERS8, "chunked_attention"], 'layer_types[7] is "chunked_attention"'),
    ("layer_types", [*LAYERS8, "sliding_attention"], "the last layer must be full_attention"),
    ("layer_types", "full_attention", 'layer_types is "full_attention"'),
    ("num_kv_shared_layers", 8, "num_kv_shared_layers is 8"),
    ("num_kv_shared_layers", -1, "num_kv_shared_layers is -1"),
    ("num_experts", 0, "num_experts is 0"),
    ("top_k_experts", 9, "top_k_experts is 9"),
    ("top_k_experts", 0, "top_k_experts is 0"),
    ("moe_intermediate_size", 0, "moe_intermediate_size is 0"),
    ("hidden_size_per_layer_input", -1, "hidden_size_per_layer_input is -1"),
    ("vocab_size_per_layer_input", 512, "vocab_size_per_layer_input 512 is smaller"),
    ("bos_token_id", 1024, "bos_token_id is 1024"),
    ("pad_token_id", -1, "pad_token_id is -1"),
    ("eos_token_id", [1, 5000], "eos_token_id is 5000"),
    ("eos_token_id", "1", 'eos_token_id is "1"'),
    ("attention_k_eq_v", "true", 'attention_k_eq_v is "true"'),
    ("enable_moe_block", 1, "enable_moe_block is 1"),
    ("per_layer_config", {"3": {"intermediate_size": 10}}, "per_layer_config.3.intermediate_size"),
    ("per_layer_config", {"99": {"head_dim": 64}}, "per_layer_config.99: no such layer"),
    ("per_layer_config", {"3": {"head_dim": 0}}, "per_layer_config.3.head_dim is 0"),
    ("per_layer_config", {"x": {"head_dim": 64}}, "per_layer_config key 'x'"),
    ("tie_word_embeddings", False, "tie_word_embeddings is false"),
]
MISSING_CONFIG = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "intermediate_size", "sliding_window"]


def test_good_config_round_trips() -> None:
    """The base every bad case edits is accepted (each case fails for its own field)."""
    cfg = Gemma4Config.from_hf_dict(tiny_config())
    assert cfg.to_hf_dict() == tiny_config()


@pytest.mark.parametrize("key,value,needle", BAD_CONFIG,
                         ids=[f"{k}={v!r}" for k, v, _ in BAD_CONFIG])
def test_bad_config_field(tmp_path: Path, key: str, value: Any, needle: str) -> None:
    raw = at(tiny_config(), key, value)
    with pytest.raises(ConfigError) as e:
        Gemma4Config.from_hf_dict(raw)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))  # NaN and Infinity as Python writes them
    line = build_refused(tmp_path, str(d), "--target", "xla-f32", "--random-weights", *SMALL,
                         needles=(str(d / "config.json"),))
    assert needle in line, line


@pytest.mark.parametrize("key", MISSING_CONFIG)
def test_missing_config_field(tmp_path: Path, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        Gemma4Config.from_hf_dict(without(tiny_config(), key))
    assert f"required field {key!r} is missing" in str(e.value)


def test_accepted_activations_and_no_softcap() -> None:
    for act in ("gelu_pytorch_tanh", "gelu_new", "gelu_python_tanh"):
        Gemma4Config.from_hf_dict(at(tiny_config(), "hidden_activation", act))
    assert Gemma4Config.from_hf_dict(
        at(tiny_config(), "final_logit_softcapping", None)).final_logit_softcapping is None


# ---------------------------------------------------------------------------------------------
# safetensors headers


def safetensors_bytes(header: dict | bytes, data_len: int, *, length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + bytes(data_len)


def f32(shape: list, begin: int, end: int, dtype: str = "F32") -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# (case id, file bytes, what the error line must contain)
BAD_HEADERS = [
    ("overlap", safetensors_bytes({"a": f32([4], 0, 16), "b": f32([4], 8, 24)}, 24),
     "tensors a and b overlap"),
    ("nested-overlap", safetensors_bytes(
        {"a": f32([8], 0, 32), "b": f32([1], 12, 16), "c": f32([4], 32, 48)}, 48),
     "tensors a and b overlap"),
    ("out-of-bounds", safetensors_bytes({"a": f32([8], 0, 32)}, 16),
     "tensor a data ends at byte 32 but the data section has only 16 bytes"),
    ("unknown-dtype", safetensors_bytes({"a": f32([4], 0, 16, "F12")}, 16),
     'tensor a: unknown dtype "F12"'),
    ("missing-dtype", safetensors_bytes({"a": {"shape": [4], "data_offsets": [0, 16]}}, 16),
     "tensor a: unknown dtype null"),
    ("short-byte-length", safetensors_bytes({"a": f32([4], 0, 12)}, 16),
     "tensor a: has 12 bytes but F32[4] needs 16"),
    ("long-byte-length", safetensors_bytes({"a": f32([2, 2], 0, 32, "BF16")}, 32),
     "tensor a: has 32 bytes but BF16[2, 2] needs 8"),
    ("bad-json", safetensors_bytes(b"{not json}", 16), "not valid JSON"),
    ("not-utf8", safetensors_bytes(b"\xff\xfe{}", 16), "not valid JSON"),
    ("json-list", safetensors_bytes(b"[1, 2]", 16), "not a JSON object"),
    ("duplicate-name", safetensors_bytes(
        b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
        b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', 8),
     "tensor a appears twice"),
    ("huge-header-length", safetensors_bytes({"a": f32([1], 0, 4)}, 4, length=1 << 40),
     "header length 1099511627776 is above the 104857600-byte limit"),
    ("header-past-eof", safetensors_bytes({"a": f32([1], 0, 4)}, 4, length=4096),
     "header length 4096 runs past the end"),
    ("too-short", b"\x01\x02\x03", "too short"),
    ("entry-not-object", safetensors_bytes({"a": [1, 2]}, 4), "tensor a: entry is not a JSON"),
    ("float-shape", safetensors_bytes({"a": f32([2.5], 0, 8)}, 8), "shape [2.5]"),
    ("negative-shape", safetensors_bytes({"a": f32([-1], 0, 0)}, 8), "shape [-1]"),
    ("bool-shape", safetensors_bytes({"a": f32([True], 0, 4)}, 8), "shape [true]"),
    ("one-offset", safetensors_bytes({"a": {"dtype": "F32", "shape": [1],
                                             "data_offsets": [0]}}, 4), "data_offsets [0]"),
    ("string-offset", safetensors_bytes({"a": f32([1], 0, "4")}, 4), 'data_offsets [0, "4"]'),
    ("reversed-offsets", safetensors_bytes({"a": f32([0], 8, 4)}, 8),
     "data_offsets [8, 4] end before they begin"),
]


@pytest.mark.parametrize("data,needle", [c[1:] for c in BAD_HEADERS],
                         ids=[c[0] for c in BAD_HEADERS])
def test_bad_safetensors_header(tmp_path: Path, data: bytes, needle: str) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(data)
    with pytest.raises(CheckpointError) as e:
        read_safetensors_header(f)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(f)) and needle in msg, msg


def test_good_header_with_gaps_and_empty_tensors(tmp_path: Path) -> None:
    """Zero-size tensors and unused bytes between tensors are not errors; entries come back in
    file order."""
    f = tmp_path / "model.safetensors"
    header = {"b": f32([2], 16, 24), "__metadata__": {"format": "pt"}, "a": f32([2], 0, 8),
              "e": f32([0], 8, 8)}
    f.write_bytes(safetensors_bytes(header, 32))
    assert [e.raw_name for e in read_safetensors_header(f)] == ["a", "e", "b"]


@pytest.fixture
def dense_dir(tmp_path: Path) -> Path:
    """gemma-4-tiny-dense's config.json and tokenizer.json, no weights yet."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(get_preset("gemma-4-tiny-dense").to_hf_dict()))
    (d / "tokenizer.json").write_text(synthetic_tokenizer_json(1024))
    return d


@pytest.mark.parametrize("case", ["overlap", "out-of-bounds", "unknown-dtype", "bad-json",
                                  "huge-header-length"])
def test_bad_safetensors_header_cli(tmp_path: Path, dense_dir: Path, case: str) -> None:
    data, needle = {c[0]: c[1:] for c in BAD_HEADERS}[case]
    (dense_dir / "model.safetensors").write_bytes(data)
    build_refused(tmp_path, str(dense_dir), "--target", "xla-f32", *SMALL,
                  needles=(str(dense_dir / "model.safetensors"), needle))


# ---------------------------------------------------------------------------------------------
# tokenizer.json and generation_config.json against the model's vocabulary (1024)


def tokenizer_with_added(token: str, token_id: int) -> str:
    """The 1024-token synthetic tokenizer plus one added token at `token_id`."""
    d = json.loads(synthetic_tokenizer_json(1024))
    d["added_tokens"].append({"id": token_id, "content": token, "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": False,
                              "special": True})
    return json.dumps(d)


# (case id, tokenizer.json text or None for the good one, generation_config or None, needle)
BAD_TOKENIZERS = [
    ("vocab-2048", synthetic_tokenizer_json(2048), None,
     "token '<unused_2047>' has id 2047, outside the model's vocabulary (vocab_size 1024"),
    ("added-token-past-vocab", tokenizer_with_added("<image>", 1024), None,
     "token '<image>' has id 1024"),
    ("unknown-model-type", json.dumps({"model": {"type": "Nonesuch"}}),
     None, "the tokenizers library cannot load it"),
    ("bpe-without-vocab", json.dumps({"version": "1.0", "model": {"type": "BPE"}}), None,
     "cannot load it"),
    ("bos-past-vocab", None, {"bos_token_id": 1024}, "bos_token_id 1024 is not a token id"),
    ("pad-negative", None, {"pad_token_id": -1}, "pad_token_id -1 is not a token id"),
    ("eos-past-vocab", None, {"eos_token_id": [1, 106, 99999]},
     "eos_token_id 99999 is not a token id"),
    ("eos-string", None, {"eos_token_id": "1"}, "eos_token_id '1' is not a token id"),
    ("eos-float", None, {"eos_token_id": 1.0}, "eos_token_id 1.0 is not a token id"),
]


def write_tokenizer_case(d: Path, tokenizer: str | None, gen: dict | None) -> None:
    if tokenizer is not None:
        (d / "tokenizer.json").write_text(tokenizer)
    if gen is not None:
        (d / "generation_config.json").write_text(json.dumps(gen))


@pytest.mark.parametrize("tokenizer,gen,needle", [c[1:] for c in BAD_TOKENIZERS],
                         ids=[c[0] for c in BAD_TOKENIZERS])
def test_bad_tokenizer(dense_dir: Path, tokenizer: str | None, gen: dict | None,
                       needle: str) -> None:
    write_tokenizer_case(dense_dir, tokenizer, gen)
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(dense_dir), random_weights=True)
    msg = str(e.value)
    assert "\n" not in msg and needle in msg and str(dense_dir) in msg, msg


@pytest.mark.parametrize("case", ["vocab-2048", "unknown-model-type", "eos-past-vocab"])
def test_bad_tokenizer_cli(tmp_path: Path, dense_dir: Path, case: str) -> None:
    tokenizer, gen, needle = {c[0]: c[1:] for c in BAD_TOKENIZERS}[case]
    write_tokenizer_case(dense_dir, tokenizer, gen)
    build_refused(tmp_path, str(dense_dir), "--target", "xla-f32", "--random-weights", *SMALL,
                  needles=(needle,))


def test_smaller_tokenizer_accepted(dense_dir: Path) -> None:
    """A tokenizer with fewer tokens than vocab_size is fine (a checkpoint may pad its
    embedding): only ids at or past vocab_size are refused."""
    small = json.loads(synthetic_tokenizer_json(1024))
    small["model"]["vocab"] = {k: v for k, v in small["model"]["vocab"].items() if v < 600}
    write_tokenizer_case(dense_dir, json.dumps(small), {"bos_token_id": 2, "eos_token_id": [1]})
    source = load_model_source(str(dense_dir), random_weights=True)
    assert Tokenizer.from_str(source.tokenizer_json).get_vocab_size() == 600


# ---------------------------------------------------------------------------------------------
# build options


TINY = ["gemma-4-tiny", "--random-weights"]
# (case id, arguments after the model, what the error line must contain)
BAD_OPTIONS = [
    ("tp-0", ["--target", "xla-f32", "--tp", "0"], "--tp 0: expected an integer >= 1"),
    ("tp-negative", ["--target", "xla-f32", "--tp", "-2"], "--tp -2"),
    ("tp-not-dividing", ["--target", "xla-f32", "--tp", "3"],
     "num_attention_heads 4 does not split over --tp 3"),
    ("tp-on-h100", ["--target", "h100-f32", "--tp", "3", "--platforms", "cuda"],
     "--tp 3: target h100-f32 splits over 2, 4, 8 GPUs of one host"),
    ("decode-loop-above-bucket", ["--target", "xla-f32", "--decode-loop-steps", "33"],
     "--decode-loop-steps 33: expected 0 (no loop) to 32, the largest prefill bucket"),
    ("decode-loop-negative", ["--target", "xla-f32", "--decode-loop-steps", "-1"],
     "--decode-loop-steps -1"),
    ("decode-loop-on-h100", ["--target", "h100-f32", "--decode-loop-steps", "8",
                             "--platforms", "cuda"],
     "target h100-f32 has no device-side decode loop"),
    ("max-seqs-0", ["--target", "xla-f32", "--max-seqs", "0"], "--max-seqs 0"),
    ("max-context-0", ["--target", "xla-f32", "--max-context", "0"], "--max-context 0"),
    ("max-context-below-bucket", ["--target", "xla-f32", "--max-context", "16"],
     "--max-context 16 must be >= the largest prefill bucket 32"),
    ("bucket-0", ["--target", "xla-f32", "--prefill-buckets", "0,8"], "--prefill-buckets '0,8'"),
    ("bucket-text", ["--target", "xla-f32", "--prefill-buckets", "eight"],
     "--prefill-buckets 'eight'"),
    ("bucket-above-positions", ["--target", "xla-f32", "--max-context", "8192",
                                "--prefill-buckets", "8192"],
     "the largest bucket 8192 is above gemma-4-tiny's max_position_embeddings 4096"),
    ("platform-unknown", ["--target", "xla-f32", "--platforms", "tpu,gpu"],
     "--platforms 'tpu,gpu'"),
    ("platform-empty", ["--target", "xla-f32", "--platforms", ","], "--platforms ''"),
    ("platform-h100-cpu", ["--target", "h100-f32", "--platforms", "cpu"],
     "runs on cuda only"),
    ("kv-cache-unknown", ["--target", "xla-f32", "--kv-cache", "fp4"], "--kv-cache 'fp4'"),
    ("kv-cache-int8-on-h100", ["--target", "h100-f32", "--kv-cache", "int8"],
     "--kv-cache int8: target h100-f32"),
    ("kv-cache-fp8-on-xla", ["--target", "xla-f32", "--kv-cache", "fp8"],
     "--kv-cache fp8: target xla-f32"),
    ("seed-negative", ["--target", "xla-f32", "--seed", "-1"], "--seed -1: expected an integer"),
    ("dump-ir-unknown", ["--target", "xla-f32", "--dump-ir", "fuse_everything"],
     "--dump-ir 'fuse_everything': this build has no such stage (it has frontend)"),
    ("dump-ir-pass-not-run", ["--target", "tpu-bf16", "--dump-ir", "kv_int8"],
     "--dump-ir 'kv_int8'"),
    ("target-unknown", ["--target", "gpu-f16"], "unknown target 'gpu-f16'"),
]


@pytest.mark.parametrize("args,needle", [c[1:] for c in BAD_OPTIONS],
                         ids=[c[0] for c in BAD_OPTIONS])
def test_bad_build_option(tmp_path: Path, args: list[str], needle: str) -> None:
    build_refused(tmp_path, *TINY, *SMALL, *args, needles=(needle,))


def test_seed_without_random_weights(tmp_path: Path) -> None:
    build_refused(tmp_path, "gemma-4-tiny", "--target", "xla-f32", "--seed", "3", *SMALL,
                  needles=("--seed 3: only --random-weights uses a seed",))


# ---------------------------------------------------------------------------------------------
# A real build: the clamp is said on stderr, the artifact is 0644 under umask 022


def test_build_warns_of_clamp_and_writes_0644(tmp_path: Path) -> None:
    out = tmp_path / "tiny.rvp"
    p = subprocess.run(
        [str(Path(sys.executable).parent / "rvcompile"), "build", *TINY, "--target", "tpu-bf16",
         "--max-context", "8192", "--prefill-buckets", "8,32", "--max-seqs", "2", "-o", str(out)],
        capture_output=True, text=True, timeout=300, preexec_fn=lambda: os.umask(0o022))
    assert p.returncode == 0, p.stderr
    assert ("rvcompile: warning: --max-context 8192 is above gemma-4-tiny's "
            "max_position_embeddings 4096: building for 4096 tokens") in p.stderr.splitlines()
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert [f.name for f in tmp_path.iterdir()] == ["tiny.rvp"]


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_artifact_mode_follows_umask(tmp_path: Path, umask: int, mode: int) -> None:
    out = tmp_path / "m.rvp"
    old = os.umask(umask)
    try:
        with ArtifactWriter(out, ArtifactHeader("0", "t", ("cpu",), {}), piece_size=64) as w:
            w.add("data", b"x" * 100)
            w.commit({})
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == mode


# ---------------------------------------------------------------------------------------------
# A build stopped by a signal while its temp file exists


# Runs the real CLI with one change: after the weights are written (the temp file is complete
# but not committed) the build announces itself and waits, so the test's signal lands exactly
# there every time. The signal handling under test is the CLI's own.
HELD_BUILD = """
import sys, time
from pathlib import Path
import rvcompile.build as build
from rvcompile.cli import app

fill = build._zero_fill_gaps
def held(*args, **kwargs):
    fill(*args, **kwargs)
    Path(sys.argv[1]).write_text("holding")
    time.sleep(120)
build._zero_fill_gaps = held
app(sys.argv[2:])
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_signal_removes_temp_file(tmp_path: Path, sig: signal.Signals) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    ready = tmp_path / "ready"
    p = subprocess.Popen(
        [sys.executable, "-c", HELD_BUILD, str(ready), "build", *TINY, "--target", "tpu-bf16",
         *SMALL, "--no-progress", "-o", str(out_dir / "m.rvp")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(3000):
            if ready.exists() or p.poll() is not None:
                break
            time.sleep(0.05)
        assert ready.exists(), p.communicate()
        tmp = [f.name for f in out_dir.iterdir()]
        assert tmp == [f".m.rvp.tmp-{p.pid}"]  # the point: a temp file exists right now
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -sig, (p.returncode, err)  # died of the signal, as senders expect
    assert err.strip().splitlines() == [
        f"rvcompile: error: interrupted by {sig.name}; no temporary file left behind"]
    assert list(out_dir.iterdir()) == []
