"""build.py's row-block streaming of large tensors (checkpoint and random weights), and the
released-layout checkpoint writer that measures it (benchmarks/hf_checkpoint.py): a build whose
tensors all go through in blocks of a few rows writes the same artifact bytes as one that reads
each tensor whole; a block's NaN is reported at its index in the whole tensor; the written
checkpoint is one the safetensors library reads, with the names and shapes a release has."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from stub_cubins import build_h100

import rvcompile.build as build
from rvcompile.artifacts import Artifact
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.model.presets import get_preset
from rvcompile.sources.checkpoint import load_model_source
from rvcompile.sources.model_source import CheckpointError

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hf_checkpoint = _script("hf_checkpoint")


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("released") / "gemma-4-tiny"
    hf_checkpoint.write_checkpoint("gemma-4-tiny", out, seed=3, shard_bytes=200_000,
                                   log=lambda *_: None)
    return out


def test_writer_matches_a_release(released: Path) -> None:
    cfg = get_preset("gemma-4-tiny")
    index = json.loads((released / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    stored = {}
    for shard in shards:
        stored.update(load_file(str(released / shard)))  # the reference reader accepts them
    want = hf_checkpoint.released_tensors(cfg)
    assert {k: v.shape for k, v in stored.items()} == want
    assert all(k.startswith("model.language_model.") for k in stored)
    assert any(s.kv_shared for s in cfg.layers)  # so the skipped k/v tensors are exercised
    source = load_model_source(str(released))
    assert source.config.shape_signature() == cfg.shape_signature()
    assert source.chat_template == (released / "chat_template.jinja").read_text()
    embed = source.tensors[0]
    assert embed.name == "embed_tokens.weight"
    assert 0.02 < float(embed.load().std()) < 0.04  # init_range's 0.03


@pytest.mark.parametrize("target,random", [("tpu-int8", False), ("tpu-bf16", False),
                                           ("xla-f32", False), ("tpu-int8", True),
                                           ("h100-fp8", False)])
def test_row_blocks_write_the_same_bytes(released: Path, tmp_path: Path, monkeypatch,
                                         target: str, random: bool) -> None:
    opts = BuildOptions(target=target, max_context=64, prefill_buckets=(16,), max_seqs=1)
    model = "gemma-4-tiny" if random else str(released)

    def run(out: Path) -> Path:
        if target.startswith("h100"):  # its layout, without nvcc
            return build_h100(out, model, opts, random_weights=random)
        return build_artifact(model, out, opts, random_weights=random, seed=5, progress=False,
                              log=lambda *_: None).path

    whole = run(tmp_path / "whole.rvp")
    monkeypatch.setattr(build, "ROW_BLOCK_BYTES", 3 * 128 * 4)  # 3 rows of a width-128 tensor
    blocks = run(tmp_path / "blocks.rvp")
    with Artifact.open(whole) as a, Artifact.open(blocks) as b:
        assert bytes(a.buffer("weights")) == bytes(b.buffer("weights"))


def test_row_read_reports_the_whole_tensor_index(released: Path, tmp_path: Path) -> None:
    source = load_model_source(str(released))
    ref = next(t for t in source.tensors if t.name == "embed_tokens.weight")
    rows, width = ref.shape
    np.testing.assert_array_equal(ref.rows(5, 9), ref.load()[5:9])
    # Put a bf16 NaN at [7, 2] of the stored tensor and read rows 5..9.
    path = Path(ref.origin)
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    begin = 8 + n + header["model.language_model.embed_tokens.weight"]["data_offsets"][0]
    at = begin + 2 * (7 * width + 2)
    data[at:at + 2] = struct.pack("<H", 0x7FC0)
    path.write_bytes(bytes(data))
    try:
        with pytest.raises(CheckpointError, match=r"has a NaN at index \[7, 2\]"):
            ref.rows(5, 9)
        assert ref.rows(0, 5).shape == (5, width)
    finally:
        data[at:at + 2] = b"\0\0"
        path.write_bytes(bytes(data))
