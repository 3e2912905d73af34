"""Turn `MODEL [--weights DIR | --random-weights --seed S]` into a validated, streamable source.

`load_model_source` resolves MODEL (a preset name or a Hugging Face model directory), reads and
checks everything that is cheap to check up front (config, every safetensors header, tensor
names, shapes and dtypes, tokenizer files) and returns a `ModelSource` whose `TensorRef`s read
one tensor each on `load()` (values, NaN/Inf, are checked there). Nothing loads the whole model.

Tensor names are the text decoder's, without the "model." prefix ("layers.3.self_attn.q_proj.
weight"); `expected_tensors(cfg)` lists them with their shapes (shared/GEMMA4.md, "Weights").
Multimodal files ("model.language_model." prefix) are read the same way; vision/audio towers,
their embedders, `lm_head.weight` (tied) and the unused k/v tensors of KV-shared layers are
skipped. Every error is a one-line `CheckpointError` (or `ConfigError` from the config parser)
naming the file and/or tensor.

safetensors layout, parsed here directly (numpy has no bfloat16): an 8-byte little-endian
header length N, N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}},
then the data section; offsets are relative to its start.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rvcompile.config import ConfigError, Gemma4Config
from rvcompile.presets import PRESETS, get_preset


class CheckpointError(ValueError):
    """A weight source that cannot be used; the one-line message names the file and/or tensor."""


@dataclass(frozen=True)
class TensorRef:
    """One decoder tensor, read on demand."""

    name: str  # canonical, without "model.": "layers.3.self_attn.q_proj.weight"
    shape: tuple[int, ...]
    source_dtype: str  # "bfloat16" | "float16" | "float32"
    origin: str  # file path, or "random(seed=S)"
    # Returns the float32 C-contiguous array; picklable (a functools.partial of a module function).
    reader: Callable[[], np.ndarray] = field(repr=False, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def load(self) -> np.ndarray:
        """float32, C-contiguous, `shape`; CheckpointError (naming origin and tensor) on NaN/Inf."""
        return self.reader()


@dataclass(frozen=True)
class ModelSource:
    config: Gemma4Config
    tensors: tuple[TensorRef, ...]  # exactly expected_tensors(config), file by file, by offset
    tokenizer_json: str  # tokenizer.json text
    generation_config: dict[str, Any]  # bos_token_id, eos_token_id (a list), pad_token_id, ...
    chat_template: str | None  # jinja text
    origin: str  # preset name or directory


# ---------------------------------------------------------------------------------------------
# Expected tensors


def expected_tensors(cfg: Gemma4Config) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every stored text-decoder tensor, in model order."""
    H, L, P = cfg.hidden_size, cfg.num_layers, cfg.hidden_size_per_layer_input
    nh = cfg.num_heads
    t: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, H)}
    if cfg.ple:
        t["embed_tokens_per_layer.weight"] = (cfg.vocab_size_per_layer_input, L * P)
        t["per_layer_model_projection.weight"] = (L * P, H)
        t["per_layer_projection_norm.weight"] = (P,)
    for s in cfg.layers:
        p = f"layers.{s.index}."
        d, kd = s.head_dim, s.num_kv_heads * s.head_dim
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            t[p + norm + ".weight"] = (H,)
        t[p + "layer_scalar"] = (1,)
        t[p + "self_attn.q_proj.weight"] = (nh * d, H)
        t[p + "self_attn.q_norm.weight"] = (d,)
        t[p + "self_attn.o_proj.weight"] = (H, nh * d)
        if not s.kv_shared:
            t[p + "self_attn.k_proj.weight"] = (kd, H)
            t[p + "self_attn.k_norm.weight"] = (d,)
            if not s.k_eq_v:
                t[p + "self_attn.v_proj.weight"] = (kd, H)
        t[p + "mlp.gate_proj.weight"] = (s.mlp_width, H)
        t[p + "mlp.up_proj.weight"] = (s.mlp_width, H)
        t[p + "mlp.down_proj.weight"] = (H, s.mlp_width)
        if s.moe:
            E, Im = cfg.num_experts, cfg.moe_intermediate_size
            t[p + "router.proj.weight"] = (E, H)
            t[p + "router.scale"] = (H,)
            t[p + "router.per_expert_scale"] = (E,)
            t[p + "experts.gate_up_proj"] = (E, 2 * Im, H)
            t[p + "experts.down_proj"] = (E, H, Im)
            for norm in ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                         "post_feedforward_layernorm_2"):
                t[p + norm + ".weight"] = (H,)
        if cfg.ple:
            t[p + "per_layer_input_gate.weight"] = (P, H)
            t[p + "per_layer_projection.weight"] = (H, P)
            t[p + "post_per_layer_input_norm.weight"] = (H,)
    t["norm.weight"] = (H,)
    return t


def _skipped_shared_kv(cfg: Gemma4Config) -> frozenset[str]:
    """The k/v tensors released files carry for KV-shared layers, which nothing reads."""
    return frozenset(
        f"layers.{s.index}.self_attn.{m}.weight"
        for s in cfg.layers if s.kv_shared
        for m in ("k_proj", "v_proj", "k_norm", "v_norm")
    )


# Top-level modules of a multimodal checkpoint that are not the text decoder.
_NON_TEXT_MODULES = frozenset({
    "vision_tower", "audio_tower", "embed_vision", "embed_audio", "multi_modal_projector",
    "vision_model", "audio_model",
})
_TEXT_PREFIXES = ("model.language_model.", "model.")
# Tensors that only pre-quantized checkpoints (FP8, GPTQ/AWQ, compressed-tensors, bnb) carry.
_QUANT_SUFFIX = re.compile(
    r"\.(weight_scale|weight_scale_inv|input_scale|weight_zero_point|weight_packed|"
    r"weight_shape|weight_global_scale|input_global_scale|qweight|qzeros|scales|g_idx|absmax|"
    r"quant_map|quant_state\..*)$"
)
_PREQUANT = "pre-quantized checkpoints are not supported by this path yet"


def _canonical_name(raw: str) -> str | None:
    """Strip the text-decoder prefix; None for tensors outside the text decoder."""
    if raw == "lm_head.weight":
        return None
    for prefix in _TEXT_PREFIXES:
        if raw.startswith(prefix):
            raw = raw[len(prefix):]
            break
    if raw.split(".", 1)[0] in _NON_TEXT_MODULES:
        return None
    return raw


# ---------------------------------------------------------------------------------------------
# safetensors


# safetensors dtype -> (source_dtype, numpy dtype of the stored bits); anything else is refused.
_SUPPORTED_DTYPES = {
    "BF16": ("bfloat16", np.dtype("<u2")),
    "F16": ("float16", np.dtype("<f2")),
    "F32": ("float32", np.dtype("<f4")),
}
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
    "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
_MAX_HEADER = 100 << 20  # the safetensors library's own limit


@dataclass(frozen=True)
class _Entry:
    raw_name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_safetensors_header(path: Path) -> list[_Entry]:
    """Parse and validate a safetensors header; entries sorted by data offset."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, too short)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > _MAX_HEADER:
                raise CheckpointError(
                    f"{path}: corrupt safetensors header: header length {n} runs past the end "
                    f"of the {size}-byte file (truncated or not a safetensors file?)"
                )
            text = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: not a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            shape = tuple(int(x) for x in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
            if not isinstance(dtype, str) or any(x < 0 for x in shape):
                raise ValueError
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(
                f"{path}: corrupt safetensors header: bad entry for tensor {name}"
            ) from None
        if not 0 <= begin <= end:
            raise CheckpointError(
                f"{path}: corrupt safetensors header: tensor {name} has data_offsets "
                f"[{begin}, {end}]"
            )
        if end > data_len:
            raise CheckpointError(
                f"{path}: tensor {name} data ends at byte {end} but the data section has only "
                f"{data_len} bytes (truncated file?)"
            )
        itemsize = _ITEMSIZE.get(dtype)
        if itemsize is not None and end - begin != math.prod(shape) * itemsize:
            raise CheckpointError(
                f"{path}: corrupt safetensors header: tensor {name} has {end - begin} bytes "
                f"but {dtype}{list(shape)} needs {math.prod(shape) * itemsize}"
            )
        entries.append(_Entry(name, dtype, shape, data_start + begin, end - begin))
    entries.sort(key=lambda e: e.start)
    return entries


def read_tensor(path: str, raw_name: str, start: int, nbytes: int, dtype: str,
                shape: tuple[int, ...]) -> np.ndarray:
    """Read one tensor as float32 [shape]; CheckpointError on a short read or NaN/Inf."""
    stored = _SUPPORTED_DTYPES[dtype][1]
    buf = np.empty(nbytes // stored.itemsize, stored)
    try:
        with open(path, "rb") as f:
            f.seek(start)
            got = f.readinto(buf.view(np.uint8))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read tensor {raw_name}: {e.strerror or e}") from None
    if got != nbytes:
        raise CheckpointError(
            f"{path}: tensor {raw_name}: read {got} of {nbytes} bytes (file truncated?)"
        )
    if dtype == "BF16":  # bfloat16 is the top half of a float32
        bits = np.empty(buf.shape, np.uint32)
        np.left_shift(buf, np.uint32(16), out=bits, dtype=np.uint32)
        out = bits.view(np.float32)
    else:
        out = buf.astype(np.float32, copy=False)
    out = out.reshape(shape)
    _check_finite(out, f"{path}: tensor {raw_name}")
    return out


def _check_finite(arr: np.ndarray, what: str, step: int = 1 << 24) -> None:
    flat = arr.reshape(-1)
    for i in range(0, flat.size, step):
        piece = flat[i:i + step]
        # A sum is finite unless a value is NaN/Inf (or it overflows: then look closer).
        if not np.isfinite(piece.sum()) and not np.isfinite(piece).all():
            j = i + int(np.flatnonzero(~np.isfinite(piece))[0])
            kind = "a NaN" if np.isnan(flat[j]) else "an Inf"
            index = tuple(int(x) for x in np.unravel_index(j, arr.shape))
            raise CheckpointError(f"{what} has {kind} at index {list(index)}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def _weight_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files in shard order, and the index's tensor -> shard map if sharded."""
    single = directory / "model.safetensors"
    if single.is_file():
        return [single], None
    index_path = directory / "model.safetensors.index.json"
    if not index_path.is_file():
        raise CheckpointError(
            f"{directory}: no model.safetensors or model.safetensors.index.json"
        )
    index = _read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) for v in weight_map.values()
    ):
        raise CheckpointError(f"{index_path}: no \"weight_map\" of tensor name -> shard file")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not (directory / shard).is_file():
            raise CheckpointError(f"{index_path}: shard {shard} is missing from {directory}")
    return [directory / s for s in shards], weight_map


def _file_tensors(directory: Path, cfg: Gemma4Config) -> tuple[TensorRef, ...]:
    """Validate every header against expected_tensors(cfg); TensorRefs in file/offset order."""
    expected = expected_tensors(cfg)
    ignored = _skipped_shared_kv(cfg)
    files, weight_map = _weight_files(directory)
    index_path = directory / "model.safetensors.index.json"
    found: dict[str, TensorRef] = {}
    where: dict[str, str] = {}
    for path in files:
        entries = read_safetensors_header(path)
        if weight_map is not None:
            present = {e.raw_name for e in entries}
            for raw, shard in weight_map.items():
                if shard == path.name and raw not in present:
                    raise CheckpointError(
                        f"{index_path}: lists tensor {raw} in {shard}, which does not contain it"
                    )
        for e in entries:
            name = _canonical_name(e.raw_name)
            if name is None or name in ignored:
                continue
            if _QUANT_SUFFIX.search(e.raw_name):
                raise CheckpointError(f"{path}: tensor {e.raw_name}: {_PREQUANT}")
            if name not in expected:
                raise CheckpointError(
                    f"{path}: unexpected tensor {e.raw_name} (not in the Gemma 4 text decoder "
                    f"that {directory / 'config.json'} describes)"
                )
            if name in found:
                raise CheckpointError(
                    f"{path}: tensor {e.raw_name} duplicates {name} already in {where[name]}"
                )
            if e.dtype not in _SUPPORTED_DTYPES:
                raise CheckpointError(
                    f"{path}: tensor {e.raw_name} has dtype {e.dtype}; only BF16, F16 and F32 "
                    f"are read ({_PREQUANT})"
                )
            if e.shape != expected[name]:
                raise CheckpointError(
                    f"{path}: tensor {e.raw_name} has shape {list(e.shape)}, expected "
                    f"{list(expected[name])}"
                )
            found[name] = TensorRef(
                name=name, shape=e.shape, source_dtype=_SUPPORTED_DTYPES[e.dtype][0],
                origin=str(path),
                reader=functools.partial(read_tensor, str(path), e.raw_name, e.start, e.nbytes,
                                         e.dtype, e.shape),
            )
            where[name] = path.name
    missing = [n for n in expected if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{directory}: missing tensor {missing[0]} {list(expected[missing[0]])}{more}"
        )
    return tuple(found.values())


# ---------------------------------------------------------------------------------------------
# Config and tokenizer files


def read_config(directory: Path) -> Gemma4Config:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json")
    raw = _read_json(path)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    if "quantization_config" in raw or "quantization_config" in text:
        raise CheckpointError(f"{path}: has a quantization_config: {_PREQUANT}")
    if raw.get("tie_word_embeddings") is False or text.get("tie_word_embeddings") is False:
        # lm_head.weight is skipped as a copy of embed_tokens; an untied one would be lost.
        raise CheckpointError(f"{path}: tie_word_embeddings is false; Gemma 4 ties the LM head "
                              "to embed_tokens and an untied head is not supported")
    try:
        return Gemma4Config.from_hf_dict(raw, name=directory.name, source=str(path))
    except ConfigError:
        raise
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read the config ({type(e).__name__}: {e})") from None


def _read_chat_template(directory: Path) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{jinja}: cannot read: {e}") from None
    tok_cfg_path = directory / "tokenizer_config.json"
    if not tok_cfg_path.is_file():
        return None
    template = _read_json(tok_cfg_path)
    template = template.get("chat_template") if isinstance(template, dict) else None
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{tok_cfg_path}: chat_template is not a string")
    return template


def _generation_config(directory: Path, cfg: Gemma4Config) -> dict[str, Any]:
    path = directory / "generation_config.json"
    gen: dict[str, Any] = {}
    if path.is_file():
        gen = _read_json(path)
        if not isinstance(gen, dict):
            raise CheckpointError(f"{path}: not a JSON object")
    gen = dict(gen)
    if gen.get("bos_token_id") is None:
        gen["bos_token_id"] = cfg.bos_token_id
    if gen.get("pad_token_id") is None:
        gen["pad_token_id"] = cfg.pad_token_id
    eos = gen.get("eos_token_id")
    if eos is None:
        eos = list(cfg.eos_token_ids)
    try:
        gen["eos_token_id"] = [int(x) for x in (eos if isinstance(eos, list) else [eos])]
    except (TypeError, ValueError):
        raise CheckpointError(f"{path}: eos_token_id {eos!r} is not an id or list of ids") from None
    return gen


def _read_tokenizer_json(directory: Path) -> str:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no tokenizer.json (a model directory needs one)")
    try:
        text = path.read_text(encoding="utf-8")
        parsed = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable tokenizer.json ({e})") from None
    if not isinstance(parsed, dict) or "model" not in parsed:
        raise CheckpointError(f"{path}: not a tokenizers tokenizer.json (no \"model\")")
    return text


# ---------------------------------------------------------------------------------------------
# Entry point


def _first_difference(want: Any, got: Any, path: str = "") -> str | None:
    """The first field where two shape signatures differ, as 'field: preset X, checkpoint Y'."""
    if isinstance(want, dict) and isinstance(got, dict):
        for key in dict.fromkeys([*want, *got]):
            sub = f"{path}.{key}" if path else str(key)
            if key not in want or key not in got:
                return f"{sub}: preset {want.get(key, '(absent)')!r}, checkpoint " \
                       f"{got.get(key, '(absent)')!r}"
            diff = _first_difference(want[key], got[key], sub)
            if diff:
                return diff
        return None
    if path == "layers" and isinstance(want, list) and isinstance(got, list):
        for i, (a, b) in enumerate(zip(want, got, strict=False)):
            if a != b:
                return (f"layers[{i}] (kind, head_dim, kv_heads, k_eq_v, kv_source, mlp_width): "
                        f"preset {a}, checkpoint {b}")
    if want != got:
        return f"{path}: preset {want!r}, checkpoint {got!r}"
    return None


def _load_directory(directory: Path, *, random_weights: bool, seed: int,
                    expect: Gemma4Config | None = None, name: str | None = None) -> ModelSource:
    """A model directory; `expect` (a preset's config) must agree with its config.json."""
    from rvcompile import random_weights as rw
    from rvcompile import tokenizer_files as tf

    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such model directory")
    cfg = read_config(directory)
    if expect is not None:
        diff = _first_difference(expect.shape_signature(), cfg.shape_signature())
        if diff:
            raise CheckpointError(
                f"{directory / 'config.json'} does not match preset {expect.name}: {diff}"
            )
    if name is not None:
        cfg = dataclasses.replace(cfg, name=name)
    if random_weights:
        tensors = rw.random_tensors(cfg, seed)
        if not (directory / "tokenizer.json").is_file():
            return ModelSource(
                config=cfg, tensors=tensors, tokenizer_json=tf.synthetic_tokenizer_json(
                    cfg.vocab_size),
                generation_config=tf.default_generation_config(cfg),
                chat_template=tf.default_chat_template(), origin=str(directory),
            )
    else:
        tensors = _file_tensors(directory, cfg)
    return ModelSource(
        config=cfg, tensors=tensors, tokenizer_json=_read_tokenizer_json(directory),
        generation_config=_generation_config(directory, cfg),
        chat_template=_read_chat_template(directory), origin=str(directory),
    )


def load_model_source(model: str, *, weights: Path | None = None, random_weights: bool = False,
                      seed: int = 0) -> ModelSource:
    """Resolve MODEL (a model directory, else a preset name) and its weights.

    directory                       its config.json, safetensors and tokenizer files
    directory --random-weights      its config.json, random tensors (its tokenizer files if
                                    present, else synthetic ones)
    preset --weights DIR            DIR as a directory; its config must match the preset's shape
    preset --random-weights         preset config, random tensors, synthetic tokenizer files
    MODEL --weights DIR (MODEL a directory) works like a preset: DIR must match MODEL's config.
    A directory wins over a preset of the same name.
    """
    from rvcompile import random_weights as rw
    from rvcompile import tokenizer_files as tf

    if weights is not None and random_weights:
        raise CheckpointError("pass either --weights DIR or --random-weights, not both")
    path = Path(model)
    is_dir = path.is_dir() and (path / "config.json").is_file()
    if not is_dir and model not in PRESETS:
        if path.exists() or "/" in model or model.startswith("."):
            raise CheckpointError(f"{model}: not a model directory (needs config.json)")
        raise ConfigError(
            f"unknown model {model!r}: not a directory and not a preset "
            f"(known presets: {', '.join(PRESETS)})"
        )
    if weights is not None:
        expect = read_config(path) if is_dir else get_preset(model)
        source = _load_directory(Path(weights), random_weights=False, seed=seed, expect=expect,
                                 name=expect.name)
        return dataclasses.replace(source, origin=f"{model} (weights from {weights})")
    if is_dir:
        return _load_directory(path, random_weights=random_weights, seed=seed)
    cfg = get_preset(model)
    if not random_weights:
        raise CheckpointError(
            f"preset {model} has no weights of its own: pass --weights DIR (a Hugging Face "
            "checkpoint directory) or --random-weights [--seed S]"
        )
    return ModelSource(
        config=cfg, tensors=rw.random_tensors(cfg, seed),
        tokenizer_json=tf.synthetic_tokenizer_json(cfg.vocab_size),
        generation_config=tf.default_generation_config(cfg),
        chat_template=tf.default_chat_template(), origin=model,
    )
