"""Write a Hugging Face-layout bf16 checkpoint with random weights at a preset's real shapes, laid
out as Google releases Gemma 4: a multimodal config.json (the decoder under "text_config"),
tensors named "model.language_model.*" in ~5 GB safetensors shards with
model.safetensors.index.json, the unused k/v tensors of KV-shared layers, and the tokenizer
files (tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json).

It exists to measure what a build from a released checkpoint costs (benchmarks/build_cost.py,
docs/DEPLOY.md) without downloading one. What differs from a release: the values (uniform, at
the magnitudes random_weights.init_range gives), the tokenizer (the synthetic one of the
vocabulary's size, as `--random-weights` uses) and the vision/audio towers (absent: a build
skips them unread, so they cost download and disk only).

    python benchmarks/hf_checkpoint.py gemma-4-12B /data/g12-hf [--seed 0] [--shard-gb 5]

Tensors are made and written in blocks of rows, so it needs little memory at any size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import struct
import sys
import time
from pathlib import Path

import numpy as np

from rvcompile.model.config import Gemma4Config
from rvcompile.model.presets import PRESETS, get_preset
from rvcompile.sources.model_source import expected_tensors
from rvcompile.sources.random_weights import init_range
from rvcompile.sources.tokenizer_files import (
    default_chat_template,
    default_generation_config,
    synthetic_tokenizer_json,
)

PREFIX = "model.language_model."  # how a released (multimodal) checkpoint names decoder tensors
BLOCK_VALUES = 1 << 25  # values made and written at a time (64 MiB of bf16)


def released_tensors(cfg: Gemma4Config) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape, in model order: every tensor the decoder reads plus the k/v
    projections a release still carries for its KV-shared layers (which the build skips)."""
    out = {}
    for name, shape in expected_tensors(cfg).items():
        out[PREFIX + name] = shape
    for s in cfg.layers:
        if not s.kv_shared:
            continue
        p = f"{PREFIX}layers.{s.index}.self_attn."
        kd = s.num_kv_heads * s.head_dim
        out[p + "k_proj.weight"] = (kd, cfg.hidden_size)
        if not s.k_eq_v:
            out[p + "v_proj.weight"] = (kd, cfg.hidden_size)
        out[p + "k_norm.weight"] = (s.head_dim,)
    return out


def shard_plan(tensors: dict[str, tuple[int, ...]],
               shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Tensors in order, cut into shards of at most `shard_bytes` (one larger tensor alone)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors.items():
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _bf16_block(seed: int, name: str, shape: tuple[int, ...], k: int, n: int) -> np.ndarray:
    """Block k (n values) of tensor `name` as bf16 bits: uniform on init_range, truncated."""
    low, high = init_range(name.removeprefix(PREFIX), shape)
    key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    raw = np.random.SFC64(np.random.SeedSequence([seed, key, k])).random_raw((n + 3) // 4)
    values = raw.view(np.int16)[:n].astype(np.float32)
    values *= np.float32((high - low) / 65536.0)
    values += np.float32((high + low) / 2.0)
    return (values.view(np.uint32) >> 16).astype(np.uint16)


def write_shard(path: Path, entries: list[tuple[str, tuple[int, ...]]], seed: int) -> int:
    """One safetensors file; returns its data bytes."""
    header, offset = {}, 0
    for name, shape in entries:
        nbytes = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned, as torch writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape in entries:
            n = math.prod(shape)
            for k, start in enumerate(range(0, n, BLOCK_VALUES)):
                f.write(_bf16_block(seed, name, shape, k, min(BLOCK_VALUES, n - start)).data)
    return offset


def released_config(cfg: Gemma4Config) -> dict:
    """config.json as a Gemma 4 release carries it: the text decoder under text_config."""
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "dtype": "bfloat16",
        "tie_word_embeddings": True,
        "text_config": {**cfg.to_hf_dict(), "dtype": "bfloat16"},
    }


def write_checkpoint(preset: str, out: Path, *, seed: int = 0, shard_bytes: int = 5 * 10**9,
                     log=print) -> int:
    """Write the checkpoint of `preset` into the new directory `out`; returns its weight bytes."""
    cfg = get_preset(preset)
    out.mkdir(parents=True)
    shards = shard_plan(released_tensors(cfg), shard_bytes)
    weight_map, total = {}, 0
    for i, entries in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        t0 = time.perf_counter()
        total += write_shard(out / fname, entries, seed)
        weight_map.update({name: fname for name, _ in entries})
        log(f"{fname}: {len(entries)} tensors, {time.perf_counter() - t0:.0f} s")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(released_config(cfg), indent=2))
    (out / "generation_config.json").write_text(
        json.dumps(default_generation_config(cfg), indent=2))
    (out / "tokenizer.json").write_text(synthetic_tokenizer_json(cfg.vocab_size))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
         "tokenizer_class": "GemmaTokenizer"}, indent=2))
    (out / "chat_template.jinja").write_text(default_chat_template())
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("preset", choices=list(PRESETS))
    ap.add_argument("out", type=Path, help="a directory to create")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gb", type=float, default=5.0, help="shard size (default 5 GB)")
    args = ap.parse_args(argv)
    if args.out.exists():
        ap.error(f"{args.out} exists")
    t0 = time.perf_counter()
    total = write_checkpoint(args.preset, args.out, seed=args.seed,
                             shard_bytes=int(args.shard_gb * 1e9), log=print)
    print(f"{args.out}: {total / 1e9:.2f} GB of bf16 weights in "
          f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
