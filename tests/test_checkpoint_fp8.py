"""Pre-quantized FP8 checkpoints (sources/fp8_schemes.py and Fp8Tensor, weight_math.encode_all).

The oracle's "dense" checkpoint is rewritten the way llm-compressor writes FP8-Dynamic: every
linear projection an F8_E4M3 `X.weight` with an `X.weight_scale`, and a compressed-tensors
quantization_config. The MLP projections are quantized per output row by the compiler's own
quantize_fp8_per_channel (scales [N, 1], float32); the attention projections with one bf16
scale per tensor ([] or [1]), so quantizing their dequantization again per row would give
other bytes and a round trip cannot pass for "taken as they are". Then:
- an h100-fp8 build stores exactly those e4m3 bytes and per-row scales;
- an xla-f32 build of it equals one of its dequantized float32 checkpoint (weights and logits);
- the quant_method "fp8" layout (per-tensor scales, input_scale ignored under dynamic
  activations, weight and scale in different shards) reads back the same tensors;
- what is not read is refused in one line naming the file and the tensor or field.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from oracle import random_token_ids
from safetensors.torch import load_file, save_file

from rvcompile import runtime
from rvcompile.artifacts import Artifact
from rvcompile.build import BuildOptions, build_artifact, lower_model
from rvcompile.passes.weight_math import (
    FP8_E4M3_MAX,
    encode_all,
    quantize_fp8_per_channel,
    quantize_int8_per_channel,
)
from rvcompile.sources.checkpoint import load_model_source
from rvcompile.sources.model_source import CheckpointError, Fp8Tensor
from rvcompile.targets.h100.lower import layout_weights

LINEAR = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
PER_TENSOR_SHAPE = {"q_proj": (), "k_proj": (), "v_proj": (1,), "o_proj": (1,)}
OPTS = {"max_context": 64, "prefill_buckets": (8, 16), "max_seqs": 1}
# test_oracle.py's options: the same programs as its "dense" xla-f32 artifact (programs depend on
# the config and options, not the weights), so the XLA compile comes from the persistent cache.
XLA_OPTS = {"max_context": 128, "prefill_buckets": (8, 32), "max_seqs": 2}
QUANT_GROUP = {
    "format": "float-quantized",
    "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                "group_size": None, "block_structure": None, "observer": "minmax"},
    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                          "strategy": "token", "observer": None},
    "output_activations": None,
}
COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "quantization_status": "compressed", "kv_cache_scheme": None, "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {**QUANT_GROUP, "targets": ["re:.*mlp\\.(gate|up|down)_proj$"],
                    "weights": {**QUANT_GROUP["weights"], "strategy": "channel"}},
        "group_1": {**QUANT_GROUP, "targets": ["re:.*self_attn\\.[qkvo]_proj$"],
                    "weights": {**QUANT_GROUP["weights"], "strategy": "tensor"}},
    },
}


def quantize(name: str, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """(e4m3 bytes, per-row float32 scales, stored scale shape) of one linear weight."""
    if ".mlp." in name:
        codes, scales = quantize_fp8_per_channel(w)
        return codes, scales, (w.shape[0], 1)
    scale = np.float32(ml_dtypes.bfloat16(np.abs(w).max() / FP8_E4M3_MAX))
    codes = np.clip(w / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    projection = name.split(".")[-2]
    return codes.view(np.uint8), np.full(w.shape[0], scale), PER_TENSOR_SHAPE[projection]


def dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scales[:, None]


def write_checkpoint(src: Path, dst: Path, tensors: dict[str, torch.Tensor],
                     quantization_config: dict | None, shard_of=None) -> Path:
    """src's config (with `quantization_config`) and tokenizer files, and `tensors`: one file,
    or two shards with an index when `shard_of(name)` gives each tensor's shard (1 or 2)."""
    dst.mkdir(parents=True)
    for f in ("tokenizer.json", "generation_config.json"):
        shutil.copy(src / f, dst / f)
    cfg = json.loads((src / "config.json").read_text())
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    if shard_of is None:
        save_file(tensors, dst / "model.safetensors")
        return dst
    files = {k: f"model-0000{k}-of-00002.safetensors" for k in (1, 2)}
    weight_map = {name: files[shard_of(name)] for name in tensors}
    for file in files.values():
        save_file({n: t for n, t in tensors.items() if weight_map[n] == file}, dst / file)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


def fp8(codes: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(codes).view(torch.float8_e4m3fn)


@pytest.fixture(scope="module")
def dense(oracle_dir):
    """(float checkpoint dir, its state, {raw name: (codes, row scales, scale shape)})."""
    _, ckpt = oracle_dir("dense")
    state = load_file(ckpt / "model.safetensors")
    quantized = {name: quantize(name, t.numpy()) for name, t in state.items()
                 if LINEAR.fullmatch(name)}
    return ckpt, state, quantized


def fp8_state(dense, scale_dtype=torch.float32) -> dict[str, torch.Tensor]:
    _, state, quantized = dense
    out = dict(state)
    for name, (codes, scales, scale_shape) in quantized.items():
        out[name] = fp8(codes)
        stored = scales[:1] if scale_shape in ((), (1,)) else scales
        out[name + "_scale"] = torch.from_numpy(stored.reshape(scale_shape)).to(scale_dtype)
    return out


@pytest.fixture(scope="module")
def fp8_dir(dense, tmp_path_factory):
    ckpt = dense[0]
    return write_checkpoint(ckpt, tmp_path_factory.mktemp("fp8") / "ckpt", fp8_state(dense),
                            COMPRESSED_TENSORS)


def canonical(raw: str) -> str:
    return raw.removeprefix("model.")


def test_h100_fp8_stores_the_checkpoint_bytes(dense, fp8_dir, tmp_path):
    _, _, quantized = dense
    requantized_differs = [
        not np.array_equal(quantize_fp8_per_channel(dequantize(c, s))[0], c)
        for c, s, _ in quantized.values()
    ]
    assert any(requantized_differs)  # a dequantize/requantize round trip would fail below
    out = tmp_path / "fp8.rvp"
    opts = BuildOptions("h100-fp8", **OPTS)
    build_artifact(str(fp8_dir), out, opts, progress=False, log=lambda s: None)
    slots, _ = layout_weights(lower_model(load_model_source(str(fp8_dir)), opts, lambda s: None))
    with Artifact.open(out) as art:
        for raw, (codes, scales, _) in quantized.items():
            name = canonical(raw)
            values_slot, scales_slot = slots[name], slots[name + ".scale"]
            stored = art.array("weights", values_slot.offset, codes.shape, np.uint8)
            np.testing.assert_array_equal(stored, codes, err_msg=name)
            stored = art.array("weights", scales_slot.offset, scales.shape, np.float32)
            np.testing.assert_array_equal(stored, scales, err_msg=name)


def test_xla_f32_of_fp8_equals_its_dequantized_checkpoint(dense, fp8_dir, tmp_path):
    ckpt, state, quantized = dense
    dequantized = {**state, **{name: torch.from_numpy(dequantize(codes, scales))
                               for name, (codes, scales, _) in quantized.items()}}
    float_dir = write_checkpoint(ckpt, tmp_path / "float", dequantized, None)
    models, weights = [], []
    for d in (fp8_dir, float_dir):
        out = tmp_path / f"{d.name}.rvp"
        build_artifact(str(d), out, BuildOptions("xla-f32", **XLA_OPTS), progress=False,
                       log=lambda s: None)
        with Artifact.open(out) as art:
            weights.append(bytes(art.buffer("weights")))
        models.append(runtime.load(out))
    assert weights[0] == weights[1]
    ids = random_token_ids(16, seed=5)
    np.testing.assert_array_equal(models[0].logits(ids), models[1].logits(ids))


def test_fp8_method_per_tensor_sharded(dense, tmp_path):
    """AutoFP8's layout: quant_method "fp8", bf16 per-tensor scales, input_scale tensors that
    dynamic activations ignore; every scale in the other shard than its weight."""
    _, _, quantized = dense
    tensors = fp8_state(dense, scale_dtype=torch.bfloat16)
    for name in quantized:
        tensors[name.replace(".weight", ".input_scale")] = torch.tensor([0.5])
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    d = write_checkpoint(dense[0], tmp_path / "m", tensors, config,
                         shard_of=lambda n: 2 if n.endswith("_scale") else 1)
    refs = {t.name: t for t in load_model_source(str(d)).tensors}
    for raw, (codes, scales, _) in quantized.items():
        ref = refs[canonical(raw)]
        assert ref.source_dtype == "float8_e4m3fn"
        assert ref.origin.endswith("model-00001-of-00002.safetensors")
        stored = ref.load_stored()
        assert isinstance(stored, Fp8Tensor)
        bf16_scales = scales.astype(ml_dtypes.bfloat16).astype(np.float32)
        if ".mlp." not in raw:
            np.testing.assert_array_equal(stored.scales, scales)  # per tensor: bf16 already
        np.testing.assert_array_equal(stored.scales, bf16_scales)
        np.testing.assert_array_equal(stored.values.view(np.uint8), codes)
        np.testing.assert_array_equal(ref.load(), dequantize(codes, bf16_scales))


def refused(d: Path, *parts: str) -> None:
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(d))
    message = str(e.value)
    assert "\n" not in message
    for part in parts:
        assert part in message, (part, message)


Q = "model.layers.0.self_attn.q_proj.weight"


def test_refusals_name_the_file_and_tensor(dense, tmp_path):
    ckpt, state, _ = dense
    good = fp8_state(dense)
    cases = 0

    def case(tensors=None, config=COMPRESSED_TENSORS):
        nonlocal cases
        cases += 1
        return write_checkpoint(ckpt, tmp_path / str(cases), good if tensors is None else tensors,
                                config)

    block_config = {"quant_method": "fp8", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}
    refused(case(config=block_config), "config.json", "weight_block_size", "block-wise")
    block_group = json.loads(json.dumps(COMPRESSED_TENSORS))
    block_group["config_groups"]["group_0"]["weights"].update(
        strategy="block", block_structure=[128, 128])
    refused(case(config=block_group), "config.json", "config_groups.group_0", "'block'")
    inverse = {(n + "_inv" if n == Q + "_scale" else n): t for n, t in good.items()}
    refused(case(inverse), "model.safetensors", Q + "_scale_inv", "block-wise")
    group_wise = {**good, Q + "_scale": torch.ones(128, 2)}
    refused(case(group_wise), "model.safetensors", Q + "_scale", "[128, 2]", "group-wise")
    for raw in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"):
        codes = state[raw].numpy().astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        stored = {**fp8_state(dense), raw: fp8(codes), raw + "_scale": torch.ones(1)}
        refused(case(stored), "model.safetensors", raw, "F8_E4M3", "only linear projections")
    static = json.loads(json.dumps(COMPRESSED_TENSORS))
    static["config_groups"]["group_1"]["input_activations"].update(dynamic=False,
                                                                   strategy="tensor")
    refused(case(config=static), "config.json", "config_groups.group_1", "not dynamic")
    refused(case(config={"quant_method": "fp8", "activation_scheme": "static"}), "config.json",
            "activation_scheme", "'static'")
    weight_only = json.loads(json.dumps(COMPRESSED_TENSORS))
    for group in weight_only["config_groups"].values():
        group["input_activations"] = None
    with_input_scale = {**fp8_state(dense), Q.replace("weight", "input_scale"): torch.ones(1)}
    refused(case(with_input_scale, weight_only), "model.safetensors",
            "q_proj.input_scale", "quantizes no activations")
    unscaled = dict(fp8_state(dense))
    del unscaled[Q + "_scale"]
    refused(case(unscaled), "model.safetensors", Q, f"no {Q}_scale")
    scaled_float = {**state, Q + "_scale": torch.ones(1)}
    refused(case(scaled_float), "model.safetensors", Q + "_scale", "F32, not F8_E4M3")
    refused(case(config={"quant_method": "gptq", "bits": 4}), "config.json", "'gptq'")
    nan = fp8_state(dense)
    nan[Q] = nan[Q].clone()
    nan[Q].view(torch.uint8)[3, 5] = 0x7F
    source = load_model_source(str(case(nan)))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor {Q} has a NaN at "
                                              r"index \[3, 5\]$"):
        next(t for t in source.tensors if t.name == canonical(Q)).load_stored()
    out = tmp_path / "x.rvp"  # a refused checkpoint leaves nothing behind
    with pytest.raises(CheckpointError):
        build_artifact(str(tmp_path / "1"), out, BuildOptions("h100-fp8", **OPTS),
                       progress=False, log=lambda s: None)
    assert not out.exists()


def test_encode_all_keeps_fp8_and_dequantizes_the_rest(dense):
    _, _, quantized = dense
    codes, scales, _ = quantized[Q]
    stored = Fp8Tensor(codes.view(ml_dtypes.float8_e4m3fn), scales)
    out = encode_all({"v": "fp8_values", "s": "fp8_scales", "f": "copy", "i": "int8_values",
                      "j": "int8_scales"}, stored)
    assert out["v"] is stored.values and out["s"] is stored.scales
    w = dequantize(codes, scales)
    np.testing.assert_array_equal(out["f"], w)
    q, s = quantize_int8_per_channel(w)
    np.testing.assert_array_equal(out["i"], q)
    np.testing.assert_array_equal(out["j"], s)
