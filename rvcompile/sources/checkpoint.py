"""A Hugging Face model directory, and MODEL resolution: turn `MODEL [--weights DIR |
--random-weights --seed S]` into a validated, streamable ModelSource (model_source.py).

`load_model_source` resolves MODEL (a preset name or a Hugging Face model directory), reads and
checks everything that is cheap to check up front (config, every safetensors header, tensor
names, shapes and dtypes, tokenizer files) and returns a `ModelSource` whose `TensorRef`s read
one tensor each on `load()` (values, NaN/Inf, are checked there). Nothing loads the whole model.

Checkpoint names map to the decoder's canonical ones (model_source.expected_tensors):
multimodal files ("model.language_model." prefix) are read the same way; vision/audio towers,
their embedders, `lm_head.weight` (tied) and the unused k/v tensors of KV-shared layers are
skipped. The files are read by safetensors_file.py; a pre-quantized FP8 checkpoint's
quantization_config and scales are checked by fp8_schemes.py. Every error is a one-line
`CheckpointError` (or `ConfigError` from the config parser) naming the file and/or tensor.

An assistant drafter's directory (`--assistant DIR`, `load_assistant_source`; or, with random
weights, an assistant preset) is read the same way: its config.json (model_type
gemma4_assistant / gemma4_unified_assistant) checked and refused in one line when it does not
fit the target (AssistantConfig.target_layers), its tensors named "assistant." + the
checkpoint's name without "model." (model_source.expected_assistant_tensors), BF16, F16 or F32,
and its masked head's token_ordering I64 or I32, checked on load to be a permutation of the
vocabulary (each token in exactly one cluster).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import numpy as np

from rvcompile import chat_template
from rvcompile.model.assistant import TENSOR_PREFIX, AssistantConfig
from rvcompile.model.config import ConfigError, Gemma4Config
from rvcompile.model.presets import PRESETS, get_preset
from rvcompile.sources import random_weights as rw
from rvcompile.sources import tokenizer_files as tf
from rvcompile.sources.fp8_schemes import (
    PREQUANT,
    QUANT_SUFFIX,
    Fp8Scheme,
    check_fp8_scale,
    check_fp8_weight,
    is_weight_scale,
    parse_fp8_scheme,
)
from rvcompile.sources.model_source import (
    TOKEN_ORDERING,
    AssistantSource,
    CheckpointError,
    ModelSource,
    TensorRef,
    expected_assistant_tensors,
    expected_tensors,
)
from rvcompile.sources.safetensors_file import (
    SUPPORTED_DTYPES,
    HeaderEntry,
    dequantized,
    read_fp8_rows,
    read_fp8_tensor,
    read_rows,
    read_safetensors_header,
    read_stored,
    read_tensor,
)


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


def input_files(directory: Path, *, weights: bool = True) -> list[Path]:
    """The files a load of `directory` reads, sorted by name (what a recipe's digest covers,
    provenance.py): config.json, the tokenizer and generation config, the chat template
    (chat_template.jinja, else tokenizer_config.json), and with `weights` the safetensors files
    and their index (without `weights` and tokenizer.json: config.json alone, the rest being
    synthetic). CheckpointError as the load's when the weights are missing."""
    if not weights and not (directory / "tokenizer.json").is_file():
        return [directory / "config.json"]  # random weights and synthetic tokenizer files
    names = ["config.json", "tokenizer.json", "generation_config.json"]
    names.append("chat_template.jinja" if (directory / "chat_template.jinja").is_file()
                 else "tokenizer_config.json")
    files = [directory / n for n in names if (directory / n).is_file()]
    if weights:
        shards, index = _weight_files(directory)
        files += shards
        if index is not None:
            files.append(directory / "model.safetensors.index.json")
    return sorted(files)


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
    weights: dict[str, tuple[Path, HeaderEntry]] = {}
    scales: dict[str, tuple[Path, HeaderEntry]] = {}  # weight name -> its weight_scale
    for path, entries in _shard_entries(directory):
        for e in entries:
            name = _canonical_name(e.raw_name)
            if name is None:
                continue
            quant = QUANT_SUFFIX.search(name)
            if quant:
                weight = name[:quant.start()] + ".weight"
                if weight not in ignored and is_weight_scale(path, e, quant.group(1), fp8):
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
                check_fp8_weight(path, e, name, fp8)
            elif e.dtype not in SUPPORTED_DTYPES:
                raise CheckpointError(
                    f"{path}: tensor {e.raw_name} has dtype {e.dtype}; only BF16, F16 and F32 "
                    f"are read ({PREQUANT})"
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


def _tensor_ref(name: str, path: Path, e: HeaderEntry,
                scale: tuple[Path, HeaderEntry] | None) -> TensorRef:
    if e.dtype != "F8_E4M3":
        return TensorRef(
            name=name, shape=e.shape, source_dtype=SUPPORTED_DTYPES[e.dtype][0], origin=str(path),
            reader=functools.partial(read_tensor, str(path), e.raw_name, e.start, e.dtype,
                                     e.shape),
            rows=functools.partial(read_rows, str(path), e.raw_name, e.start, e.dtype, e.shape),
        )
    if scale is None:
        raise CheckpointError(f"{path}: tensor {e.raw_name} is F8_E4M3 but the checkpoint has no "
                              f"{e.raw_name}_scale")
    scale_path, s = scale
    check_fp8_scale(scale_path, s, e.shape[0])
    read_fp8 = functools.partial(read_fp8_tensor, str(path), e, str(scale_path), s)
    return TensorRef(name=name, shape=e.shape, source_dtype="float8_e4m3fn", origin=str(path),
                     reader=functools.partial(dequantized, read_fp8), fp8_reader=read_fp8,
                     rows=functools.partial(read_fp8_rows, str(path), e, str(scale_path), s))


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


def read_chat_template_file(path: Path) -> str:
    """A chat template file (`rvcompile build --chat-template FILE`): UTF-8 Jinja text that
    compiles and renders a sample conversation in the runtime's sandbox; CheckpointError (one
    line naming the file) otherwise."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"--chat-template {path}: cannot read: {e}") from None
    if not text.strip():
        raise CheckpointError(f"--chat-template {path}: the file is empty")
    return _checked_chat_template(text, Path(f"--chat-template {path}"))


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
        config_path = directory / "config.json"
        fp8 = parse_fp8_scheme(config_path, _read_json(config_path))
        tensors = _file_tensors(directory, cfg, fp8)
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
    if weights is not None and random_weights:
        raise CheckpointError("pass either --weights DIR or --random-weights, not both")
    path = Path(model)
    is_dir = path.is_dir() and (path / "config.json").is_file()
    if not is_dir and model not in PRESETS:
        if path.exists():
            raise CheckpointError(f"{model}: not a model directory (needs config.json)")
        if "/" in model or model.startswith("."):
            raise CheckpointError(f"{model}: no such directory")
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

_INDEX_DTYPES = {"I64": np.dtype("<i8"), "I32": np.dtype("<i4")}


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
    ids = read_stored(path, raw_name, start, nbytes, _INDEX_DTYPES[dtype])
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
            if e.dtype not in SUPPORTED_DTYPES:
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
