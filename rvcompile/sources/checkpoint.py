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

Pre-quantized FP8 checkpoints (llm-compressor "FP8-Dynamic", compressed-tensors or quant_method
"fp8"): a linear projection stored as F8_E4M3 `X.weight` [N, K] with `X.weight_scale` (one scale
per output row, [N, 1] or [N], or one per tensor, [] or [1], expanded to rows) becomes a TensorRef
whose `load_stored()` gives that `Fp8Tensor` as stored and whose `load()` gives its float32
dequantization. `read_fp8_scheme` says which quantization_configs are read and why the others
(block-wise scales, static activation scales, other formats) are refused.

Assistant drafters (`--assistant DIR | PRESET`, `load_assistant_source`): an assistant directory
(config.json of model_type gemma4_assistant / gemma4_unified_assistant, safetensors) or, with
random weights, an assistant preset; refused in one line when it does not fit the target
(AssistantConfig.target_layers). Its tensors are named "assistant." + the checkpoint's name
without "model." (`expected_assistant_tensors`), read by the same safetensors reader (BF16, F16,
F32; its masked head's token_ordering I64 or I32, checked on load to be a permutation of the
vocabulary: each token in exactly one cluster).

safetensors layout, parsed here directly (numpy has no bfloat16): an 8-byte little-endian
header length N, N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}},
then the data section; offsets are relative to its start.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from rvcompile import chat_template
from rvcompile.model.assistant import TENSOR_PREFIX, AssistantConfig
from rvcompile.model.config import ConfigError, Gemma4Config
from rvcompile.model.presets import PRESETS, get_preset


class CheckpointError(ValueError):
    """A weight source that cannot be used; the one-line message names the file and/or tensor."""


@dataclass(frozen=True)
class Fp8Tensor:
    """A pre-quantized checkpoint matrix as stored: the weight is values * scales[:, None]."""

    values: np.ndarray  # float8_e4m3fn [N, K], the checkpoint's bytes
    scales: np.ndarray  # float32 [N], one per output row (a per-tensor scale repeated)

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: each e4m3 value (exact in float32) times its row's scale."""
        return self.values.astype(np.float32) * self.scales[:, None]


@dataclass(frozen=True)
class TensorRef:
    """One decoder tensor, read on demand."""

    name: str  # canonical, without "model.": "layers.3.self_attn.q_proj.weight"
    shape: tuple[int, ...]
    source_dtype: str  # "bfloat16" | "float16" | "float32" | "float8_e4m3fn" (pre-quantized)
    origin: str  # file path, or "random(seed=S)"
    # Returns the float32 C-contiguous array; picklable (a functools.partial of a module function).
    reader: Callable[[], np.ndarray] = field(repr=False, compare=False)
    # Pre-quantized FP8 tensors only: returns the Fp8Tensor as stored (`reader` dequantizes it).
    fp8_reader: Callable[[], Fp8Tensor] | None = field(default=None, repr=False, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def load(self) -> np.ndarray:
        """float32, C-contiguous, `shape`; CheckpointError (naming origin and tensor) on NaN/Inf."""
        return self.reader()

    def load_stored(self) -> np.ndarray | Fp8Tensor:
        """What the build encodes: a pre-quantized tensor's Fp8Tensor as stored, else load()."""
        return self.load() if self.fp8_reader is None else self.fp8_reader()


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
# Tensors that only pre-quantized checkpoints (FP8, GPTQ/AWQ, compressed-tensors, bnb) carry. Of
# these, FP8 `weight_scale` is read and `input_scale` ignored under dynamic activations.
_QUANT_SUFFIX = re.compile(
    r"\.(weight_scale|weight_scale_inv|input_scale|weight_zero_point|weight_packed|"
    r"weight_shape|weight_global_scale|input_global_scale|qweight|qzeros|scales|g_idx|absmax|"
    r"quant_map|quant_state\..*)$"
)
_PREQUANT = ("pre-quantized checkpoints are read only as FP8 e4m3 with a per-channel or "
             "per-tensor weight_scale")
# What quantize_fp8 stores in FP8: every linear projection but the router's. Embedding tables
# (and so the tied head), norms and the router stay in higher precision; a checkpoint that has
# one of those in FP8 is not one this reader understands.
_FP8_WEIGHT = re.compile(
    r"(layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|per_layer_input_gate|"
    r"per_layer_projection)|per_layer_model_projection)\.weight"
)


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


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook: a name given twice would silently lose one of its tensors."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"tensor {key} appears twice")
        out[key] = value
    return out


def read_safetensors_header(path: Path) -> list[_Entry]:
    """Parse and validate a safetensors header; entries sorted by data offset.

    Checked: the header length fits the file and the library's limit, the header is a JSON
    object without repeated names, every entry has a known dtype, a shape of non-negative
    integers and two integer data_offsets whose span is exactly shape * itemsize bytes inside
    the data section, and no two tensors' bytes overlap."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, too short)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise CheckpointError(
                    f"{path}: corrupt safetensors header: header length {n} is above the "
                    f"{_MAX_HEADER}-byte limit (not a safetensors file?)"
                )
            if n > size - 8:
                raise CheckpointError(
                    f"{path}: corrupt safetensors header: header length {n} runs past the end "
                    f"of the {size}-byte file (truncated or not a safetensors file?)"
                )
            text = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path}: corrupt safetensors header: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: not a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        what = f"{path}: corrupt safetensors header: tensor {name}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{what}: entry is not a JSON object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _ITEMSIZE:
            raise CheckpointError(f"{what}: unknown dtype {json.dumps(dtype)}")
        if not isinstance(shape, list) or not all(_is_count(x) for x in shape):
            raise CheckpointError(
                f"{what}: shape {json.dumps(shape)} is not a list of integers >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(_is_count(x) for x in offsets)):
            raise CheckpointError(
                f"{what}: data_offsets {json.dumps(offsets)} is not two integers >= 0")
        begin, end = offsets
        if begin > end:
            raise CheckpointError(f"{what}: data_offsets [{begin}, {end}] end before they begin")
        if end > data_len:
            raise CheckpointError(
                f"{path}: tensor {name} data ends at byte {end} but the data section has only "
                f"{data_len} bytes (truncated file?)"
            )
        need = math.prod(shape) * _ITEMSIZE[dtype]
        if end - begin != need:
            raise CheckpointError(
                f"{what}: has {end - begin} bytes but {dtype}{shape} needs {need}"
            )
        entries.append(_Entry(name, dtype, tuple(shape), data_start + begin, end - begin))
    entries.sort(key=lambda e: (e.start, e.nbytes))
    for before, after in itertools.pairwise(entries):
        if after.start < before.start + before.nbytes:
            raise CheckpointError(
                f"{path}: corrupt safetensors header: tensors {before.raw_name} and "
                f"{after.raw_name} overlap (data_offsets [{before.start - data_start}, "
                f"{before.start - data_start + before.nbytes}] and [{after.start - data_start}, "
                f"{after.start - data_start + after.nbytes}])"
            )
    return entries


def _is_count(x: Any) -> bool:
    """A JSON integer >= 0 (true/false are not sizes)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _read_stored(path: str, raw_name: str, start: int, nbytes: int,
                 stored: np.dtype) -> np.ndarray:
    """One tensor's bytes as a flat array of `stored`; CheckpointError on a short read."""
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
    return buf


def read_tensor(path: str, raw_name: str, start: int, nbytes: int, dtype: str,
                shape: tuple[int, ...]) -> np.ndarray:
    """Read one tensor as float32 [shape]; CheckpointError on a short read or NaN/Inf."""
    buf = _read_stored(path, raw_name, start, nbytes, _SUPPORTED_DTYPES[dtype][1])
    if dtype == "BF16":  # bfloat16 is the top half of a float32
        bits = np.empty(buf.shape, np.uint32)
        np.left_shift(buf, np.uint32(16), out=bits, dtype=np.uint32)
        out = bits.view(np.float32)
    else:
        out = buf.astype(np.float32, copy=False)
    out = out.reshape(shape)
    _check_finite(out, f"{path}: tensor {raw_name}")
    return out


def read_fp8_tensor(path: str, weight: _Entry, scale_path: str, scale: _Entry) -> Fp8Tensor:
    """An F8_E4M3 weight [N, K] and its weight_scale ([N, 1], [N], [1] or [], expanded to [N]),
    as stored; CheckpointError on a short read, a NaN value or a NaN/Inf scale."""
    codes = _read_stored(path, weight.raw_name, weight.start, weight.nbytes, np.dtype(np.uint8))
    _check_e4m3(codes, weight.shape, f"{path}: tensor {weight.raw_name}")
    s = read_tensor(scale_path, scale.raw_name, scale.start, scale.nbytes, scale.dtype,
                    scale.shape)
    scales = np.ascontiguousarray(np.broadcast_to(s.reshape(-1), weight.shape[:1]), np.float32)
    return Fp8Tensor(codes.view(ml_dtypes.float8_e4m3fn).reshape(weight.shape), scales)


def _dequantized(read_fp8: Callable[[], Fp8Tensor]) -> np.ndarray:
    return read_fp8().dequantize()


def _check_e4m3(codes: np.ndarray, shape: tuple[int, ...], what: str, step: int = 1 << 24) -> None:
    """e4m3fn has no Inf; S.1111.111 is its NaN."""
    for i in range(0, codes.size, step):
        nan = np.flatnonzero((codes[i:i + step] & 0x7F) == 0x7F)
        if nan.size:
            index = tuple(int(x) for x in np.unravel_index(i + int(nan[0]), shape))
            raise CheckpointError(f"{what} has a NaN at index {list(index)}")


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


def _shard_entries(directory: Path):
    """(file, its validated header entries) for every safetensors file of `directory`, in shard
    order; a sharded checkpoint's index must list only tensors its shards hold."""
    files, weight_map = _weight_files(directory)
    index_path = directory / "model.safetensors.index.json"
    for path in files:
        entries = read_safetensors_header(path)
        if weight_map is not None:
            present = {e.raw_name for e in entries}
            for raw, shard in weight_map.items():
                if shard == path.name and raw not in present:
                    raise CheckpointError(
                        f"{index_path}: lists tensor {raw} in {shard}, which does not contain it"
                    )
        yield path, entries


def _file_tensors(directory: Path, cfg: Gemma4Config,
                  fp8: Fp8Scheme | None) -> tuple[TensorRef, ...]:
    """Validate every header against expected_tensors(cfg) (and, for a pre-quantized checkpoint,
    `fp8`, its quantization_config); TensorRefs in file/offset order."""
    expected = expected_tensors(cfg)
    ignored = _skipped_shared_kv(cfg)
    weights: dict[str, tuple[Path, _Entry]] = {}
    scales: dict[str, tuple[Path, _Entry]] = {}  # weight name -> its weight_scale
    for path, entries in _shard_entries(directory):
        for e in entries:
            name = _canonical_name(e.raw_name)
            if name is None:
                continue
            quant = _QUANT_SUFFIX.search(name)
            if quant:
                weight = name[:quant.start()] + ".weight"
                if weight not in ignored and _is_weight_scale(path, e, quant.group(1), fp8):
                    if weight in scales:
                        raise CheckpointError(f"{path}: tensor {e.raw_name} duplicates the one "
                                              f"in {scales[weight][0].name}")
                    scales[weight] = (path, e)
                continue
            if name in ignored:
                continue
            if name not in expected:
                raise CheckpointError(
                    f"{path}: unexpected tensor {e.raw_name} (not in the Gemma 4 text decoder "
                    f"that {directory / 'config.json'} describes)"
                )
            if name in weights:
                raise CheckpointError(
                    f"{path}: tensor {e.raw_name} duplicates {name} already in "
                    f"{weights[name][0].name}"
                )
            if e.dtype == "F8_E4M3":
                _check_fp8_weight(path, e, name, fp8)
            elif e.dtype not in _SUPPORTED_DTYPES:
                raise CheckpointError(
                    f"{path}: tensor {e.raw_name} has dtype {e.dtype}; only BF16, F16 and F32 "
                    f"are read ({_PREQUANT})"
                )
            if e.shape != expected[name]:
                raise CheckpointError(
                    f"{path}: tensor {e.raw_name} has shape {list(e.shape)}, expected "
                    f"{list(expected[name])}"
                )
            weights[name] = (path, e)
    missing = [n for n in expected if n not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{directory}: missing tensor {missing[0]} {list(expected[missing[0]])}{more}"
        )
    for name, (path, e) in scales.items():
        if name not in weights:
            raise CheckpointError(f"{path}: tensor {e.raw_name} scales {name}, which is not in "
                                  f"the checkpoint")
        if weights[name][1].dtype != "F8_E4M3":
            raise CheckpointError(f"{path}: tensor {e.raw_name} scales {name}, which is "
                                  f"{weights[name][1].dtype}, not F8_E4M3")
    return tuple(_tensor_ref(name, path, e, scales.get(name)) for name, (path, e) in
                 weights.items())


def _is_weight_scale(path: Path, e: _Entry, kind: str, fp8: Fp8Scheme | None) -> bool:
    """Whether a pre-quantized checkpoint's extra tensor is a weight_scale to read (False: an
    input_scale to ignore); CheckpointError for everything this reader does not take."""
    if fp8 is None:
        raise CheckpointError(f"{path}: tensor {e.raw_name} belongs to a pre-quantized "
                              f"checkpoint, but its config.json has no quantization_config "
                              f"({_PREQUANT})")
    if kind == "weight_scale":
        return True
    if kind == "input_scale" and fp8.dynamic_activations:
        return False  # activations are quantized per token at run time: no fixed scale
    if kind == "input_scale":
        raise CheckpointError(f"{path}: tensor {e.raw_name} is a static activation scale, but "
                              f"{fp8.config_path} quantizes no activations")
    if kind == "weight_scale_inv":
        raise CheckpointError(f"{path}: tensor {e.raw_name}: block-wise FP8 scales "
                              f"(weight_scale_inv) are not supported; {_PREQUANT}")
    raise CheckpointError(f"{path}: tensor {e.raw_name}: {kind} tensors are not supported; "
                          f"{_PREQUANT}")


def _check_fp8_weight(path: Path, e: _Entry, name: str, fp8: Fp8Scheme | None) -> None:
    if fp8 is None:
        raise CheckpointError(f"{path}: tensor {e.raw_name} has dtype F8_E4M3, but its "
                              f"config.json has no quantization_config (a pre-quantized "
                              f"checkpoint states one)")
    if not _FP8_WEIGHT.fullmatch(name):
        raise CheckpointError(f"{path}: tensor {e.raw_name} is F8_E4M3, but only linear "
                              f"projections are read as FP8 (embeddings, norms and the router "
                              f"stay in higher precision)")


def _tensor_ref(name: str, path: Path, e: _Entry, scale: tuple[Path, _Entry] | None) -> TensorRef:
    if e.dtype != "F8_E4M3":
        return TensorRef(
            name=name, shape=e.shape, source_dtype=_SUPPORTED_DTYPES[e.dtype][0], origin=str(path),
            reader=functools.partial(read_tensor, str(path), e.raw_name, e.start, e.nbytes,
                                     e.dtype, e.shape),
        )
    if scale is None:
        raise CheckpointError(f"{path}: tensor {e.raw_name} is F8_E4M3 but the checkpoint has no "
                              f"{e.raw_name}_scale")
    scale_path, s = scale
    rows = e.shape[0]
    if s.shape not in ((rows, 1), (rows,), (1,), ()):
        raise CheckpointError(
            f"{scale_path}: tensor {s.raw_name} has shape {list(s.shape)}; FP8 scales are read "
            f"per output row ([{rows}, 1] or [{rows}]) or per tensor ([] or [1]), not block- or "
            f"group-wise"
        )
    if s.dtype not in _SUPPORTED_DTYPES:
        raise CheckpointError(f"{scale_path}: tensor {s.raw_name} has dtype {s.dtype}; scales "
                              f"are read from BF16, F16 or F32")
    read_fp8 = functools.partial(read_fp8_tensor, str(path), e, str(scale_path), s)
    return TensorRef(name=name, shape=e.shape, source_dtype="float8_e4m3fn", origin=str(path),
                     reader=functools.partial(_dequantized, read_fp8), fp8_reader=read_fp8)


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


@dataclass(frozen=True)
class Fp8Scheme:
    """What a pre-quantized FP8 checkpoint's quantization_config states, as far as reading it
    goes; which tensors are FP8 is read from the files themselves."""

    config_path: Path
    # Activations are quantized per token at run time (FP8-Dynamic): any input_scale tensor is
    # a calibration leftover and is ignored. False: weight-only FP8 (no input_scale expected).
    dynamic_activations: bool


def read_fp8_scheme(directory: Path) -> Fp8Scheme | None:
    """config.json's quantization_config (top level or text_config): None if there is none.

    Read: quant_method "compressed-tensors" (format "float-quantized" or "naive-quantized", every
    config group's weights 8-bit float, symmetric, strategy "channel" or "tensor") and quant_method
    "fp8" (fmt e4m3, no weight_block_size). Activations must be dynamic or not quantized at all.
    The FP8 kernels keep activations in bf16, so a dynamic scheme costs nothing to drop, but a
    static one (calibrated input_scale, activations clipped to it) describes a model that an
    artifact ignoring input_scale would not compute: refused, as are block-wise scales
    (weight_scale_inv, strategy "block"), group-wise scales, quantized KV caches, weight
    transforms and every other format."""
    path = directory / "config.json"
    raw = _read_json(path)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    q = raw.get("quantization_config", text.get("quantization_config"))
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"{path}: quantization_config is not a JSON object")
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8_method_scheme(path, q)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(path, q)
    raise CheckpointError(f"{path}: quantization_config quant_method {method!r} is not supported "
                          f"(\"compressed-tensors\" and \"fp8\" are read; {_PREQUANT})")


def _fp8_method_scheme(path: Path, q: dict) -> Fp8Scheme:
    """quant_method "fp8": transformers' FineGrainedFP8 (block-wise), AutoFP8 (per tensor)."""
    if q.get("weight_block_size") is not None:
        raise CheckpointError(f"{path}: quantization_config has weight_block_size "
                              f"{q['weight_block_size']}: block-wise FP8 scales are not "
                              f"supported; {_PREQUANT}")
    if q.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{path}: quantization_config fmt {q['fmt']!r}: only e4m3 is read")
    scheme = q.get("activation_scheme")
    if scheme != "dynamic":
        raise CheckpointError(
            f"{path}: quantization_config activation_scheme is {scheme!r}; pre-quantized FP8 is "
            f"read only with \"dynamic\" activations (static input scales are not applied)"
        )
    return Fp8Scheme(path, dynamic_activations=True)


def _compressed_tensors_scheme(path: Path, q: dict) -> Fp8Scheme:
    if q.get("kv_cache_scheme") is not None:
        raise CheckpointError(f"{path}: quantization_config has a kv_cache_scheme; a quantized "
                              f"KV cache is not supported")
    if q.get("transform_config"):
        raise CheckpointError(f"{path}: quantization_config has a transform_config (rotated "
                              f"weights); not supported")
    sparsity = q.get("sparsity_config")
    if sparsity and (not isinstance(sparsity, dict) or sparsity.get("format") != "dense"):
        raise CheckpointError(f"{path}: quantization_config has a sparsity_config; sparse "
                              f"checkpoints are not supported")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{path}: quantization_config has no config_groups")
    dynamic = False
    for group_name, group in groups.items():
        where = f"{path}: quantization_config.config_groups.{group_name}"
        if not isinstance(group, dict):
            raise CheckpointError(f"{where} is not a JSON object")
        fmt = group.get("format") or q.get("format")  # per group in newer releases
        if fmt not in ("float-quantized", "naive-quantized"):
            raise CheckpointError(f"{where}: format {fmt!r} is not supported ({_PREQUANT})")
        w = group.get("weights")
        if not isinstance(w, dict) or (w.get("num_bits"), w.get("type")) != (8, "float"):
            raise CheckpointError(f"{where}: weights are not 8-bit float ({_PREQUANT})")
        if w.get("strategy") not in ("channel", "tensor"):
            raise CheckpointError(
                f"{where}: weights strategy {w.get('strategy')!r} is not supported; FP8 weights "
                f"are read with one scale per output row (\"channel\") or per tensor (\"tensor\")"
            )
        if w.get("symmetric") is False or w.get("dynamic"):
            raise CheckpointError(f"{where}: weights are not symmetric and static ({_PREQUANT})")
        act = group.get("input_activations")
        if act is not None:
            if not isinstance(act, dict) or act.get("dynamic") is not True:
                raise CheckpointError(
                    f"{where}: input_activations are not dynamic; pre-quantized FP8 is read only "
                    f"with dynamic or unquantized activations (static input scales are not "
                    f"applied)"
                )
            dynamic = True
        if group.get("output_activations") is not None:
            raise CheckpointError(f"{where}: output_activations are quantized; not supported")
    return Fp8Scheme(path, dynamic_activations=dynamic)


def _read_chat_template(directory: Path) -> str | None:
    """The directory's chat template, checked to render in the runtime's sandbox."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        try:
            text = jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{jinja}: cannot read: {e}") from None
        return _checked_chat_template(text, jinja)
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
    return None if template is None else _checked_chat_template(template, tok_cfg_path)


def _checked_chat_template(template: str, where: Path) -> str:
    try:
        chat_template.check(template, bos_token="<bos>", eos_token="<eos>")
    except chat_template.ChatTemplateError as e:
        raise CheckpointError(f"{where}: {e}") from None
    return template


def _generation_config(directory: Path, cfg: Gemma4Config) -> dict[str, Any]:
    """generation_config.json, the config's ids filling a missing bos/pad/eos, eos as a list;
    `_check_tokenizer` checks the ids."""
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
    gen["eos_token_id"] = list(eos) if isinstance(eos, list) else [eos]
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


def _check_tokenizer(directory: Path, tokenizer_json: str, gen: dict[str, Any],
                     cfg: Gemma4Config) -> None:
    """The tokenizer loads as the runtime will load it, and every id it or generation_config
    can produce indexes the embedding: id < vocab_size. Fewer tokens than vocab_size is fine
    (checkpoints pad the embedding; the extra rows are never looked up), an id at or above it
    would read past the table (XLA clamps such a gather: a silently wrong token, not an error)."""
    from tokenizers import Tokenizer

    path = directory / "tokenizer.json"
    try:
        tok = Tokenizer.from_str(tokenizer_json)
    except Exception as e:  # tokenizers raises plain Exception
        raise CheckpointError(f"{path}: the tokenizers library cannot load it "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                              ) from None
    vocab = tok.get_vocab(with_added_tokens=True)
    if vocab:
        token, top = max(vocab.items(), key=lambda kv: kv[1])
        if top >= cfg.vocab_size:
            raise CheckpointError(
                f"{path}: token {token!r} has id {top}, outside the model's vocabulary "
                f"(vocab_size {cfg.vocab_size} in {directory / 'config.json'})"
            )
    where = directory / "generation_config.json"
    for key in ("bos_token_id", "pad_token_id"):
        _check_token_id(where, key, gen[key], cfg.vocab_size)
    for token_id in gen["eos_token_id"]:
        _check_token_id(where, "eos_token_id", token_id, cfg.vocab_size)


def _check_token_id(where: Path, key: str, value: Any, vocab_size: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise CheckpointError(f"{where}: {key} {value!r} is not a token id in [0, {vocab_size})")


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
                    expect: Gemma4Config | None = None, name: str | None = None,
                    random_ranges=None) -> ModelSource:
    """A model directory; `expect` (a preset's config) must agree with its config.json."""
    from rvcompile.sources import random_weights as rw
    from rvcompile.sources import tokenizer_files as tf

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
        tensors = rw.random_tensors(cfg, seed, random_ranges or rw.init_range)
        if not (directory / "tokenizer.json").is_file():
            return ModelSource(
                config=cfg, tensors=tensors, tokenizer_json=tf.synthetic_tokenizer_json(
                    cfg.vocab_size),
                generation_config=tf.default_generation_config(cfg),
                chat_template=tf.default_chat_template(), origin=str(directory),
            )
    else:
        tensors = _file_tensors(directory, cfg, read_fp8_scheme(directory))
    tokenizer_json = _read_tokenizer_json(directory)
    generation_config = _generation_config(directory, cfg)
    _check_tokenizer(directory, tokenizer_json, generation_config, cfg)
    return ModelSource(
        config=cfg, tensors=tensors, tokenizer_json=tokenizer_json,
        generation_config=generation_config,
        chat_template=_read_chat_template(directory), origin=str(directory),
    )


def load_model_source(model: str, *, weights: Path | None = None, random_weights: bool = False,
                      seed: int = 0, random_ranges=None) -> ModelSource:
    """Resolve MODEL (a model directory, else a preset name) and its weights.

    directory                       its config.json, safetensors and tokenizer files
    directory --random-weights      its config.json, random tensors (its tokenizer files if
                                    present, else synthetic ones)
    preset --weights DIR            DIR as a directory; its config must match the preset's shape
    preset --random-weights         preset config, random tensors, synthetic tokenizer files
    MODEL --weights DIR (MODEL a directory) works like a preset: DIR must match MODEL's config.
    A directory wins over a preset of the same name. `random_ranges` (random_weights.RangeRule,
    default random_weights.init_range) says what each random tensor is drawn from.
    """
    from rvcompile.sources import random_weights as rw
    from rvcompile.sources import tokenizer_files as tf

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
        return _load_directory(path, random_weights=random_weights, seed=seed,
                               random_ranges=random_ranges)
    cfg = get_preset(model)
    if not random_weights:
        raise CheckpointError(
            f"preset {model} has no weights of its own: pass --weights DIR (a Hugging Face "
            "checkpoint directory) or --random-weights [--seed S]"
        )
    return ModelSource(
        config=cfg, tensors=rw.random_tensors(cfg, seed, random_ranges or rw.init_range),
        tokenizer_json=tf.synthetic_tokenizer_json(cfg.vocab_size),
        generation_config=tf.default_generation_config(cfg),
        chat_template=tf.default_chat_template(), origin=model,
    )


# ---------------------------------------------------------------------------------------------
# Assistant drafters (`--assistant DIR | PRESET`)


@dataclass(frozen=True)
class AssistantSource:
    config: AssistantConfig
    tensors: tuple[TensorRef, ...]  # exactly expected_assistant_tensors(config), "assistant.*"
    origin: str  # assistant preset name or directory


TOKEN_ORDERING = TENSOR_PREFIX + "masked_embedding.token_ordering"
_INDEX_DTYPES = {"I64": np.dtype("<i8"), "I32": np.dtype("<i4")}


def expected_assistant_tensors(a: AssistantConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name ("assistant." + the checkpoint's name without "model.") -> shape of every
    stored assistant tensor. Its layers have no k/v weights (they read the target's caches);
    `lm_head.weight` is tied to embed_tokens and skipped like a target's."""
    d, hb, v = a.hidden_size, a.backbone_hidden_size, a.vocab_size
    p = TENSOR_PREFIX
    t: dict[str, tuple[int, ...]] = {p + "embed_tokens.weight": (v, d)}
    for s in a.text.layers:
        lp = f"{p}layers.{s.index}."
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            t[lp + norm + ".weight"] = (d,)
        t[lp + "layer_scalar"] = (1,)
        t[lp + "self_attn.q_proj.weight"] = (a.text.num_heads * s.head_dim, d)
        t[lp + "self_attn.q_norm.weight"] = (s.head_dim,)
        t[lp + "self_attn.o_proj.weight"] = (d, a.text.num_heads * s.head_dim)
        t[lp + "mlp.gate_proj.weight"] = (s.mlp_width, d)
        t[lp + "mlp.up_proj.weight"] = (s.mlp_width, d)
        t[lp + "mlp.down_proj.weight"] = (d, s.mlp_width)
    t[p + "norm.weight"] = (d,)
    t[p + "pre_projection.weight"] = (d, 2 * hb)
    t[p + "post_projection.weight"] = (hb, d)
    if a.use_ordered_embeddings:
        t[p + "masked_embedding.centroids.weight"] = (a.num_centroids, d)
        t[TOKEN_ORDERING] = (v,)
    return t


def check_token_ordering(ids: np.ndarray, what: str) -> np.ndarray:
    """`ids` as int32 if it is a permutation of [0, len(ids)) (each token in exactly one
    cluster), else CheckpointError naming `what`."""
    ids = np.asarray(ids).reshape(-1)
    vocab = ids.size
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        raise CheckpointError(f"{what}: entry {int(bad[0])} is {int(ids[bad[0]])}, not a token "
                              f"id in [0, {vocab})")
    counts = np.bincount(ids, minlength=vocab)
    if (counts != 1).any():
        tok = int(np.flatnonzero(counts != 1)[0])
        raise CheckpointError(f"{what}: token {tok} appears {int(counts[tok])} times; every "
                              "token must be in exactly one cluster")
    return ids.astype(np.int32)


def read_token_ordering(path: str, raw_name: str, start: int, nbytes: int,
                        dtype: str) -> np.ndarray:
    """The masked head's token_ordering (I64 or I32) as int32 [V], checked a permutation."""
    ids = _read_stored(path, raw_name, start, nbytes, _INDEX_DTYPES[dtype])
    return check_token_ordering(ids, f"{path}: tensor {raw_name}")


def _assistant_file_tensors(directory: Path, a: AssistantConfig) -> tuple[TensorRef, ...]:
    """Validate every header of an assistant directory against expected_assistant_tensors."""
    expected = expected_assistant_tensors(a)
    found: dict[str, TensorRef] = {}
    for path, entries in _shard_entries(directory):
        for e in entries:
            if e.raw_name == "lm_head.weight":
                continue  # tied to embed_tokens
            name = TENSOR_PREFIX + e.raw_name.removeprefix("model.")
            if name not in expected:
                raise CheckpointError(f"{path}: unexpected tensor {e.raw_name} (not in the "
                                      f"assistant that {directory / 'config.json'} describes)")
            if name in found:
                raise CheckpointError(f"{path}: tensor {e.raw_name} duplicates the one in "
                                      f"{Path(found[name].origin).name}")
            if e.shape != expected[name]:
                raise CheckpointError(f"{path}: tensor {e.raw_name} has shape {list(e.shape)}, "
                                      f"expected {list(expected[name])}")
            if name == TOKEN_ORDERING:
                if e.dtype not in _INDEX_DTYPES:
                    raise CheckpointError(f"{path}: tensor {e.raw_name} has dtype {e.dtype}; "
                                          "token ids are read from I64 or I32")
                found[name] = TensorRef(
                    name=name, shape=e.shape, source_dtype=_INDEX_DTYPES[e.dtype].name,
                    origin=str(path), reader=functools.partial(
                        read_token_ordering, str(path), e.raw_name, e.start, e.nbytes, e.dtype))
                continue
            if e.dtype not in _SUPPORTED_DTYPES:
                raise CheckpointError(f"{path}: tensor {e.raw_name} has dtype {e.dtype}; only "
                                      "BF16, F16 and F32 are read for an assistant")
            found[name] = _tensor_ref(name, path, e, None)
    missing = [n for n in expected if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raw = missing[0].removeprefix(TENSOR_PREFIX)
        raise CheckpointError(f"{directory}: missing tensor {raw} {list(expected[missing[0]])}"
                              f"{more}")
    return tuple(found.values())


def read_assistant_config(directory: Path) -> AssistantConfig:
    path = directory / "config.json"
    raw = _read_json(path)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    try:
        return AssistantConfig.from_hf_dict(raw, name=directory.name, source=str(path))
    except ConfigError:
        raise
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read the config ({type(e).__name__}: {e})") from None


def load_assistant_source(spec: str, target: Gemma4Config, *, random_weights: bool = False,
                          seed: int = 0, random_ranges=None) -> AssistantSource:
    """`--assistant SPEC` for `target`: an assistant directory (config.json + safetensors, or
    random tensors of its shape with `random_weights`) or an assistant preset (random weights
    only, see presets.ASSISTANT_PRESETS). Refuses, in one line, one that does not fit `target`
    (AssistantConfig.target_layers)."""
    from rvcompile.model.presets import ASSISTANT_PRESETS, get_assistant_preset
    from rvcompile.sources import random_weights as rw

    path = Path(spec)
    is_dir = path.is_dir() and (path / "config.json").is_file()
    if is_dir:
        cfg = read_assistant_config(path)
    elif spec in ASSISTANT_PRESETS:
        if not random_weights:
            raise CheckpointError(f"--assistant {spec}: an assistant preset has no weights of "
                                  "its own; pass an assistant directory or --random-weights")
        cfg = get_assistant_preset(spec)
    else:
        raise CheckpointError(f"--assistant {spec}: not an assistant directory (needs "
                              f"config.json) or preset (known: {', '.join(ASSISTANT_PRESETS)})")
    cfg.target_layers(target)
    if random_weights:
        tensors = rw.random_assistant_tensors(cfg, seed, random_ranges or rw.init_range)
    else:
        tensors = _assistant_file_tensors(path, cfg)
    return AssistantSource(cfg, tensors, str(path) if is_dir else spec)
