"""Pre-quantized FP8 checkpoints (llm-compressor "FP8-Dynamic", compressed-tensors or quant_method
"fp8"): which quantization_configs are read, and which of a checkpoint's tensors belong to them.

A linear projection stored as F8_E4M3 `X.weight` [N, K] with `X.weight_scale` (one scale per
output row, [N, 1] or [N], or one per tensor, [] or [1], expanded to rows) is read as an
Fp8Tensor (checkpoint.py makes its TensorRef). `parse_fp8_scheme` says which quantization_configs
are read and why the others (block-wise scales, static activation scales, other formats) are
refused; `is_weight_scale`, `check_fp8_weight` and `check_fp8_scale` check the tensors against
it. Every error is a one-line CheckpointError naming the file and tensor or field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rvcompile.sources.model_source import CheckpointError
from rvcompile.sources.safetensors_file import SUPPORTED_DTYPES, HeaderEntry

# Tensors that only pre-quantized checkpoints (FP8, GPTQ/AWQ, compressed-tensors, bnb) carry. Of
# these, FP8 `weight_scale` is read and `input_scale` ignored under dynamic activations.
QUANT_SUFFIX = re.compile(
    r"\.(weight_scale|weight_scale_inv|input_scale|weight_zero_point|weight_packed|"
    r"weight_shape|weight_global_scale|input_global_scale|qweight|qzeros|scales|g_idx|absmax|"
    r"quant_map|quant_state\..*)$"
)
PREQUANT = ("pre-quantized checkpoints are read only as FP8 e4m3 with a per-channel or "
             "per-tensor weight_scale")
# What quantize_fp8 stores in FP8: every linear projection but the router's. Embedding tables
# (and so the tied head), norms and the router stay in higher precision; a checkpoint that has
# one of those in FP8 is not one this reader understands.
_FP8_WEIGHT = re.compile(
    r"(layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|per_layer_input_gate|"
    r"per_layer_projection)|per_layer_model_projection)\.weight"
)


@dataclass(frozen=True)
class Fp8Scheme:
    """What a pre-quantized FP8 checkpoint's quantization_config states, as far as reading it
    goes; which tensors are FP8 is read from the files themselves."""

    config_path: Path
    # Activations are quantized per token at run time (FP8-Dynamic): any input_scale tensor is
    # a calibration leftover and is ignored. False: weight-only FP8 (no input_scale expected).
    dynamic_activations: bool


def parse_fp8_scheme(path: Path, raw: dict[str, Any]) -> Fp8Scheme | None:
    """The quantization_config (top level or text_config) of `raw`, the config.json read from
    `path`: None if there is none.

    Read: quant_method "compressed-tensors" (format "float-quantized" or "naive-quantized", every
    config group's weights 8-bit float, symmetric, strategy "channel" or "tensor") and quant_method
    "fp8" (fmt e4m3, no weight_block_size). Activations must be dynamic or not quantized at all.
    The FP8 kernels keep activations in bf16, so a dynamic scheme costs nothing to drop, but a
    static one (calibrated input_scale, activations clipped to it) describes a model that an
    artifact ignoring input_scale would not compute: refused, as are block-wise scales
    (weight_scale_inv, strategy "block"), group-wise scales, quantized KV caches, weight
    transforms and every other format."""
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
                          f"(\"compressed-tensors\" and \"fp8\" are read; {PREQUANT})")


def _fp8_method_scheme(path: Path, q: dict) -> Fp8Scheme:
    """quant_method "fp8": transformers' FineGrainedFP8 (block-wise), AutoFP8 (per tensor)."""
    if q.get("weight_block_size") is not None:
        raise CheckpointError(f"{path}: quantization_config has weight_block_size "
                              f"{q['weight_block_size']}: block-wise FP8 scales are not "
                              f"supported; {PREQUANT}")
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
            raise CheckpointError(f"{where}: format {fmt!r} is not supported ({PREQUANT})")
        w = group.get("weights")
        if not isinstance(w, dict) or (w.get("num_bits"), w.get("type")) != (8, "float"):
            raise CheckpointError(f"{where}: weights are not 8-bit float ({PREQUANT})")
        if w.get("strategy") not in ("channel", "tensor"):
            raise CheckpointError(
                f"{where}: weights strategy {w.get('strategy')!r} is not supported; FP8 weights "
                f"are read with one scale per output row (\"channel\") or per tensor (\"tensor\")"
            )
        if w.get("symmetric") is False or w.get("dynamic"):
            raise CheckpointError(f"{where}: weights are not symmetric and static ({PREQUANT})")
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


def is_weight_scale(path: Path, e: HeaderEntry, kind: str, fp8: Fp8Scheme | None) -> bool:
    """Whether a pre-quantized checkpoint's extra tensor is a weight_scale to read (False: an
    input_scale to ignore); CheckpointError for everything this reader does not take."""
    if fp8 is None:
        raise CheckpointError(f"{path}: tensor {e.raw_name} belongs to a pre-quantized "
                              f"checkpoint, but its config.json has no quantization_config "
                              f"({PREQUANT})")
    if kind == "weight_scale":
        return True
    if kind == "input_scale" and fp8.dynamic_activations:
        return False  # activations are quantized per token at run time: no fixed scale
    if kind == "input_scale":
        raise CheckpointError(f"{path}: tensor {e.raw_name} is a static activation scale, but "
                              f"{fp8.config_path} quantizes no activations")
    if kind == "weight_scale_inv":
        raise CheckpointError(f"{path}: tensor {e.raw_name}: block-wise FP8 scales "
                              f"(weight_scale_inv) are not supported; {PREQUANT}")
    raise CheckpointError(f"{path}: tensor {e.raw_name}: {kind} tensors are not supported; "
                          f"{PREQUANT}")


def check_fp8_weight(path: Path, e: HeaderEntry, name: str, fp8: Fp8Scheme | None) -> None:
    """An F8_E4M3 tensor `name` is a linear projection of a checkpoint that states `fp8`."""
    if fp8 is None:
        raise CheckpointError(f"{path}: tensor {e.raw_name} has dtype F8_E4M3, but its "
                              f"config.json has no quantization_config (a pre-quantized "
                              f"checkpoint states one)")
    if not _FP8_WEIGHT.fullmatch(name):
        raise CheckpointError(f"{path}: tensor {e.raw_name} is F8_E4M3, but only linear "
                              f"projections are read as FP8 (embeddings, norms and the router "
                              f"stay in higher precision)")




def check_fp8_scale(scale_path: Path, s: HeaderEntry, rows: int) -> None:
    """The weight_scale `s` of an F8_E4M3 weight of `rows` output rows is per row or per tensor,
    in a float dtype."""
    if s.shape not in ((rows, 1), (rows,), (1,), ()):
        raise CheckpointError(
            f"{scale_path}: tensor {s.raw_name} has shape {list(s.shape)}; FP8 scales are read "
            f"per output row ([{rows}, 1] or [{rows}]) or per tensor ([] or [1]), not block- or "
            f"group-wise"
        )
    if s.dtype not in SUPPORTED_DTYPES:
        raise CheckpointError(f"{scale_path}: tensor {s.raw_name} has dtype {s.dtype}; scales "
                              f"are read from BF16, F16 or F32")
