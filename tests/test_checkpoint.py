"""checkpoint.py, random_weights.py, tokenizer_files.py: names and shapes against transformers,
loading real (tiny) checkpoint directories in every layout, and one test per bad input."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import jinja2
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

import rvcompile.sources.random_weights as rw
from rvcompile.model.config import ConfigError, Gemma4Config
from rvcompile.model.presets import PRESETS, get_preset
from rvcompile.sources.checkpoint import load_model_source
from rvcompile.sources.model_source import CheckpointError, ModelSource, expected_tensors
from rvcompile.sources.random_weights import CHUNK, random_array, random_tensors
from rvcompile.sources.tokenizer_files import (
    default_chat_template,
    default_generation_config,
    synthetic_tokenizer_json,
)

# ---------------------------------------------------------------------------------------------
# Helpers


def hf_model(preset: str, seed: int = 0) -> Gemma4ForCausalLM:
    """A transformers model with the preset's config and every parameter randomised."""
    d = get_preset(preset).to_hf_dict()
    d.pop("architectures")
    d.pop("model_type")
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**d))
    with torch.no_grad():
        for p in model.state_dict().values():
            p.copy_(torch.rand_like(p) + 0.5 if p.ndim <= 1 else torch.randn_like(p) * 0.05)
    return model


def text_state(model: Gemma4ForCausalLM) -> dict[str, torch.Tensor]:
    """The state dict a text checkpoint stores (bf16, tied lm_head dropped)."""
    return {
        k: v.to(torch.bfloat16).contiguous().clone()
        for k, v in model.state_dict().items() if k != "lm_head.weight"
    }


def strip(name: str) -> str:
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


TOKENIZER_1024 = synthetic_tokenizer_json(1024)


def write_dir(d: Path, tensors: dict[str, torch.Tensor], config: dict, *, shards: int = 1,
              tokenizer: bool = True) -> Path:
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    if tokenizer:
        (d / "tokenizer.json").write_text(TOKENIZER_1024)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(d / "model.safetensors"))
        return d
    weight_map = {}
    per = math.ceil(len(names) / shards)
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per:(i + 1) * per]}
        save_file(part, str(d / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return d


def assert_one_line(err: pytest.ExceptionInfo, *needles: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"


@pytest.fixture(scope="module")
def tiny() -> tuple[dict[str, torch.Tensor], dict]:
    """gemma-4-tiny (every feature) as a text checkpoint: bf16 state dict and config.json."""
    model = hf_model("gemma-4-tiny")
    return text_state(model), model.config.to_dict()


# ---------------------------------------------------------------------------------------------
# expected_tensors against transformers


@pytest.mark.parametrize("preset", ["gemma-4-tiny", "gemma-4-tiny-dense"])
def test_expected_tensors_match_transformers(preset: str) -> None:
    model = hf_model(preset)
    want = {strip(k): tuple(v.shape) for k, v in model.state_dict().items()
            if k != "lm_head.weight"}
    cfg = Gemma4Config.from_hf_dict(model.config.to_dict())
    assert expected_tensors(cfg) == want
    assert expected_tensors(get_preset(preset)) == want


def test_expected_tensors_feature_switches() -> None:
    tiny = expected_tensors(get_preset("gemma-4-tiny"))
    dense = expected_tensors(get_preset("gemma-4-tiny-dense"))
    assert "layers.3.self_attn.v_proj.weight" not in tiny  # K=V full layer
    assert "layers.2.self_attn.v_proj.weight" in tiny  # sliding layer keeps V
    assert "layers.5.self_attn.k_proj.weight" not in tiny  # KV-shared layer
    assert tiny["layers.5.mlp.gate_proj.weight"] == (512, 128)  # double-wide MLP
    assert tiny["layers.0.experts.gate_up_proj"] == (8, 128, 128)
    assert "embed_tokens_per_layer.weight" in tiny
    assert not any("router" in n or "per_layer" in n for n in dense)


# Text parameter counts from shared/GEMMA4.md's table (billions).
RELEASED_PARAMS = {"gemma-4-E2B": 4.63, "gemma-4-E4B": 7.46, "gemma-4-12B": 11.9,
                   "gemma-4-26B-A4B": 25.2, "gemma-4-31B": 30.7}


@pytest.mark.parametrize("preset", list(RELEASED_PARAMS))
def test_released_preset_parameter_counts(preset: str) -> None:
    n = sum(math.prod(s) for s in expected_tensors(get_preset(preset)).values())
    assert n / 1e9 == pytest.approx(RELEASED_PARAMS[preset], rel=0.01)


# ---------------------------------------------------------------------------------------------
# Loading directories


def check_values(source: ModelSource, state: dict[str, torch.Tensor]) -> None:
    by_name = {strip(k): v for k, v in state.items()}
    assert [t.name for t in source.tensors] != []
    assert {t.name for t in source.tensors} == set(expected_tensors(source.config))
    for t in source.tensors:
        arr = t.load()
        assert arr.dtype == np.float32 and arr.flags.c_contiguous and arr.shape == t.shape
        np.testing.assert_array_equal(arr, by_name[t.name].float().numpy())


def test_load_save_pretrained_dir(tmp_path: Path) -> None:
    model = hf_model("gemma-4-tiny").to(torch.bfloat16)
    d = tmp_path / "tiny-ckpt"
    model.save_pretrained(d)
    (d / "tokenizer.json").write_text(TOKENIZER_1024)
    source = load_model_source(str(d))
    assert source.config.shape_signature() == get_preset("gemma-4-tiny").shape_signature()
    assert source.config.name == "tiny-ckpt" and source.origin == str(d)
    assert all(t.source_dtype == "bfloat16" for t in source.tensors)
    assert source.generation_config["eos_token_id"] == [1, 106]
    assert source.generation_config["bos_token_id"] == 2
    assert source.chat_template is None
    assert source.tokenizer_json == TOKENIZER_1024
    check_values(source, text_state(model))
    offsets = [t.reader.args[2] for t in source.tensors]  # one file, read front to back
    assert offsets == sorted(offsets)


def test_load_multimodal_layout(tmp_path: Path, tiny) -> None:
    state, text_cfg = tiny
    mm = {"model.language_model." + k[len("model."):]: v for k, v in state.items()}
    mm["model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight"] = torch.ones(4, 4)
    mm["model.embed_vision.embedding_projection.weight"] = torch.ones(128, 4)
    # Released E2B/E4B files carry unused k/v for KV-shared layers (layers 4-7 here).
    mm["model.language_model.layers.5.self_attn.k_proj.weight"] = torch.ones(64, 128)
    mm["model.language_model.layers.6.self_attn.k_norm.weight"] = torch.ones(32)
    config = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
              "text_config": text_cfg, "vision_config": {"model_type": "gemma4_vision"}}
    d = write_dir(tmp_path / "mm", mm, config)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 106, "top_k": 64}))
    source = load_model_source(str(d))
    check_values(source, state)
    assert source.chat_template == "{{ messages }}"
    assert source.generation_config == {"eos_token_id": [106], "top_k": 64, "bos_token_id": 2,
                                        "pad_token_id": 0}
    (d / "chat_template.jinja").write_text("jinja file wins")
    assert load_model_source(str(d)).chat_template == "jinja file wins"


def test_load_conditional_generation_save_pretrained(tmp_path: Path) -> None:
    """The released layout for real: Gemma4ForConditionalGeneration with (tiny) vision and audio
    towers, saved by transformers."""
    from transformers import Gemma4ForConditionalGeneration
    from transformers.models.gemma4.configuration_gemma4 import (
        Gemma4AudioConfig,
        Gemma4VisionConfig,
    )
    from transformers.models.gemma4.configuration_gemma4 import (
        Gemma4Config as HFGemma4Config,
    )

    text = get_preset("gemma-4-tiny").to_hf_dict()
    text.pop("architectures")
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    audio = Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(HFGemma4Config(
        text_config=text, vision_config=vision.to_dict(), audio_config=audio.to_dict(),
    )).to(torch.bfloat16)
    d = tmp_path / "mm-real"
    model.save_pretrained(d)
    (d / "tokenizer.json").write_text(TOKENIZER_1024)
    source = load_model_source("gemma-4-tiny", weights=d)
    state = {"model." + k: v for k, v in model.model.language_model.state_dict().items()}
    check_values(source, state)


def test_load_sharded(tmp_path: Path, tiny) -> None:
    state, cfg = tiny
    d = write_dir(tmp_path / "sharded", state, cfg, shards=3)
    source = load_model_source(str(d))
    check_values(source, state)
    origins = [Path(t.origin).name for t in source.tensors]
    assert origins == sorted(origins) and len(set(origins)) == 3  # shard by shard
    for shard in set(origins):
        offsets = [t.reader.args[2] for t in source.tensors if Path(t.origin).name == shard]
        assert offsets == sorted(offsets)


def test_preset_with_weights_dir(tmp_path: Path, tiny) -> None:
    state, cfg = tiny
    d = write_dir(tmp_path / "w", state, cfg)
    source = load_model_source("gemma-4-tiny", weights=d)
    assert source.config.name == "gemma-4-tiny"
    check_values(source, state)


def test_directory_with_random_weights(tmp_path: Path, tiny) -> None:
    _, cfg = tiny
    d = tmp_path / "cfg-only"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    source = load_model_source(str(d), random_weights=True, seed=3)
    assert [t.name for t in source.tensors] == list(expected_tensors(source.config))
    assert source.tensors[0].origin == "random(seed=3)"
    Tokenizer.from_str(source.tokenizer_json)  # synthetic fallback
    other = load_model_source(str(d), random_weights=True, seed=3,
                              random_ranges=rw.near_identity_init_range)
    assert other.tensors[0].origin == "random(seed=3, ranges=near_identity_init_range)"
    layer_scalar = next(t for t in other.tensors if t.name.endswith("layer_scalar"))
    assert layer_scalar.load().min() >= 0.95


def test_preset_random_weights() -> None:
    source = load_model_source("gemma-4-tiny", random_weights=True, seed=1)
    cfg = source.config
    assert cfg == get_preset("gemma-4-tiny") and source.origin == "gemma-4-tiny"
    assert {t.name: t.shape for t in source.tensors} == expected_tensors(cfg)
    assert source.generation_config == {"bos_token_id": 2, "eos_token_id": [1, 106],
                                        "pad_token_id": 0}
    assert source.chat_template == default_chat_template()
    assert Tokenizer.from_str(source.tokenizer_json).get_vocab_size() == cfg.vocab_size


# ---------------------------------------------------------------------------------------------
# Bad inputs: each one a single-line error naming the file and/or tensor


def test_missing_tensor(tmp_path: Path, tiny) -> None:
    state, cfg = tiny
    state = dict(state)
    del state["model.layers.2.self_attn.v_proj.weight"]
    d = write_dir(tmp_path / "m", state, cfg)
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(d))
    assert_one_line(e, str(d), "layers.2.self_attn.v_proj.weight", "missing")


def test_shape_mismatch(tmp_path: Path, tiny) -> None:
    state, cfg = tiny
    state = dict(state, **{"model.layers.1.mlp.up_proj.weight": torch.zeros(255, 128)})
    d = write_dir(tmp_path / "m", state, cfg)
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(d))
    assert_one_line(e, "model.safetensors", "model.layers.1.mlp.up_proj.weight", "[255, 128]",
                    "[256, 128]")


def test_unexpected_tensor(tmp_path: Path, tiny) -> None:
    state, cfg = tiny
    state = dict(state, **{"model.layers.3.self_attn.v_proj.weight": torch.zeros(64, 128)})
    d = write_dir(tmp_path / "m", state, cfg)
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(d))
    assert_one_line(e, "model.safetensors", "model.layers.3.self_attn.v_proj.weight")


@pytest.mark.parametrize("bad,dtype", [
    (float("nan"), torch.bfloat16), (float("inf"), torch.float16), (float("-inf"), torch.float32),
])
def test_nan_inf_at_load(tmp_path: Path, tiny, bad: float, dtype: torch.dtype) -> None:
    state, cfg = tiny
    name = "model.layers.4.mlp.down_proj.weight"
    w = state[name].to(dtype).clone()
    w[7, 9] = bad
    d = write_dir(tmp_path / "m", dict(state, **{name: w}), cfg)
    source = load_model_source(str(d))  # headers are fine
    ref = next(t for t in source.tensors if t.name == "layers.4.mlp.down_proj.weight")
    assert ref.source_dtype == str(dtype).removeprefix("torch.")
    with pytest.raises(CheckpointError) as e:
        ref.load()
    assert_one_line(e, "model.safetensors", name, "NaN" if bad != bad else "Inf", "[7, 9]")


def test_corrupt_header(tmp_path: Path, tiny) -> None:
    state, cfg = tiny
    d = write_dir(tmp_path / "m", state, cfg)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 20) + b"{not json at all!!!}" + data[28:])
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(d))
    assert_one_line(e, str(f), "JSON")
    f.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(d))
    assert_one_line(e, str(f), "header length")
    f.write_bytes(b"abc")
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(d))
    assert_one_line(e, str(f))


def test_truncated_file(tmp_path: Path, tiny) -> None:
    state, cfg = tiny
    d = write_dir(tmp_path / "m", state, cfg)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(d))
    assert_one_line(e, str(f), "truncated")


def test_truncated_after_validation(tmp_path: Path, tiny) -> None:
    state, cfg = tiny
    d = write_dir(tmp_path / "m", state, cfg)
    source = load_model_source(str(d))
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    last = max(source.tensors, key=lambda t: t.reader.args[2])
    with pytest.raises(CheckpointError) as e:
        last.load()
    assert_one_line(e, str(f), "truncated")


def test_missing_shard(tmp_path: Path, tiny) -> None:
    state, cfg = tiny
    d = write_dir(tmp_path / "m", state, cfg, shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(d))
    assert_one_line(e, "model.safetensors.index.json", "model-00002-of-00002.safetensors")


def test_index_lists_absent_tensor(tmp_path: Path, tiny) -> None:
    state, cfg = tiny
    d = write_dir(tmp_path / "m", state, cfg, shards=2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(d))
    assert_one_line(e, "model.norm.weight", "model-00001-of-00002.safetensors")


def test_unsupported_model_type(tmp_path: Path, tiny) -> None:
    state, cfg = tiny
    d = write_dir(tmp_path / "m", state, dict(cfg, model_type="llama"))
    with pytest.raises(ConfigError) as e:
        load_model_source(str(d))
    assert_one_line(e, str(d / "config.json"), "llama")


def test_unsupported_dtype(tmp_path: Path, tiny) -> None:
    state, cfg = tiny
    name = "model.layers.0.self_attn.q_proj.weight"
    fp8 = dict(state, **{name: state[name].to(torch.float8_e4m3fn)})
    d = write_dir(tmp_path / "fp8", fp8, cfg)
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(d))
    assert_one_line(e, "model.safetensors", name, "F8_E4M3", "pre-quantized")
    scaled = dict(state, **{name + "_scale": torch.ones(128, 1)})  # bf16 weight, FP8 scale
    d = write_dir(tmp_path / "scale", scaled, cfg)
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(d))
    assert_one_line(e, "model.safetensors", name + "_scale", "pre-quantized")
    quantized = dict(cfg, quantization_config={"quant_method": "fp8"})
    (d / "config.json").write_text(json.dumps(quantized))
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(d))
    assert_one_line(e, "config.json", "pre-quantized")
    ints = dict(state, **{name: torch.zeros(128, 128, dtype=torch.int8)})
    d = write_dir(tmp_path / "int8", ints, cfg)
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(d))
    assert_one_line(e, name, "I8", "pre-quantized")


def test_preset_mismatch(tmp_path: Path, tiny) -> None:
    state, cfg = tiny
    d = write_dir(tmp_path / "m", state, cfg)
    with pytest.raises(CheckpointError) as e:
        load_model_source("gemma-4-tiny-dense", weights=d)
    assert_one_line(e, "config.json", "gemma-4-tiny-dense", "num_hidden_layers", "6", "8")
    d2 = write_dir(tmp_path / "m2", state, dict(cfg, intermediate_size=512))
    with pytest.raises(CheckpointError) as e:
        load_model_source("gemma-4-tiny", weights=d2)
    assert_one_line(e, "intermediate_size", "256", "512")


def test_unknown_model_and_missing_flags(tmp_path: Path, tiny) -> None:
    with pytest.raises(ConfigError) as e:
        load_model_source("gemma-4-99B", random_weights=True)
    assert_one_line(e, "gemma-4-99B", "gemma-4-31B")
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(tmp_path / "nope"))
    assert_one_line(e, "nope")
    with pytest.raises(CheckpointError) as e:
        load_model_source("gemma-4-tiny")
    assert_one_line(e, "--weights", "--random-weights")
    with pytest.raises(CheckpointError) as e:
        load_model_source("gemma-4-tiny", weights=tmp_path / "nope")
    assert_one_line(e, "nope")
    state, cfg = tiny
    d = write_dir(tmp_path / "untied", state, dict(cfg, tie_word_embeddings=False))
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(d))
    assert_one_line(e, "config.json", "tie_word_embeddings")
    d = write_dir(tmp_path / "notok", state, cfg, tokenizer=False)
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(d))
    assert_one_line(e, str(d), "tokenizer.json")


# ---------------------------------------------------------------------------------------------
# Random weights


def test_random_deterministic_per_seed_and_name() -> None:
    cfg = get_preset("gemma-4-tiny")
    a = random_tensors(cfg, 0)
    b = random_tensors(cfg, 0)
    later_first = {t.name: t.load() for t in reversed(b)}  # order independent
    for t in a:
        np.testing.assert_array_equal(t.load(), later_first[t.name])
    # Same name and shape in another config: same values.
    dense = {t.name: t for t in random_tensors(get_preset("gemma-4-tiny-dense"), 0)}
    np.testing.assert_array_equal(dense["layers.0.self_attn.q_proj.weight"].load(),
                                  later_first["layers.0.self_attn.q_proj.weight"])
    c = {t.name: t.load() for t in random_tensors(cfg, 1)}
    for name, arr in later_first.items():
        assert not np.array_equal(arr, c[name]), name


def test_random_multichunk_deterministic() -> None:
    shape = (3 * CHUNK + 17,)
    x = random_array(5, "layers.0.mlp.up_proj.weight", shape)
    np.testing.assert_array_equal(x, random_array(5, "layers.0.mlp.up_proj.weight", shape))
    assert not np.array_equal(x[:CHUNK], x[CHUNK:2 * CHUNK])  # streams differ per chunk


def test_random_magnitudes() -> None:
    cfg = get_preset("gemma-4-tiny")
    t = {r.name: r.load() for r in random_tensors(cfg, 0)}
    assert t["layers.0.mlp.down_proj.weight"].std() == pytest.approx(1 / math.sqrt(256), rel=0.05)
    assert t["layers.0.experts.gate_up_proj"].std() == pytest.approx(1 / math.sqrt(128),
                                                                     rel=0.05)
    assert t["embed_tokens.weight"].std() == pytest.approx(0.03, rel=0.05)
    assert abs(t["embed_tokens.weight"].mean()) < 1e-3
    for name, lo, hi in [("norm.weight", 0.5, 1.5), ("layers.0.self_attn.q_norm.weight", 0.5, 1.5),
                         ("layers.0.layer_scalar", 0.5, 1.0),
                         ("layers.0.router.per_expert_scale", 0.5, 1.5),
                         ("layers.0.router.scale", 0.75, 1.25)]:
        assert lo <= t[name].min() and t[name].max() <= hi, name
    for arr in t.values():
        assert arr.dtype == np.float32 and arr.flags.c_contiguous and np.isfinite(arr).all()


def test_near_identity_ranges() -> None:
    conditioned = {"self_attn.q_norm.weight": (0.125, 0.375),
                   "self_attn.k_norm.weight": (0.125, 0.375),
                   "post_attention_layernorm.weight": (0.05, 0.15),
                   "post_feedforward_layernorm.weight": (0.05, 0.15),
                   "layer_scalar": (0.95, 1.0)}
    seen = set()
    for name, shape in expected_tensors(get_preset("gemma-4-tiny")).items():
        suffix = name.split(".", 2)[-1]
        want = conditioned.get(suffix, rw.init_range(name, shape))
        assert rw.near_identity_init_range(name, shape) == want, name
        seen.add(suffix)
    assert set(conditioned) <= seen
    # As tests/h100_vs_xla_run.py uses it: the ranges of random_array, every other tensor drawn
    # from init_range's.
    ranges = rw.near_identity_init_range
    post = random_array(0, "layers.3.post_feedforward_layernorm.weight", (4096,), ranges)
    assert 0.05 <= post.min() and post.max() <= 0.15
    norm = random_array(0, "layers.3.input_layernorm.weight", (4096,), ranges)
    assert 0.5 <= norm.min() and norm.max() <= 1.5 and norm.max() > 1.4


def test_every_preset_random_shapes() -> None:
    for name in PRESETS:
        cfg = get_preset(name)
        refs = random_tensors(cfg, 0)  # no values generated
        assert {r.name: r.shape for r in refs} == expected_tensors(cfg)


# ---------------------------------------------------------------------------------------------
# Synthetic tokenizer files


def test_synthetic_tokenizer_round_trip_and_speed() -> None:
    start = time.perf_counter()
    tok = Tokenizer.from_str(synthetic_tokenizer_json(262144))
    assert time.perf_counter() - start < 4.0  # ~0.6 s on a laptop core; generous for CI
    assert tok.get_vocab_size() == 262144
    for i, s in {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 105: "<start_of_turn>",
                 106: "<end_of_turn>", 300 + ord("A"): "A", 50: "<unused_50>"}.items():
        assert tok.id_to_token(i) == s
    for text in ("Hello, world", "  spaces\tand\nnewlines — ünïcode ✓ 😀"):
        ids = tok.encode(text).ids
        assert all(300 <= i < 556 for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode("<unused_7>").ids != [7]  # placeholders are never produced


def test_synthetic_tokenizer_too_small() -> None:
    with pytest.raises(ConfigError) as e:
        synthetic_tokenizer_json(512)
    assert_one_line(e, "512", "1024")


def test_chat_template_and_generation_config() -> None:
    template = jinja2.Environment().from_string(default_chat_template())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    text = template.render(messages=messages, bos_token="<bos>", add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>system\nBe brief.<end_of_turn>\n<start_of_turn>user\nHi"
        "<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n<start_of_turn>user\nBye"
        "<end_of_turn>\n<start_of_turn>model\n"
    )
    one = template.render(messages=messages[1:2], bos_token="<bos>", add_generation_prompt=False)
    assert one == "<bos><start_of_turn>user\nHi<end_of_turn>\n"
    ids = Tokenizer.from_str(TOKENIZER_1024).encode(one).ids
    assert ids[:2] == [2, 105] and ids[-2:] == [106, 300 + ord("\n")]
    assert default_generation_config(get_preset("gemma-4-31B")) == {
        "bos_token_id": 2, "eos_token_id": [1, 106, 50], "pad_token_id": 0}
