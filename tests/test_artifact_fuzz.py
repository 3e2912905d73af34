"""Damaged and crafted artifacts: every one is refused in one line naming what is wrong, by every
reader, and none gives a traceback (issue 12, "contents validated after the hashes").

Inputs, seeded and bounded, from a tiny XLA artifact and a tiny h100-fp8 artifact (built here;
the h100 one needs nvcc, not a GPU):
  - truncations and appended bytes;
  - random byte flips, hashes left as they are (the hashes or the zero padding must catch them);
  - header JSON edits with the header checksum recomputed;
  - manifest edits with its sha256 and the header recomputed: curated defects (wrong types,
    negative, zero and huge numbers, missing keys, offsets past the end, tables too small, a
    launch of a kernel the cubin lacks, ...), random leaves replaced by an object or a huge
    number or removed, deep nesting, bad UTF-8, NaN, a manifest that is not an object;
  - section edits with the piece digests, table and header recomputed: tokenizer, generation
    config, chat template, cubins (ELF damage, parameter sizes), XLA programs.
Readers: `verify_artifact` (open, manifest, every hash, contents, programs: what `rvcompile
verify` runs), `rvcompile inspect`, `rvcompile verify` and `rvrun` (runtime load; an h100
artifact stops at "no GPU" here, itself a one-line refusal, after validation). `inspect` reads
no section bytes, so it may accept damage inside a section; every other pair must refuse.
The tally (inputs, refusals, acceptances, tracebacks per reader) is printed (-s shows it).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import struct
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import typer

from rvcompile import cli
from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.artifacts.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    align_up,
    canonical_json,
    piece_count,
)
from rvcompile.artifacts.kernel_schedule import (
    MAX_SCHEDULE_VERSION,
    MIN_SCHEDULE_VERSION,
    SCHEDULE_VERSION,
)
from rvcompile.artifacts.verify import verify_artifact
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.runtime.cli import main as rvrun

SEED = 20261124
# Small on purpose: every reader parses the whole manifest of every input (an h100 schedule
# holds every launch of every entry point).
XLA_OPTS = {"max_context": 64, "prefill_buckets": (8, 16), "max_seqs": 1, "decode_loop_steps": 8}
H100_OPTS = {"max_context": 64, "prefill_buckets": (16,), "max_seqs": 1}
READERS = ("api", "inspect", "verify", "rvrun")
_PREFIX = struct.Struct("<8sII32s")
DEEP = 5000  # nesting levels, past Python's recursion limit
MACHINE_CHECK = "needs an NVIDIA H100"  # rvrun's refusal of this machine, after validation


# ---------------------------------------------------------------------------------------------
# Reassembling a file with every hash recomputed (independent of ArtifactWriter, which refuses
# the defects these tests need)


@dataclass
class Parts:
    """An artifact taken apart: edit these, then `assemble` with every hash recomputed."""

    header: dict  # compiler_version, target, platforms, requirements
    sections: dict[str, bytes]
    manifest: dict
    piece_size: int
    manifest_json: bytes = b""  # the pristine manifest, for cheap fresh copies

    @classmethod
    def read(cls, path: Path) -> Parts:
        with Artifact.open(path) as art:
            h = art.header
            body = canonical_json(art.manifest)
            return cls({"compiler_version": h.compiler_version, "target": h.target,
                        "platforms": list(h.platforms), "requirements": dict(h.requirements)},
                       {n: bytes(art.buffer(n)) for n in art.sections},
                       json.loads(body), art.piece_size, body)

    def copy(self) -> Parts:
        return Parts(copy.deepcopy(self.header), dict(self.sections),
                     json.loads(self.manifest_json), self.piece_size, self.manifest_json)


# id(section bytes) -> (those bytes, their piece digests): unchanged sections (the weights) are
# shared by every case and hashed once; holding the bytes keeps their id from being reused.
_DIGESTS: dict[int, tuple[bytes, bytes]] = {}


def _piece_digests(data: bytes, piece_size: int) -> bytes:
    if id(data) not in _DIGESTS:
        _DIGESTS[id(data)] = (data, b"".join(
            hashlib.sha256(data[i * piece_size:(i + 1) * piece_size]).digest()
            for i in range(piece_count(len(data), piece_size))))
    return _DIGESTS[id(data)][1]


def assemble(p: Parts, *, manifest_bytes: bytes | None = None,
             edit_header: Callable[[dict], None] | None = None,
             header_json: bytes | None = None, version: int = FORMAT_VERSION) -> bytes:
    out = bytearray(HEADER_SIZE)
    spans = []
    for name, data in p.sections.items():
        out.extend(bytes(align_up(len(out)) - len(out)))
        spans.append({"name": name, "offset": len(out), "size": len(data)})
        out.extend(data)
    table = b"".join(_piece_digests(d, p.piece_size) for d in p.sections.values())
    body = canonical_json(p.manifest) if manifest_bytes is None else manifest_bytes
    blobs = []
    for blob in (table, body):
        out.extend(bytes(align_up(len(out)) - len(out)))
        blobs.append({"offset": len(out), "length": len(blob),
                      "sha256": hashlib.sha256(blob).hexdigest()})
        out.extend(blob)
    doc = {**copy.deepcopy(p.header), "sections": spans, "piece_size": p.piece_size,
           "piece_digests": blobs[0], "manifest": blobs[1]}
    if edit_header:
        edit_header(doc)
    hj = canonical_json(doc) if header_json is None else header_json
    block = _PREFIX.pack(MAGIC, version, len(hj), hashlib.sha256(hj).digest()) + hj
    out[:HEADER_SIZE] = block[:HEADER_SIZE].ljust(HEADER_SIZE, b"\0")
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# Paths into the manifest


def get(d, path: tuple):
    for k in path:
        d = d[k]
    return d


def put(d, path: tuple, value) -> None:
    get(d, path[:-1])[path[-1]] = value


def drop(d, path: tuple) -> None:
    del get(d, path[:-1])[path[-1]]


def leaves(d, path: tuple = ()) -> Iterator[tuple]:
    if isinstance(d, dict):
        for k, v in d.items():
            yield from leaves(v, (*path, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from leaves(v, (*path, i))
    else:
        yield path


# The model config keys the schema checks (the rest of config.json is carried, not used).
CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
               "max_position_embeddings", "sliding_window", "layer_types",
               "num_kv_shared_layers", "hidden_size_per_layer_input",
               "vocab_size_per_layer_input", "rms_norm_eps", "attention_k_eq_v",
               "enable_moe_block", "use_double_wide_mlp", "eos_token_id", "bos_token_id",
               "pad_token_id", "num_experts", "top_k_experts", "moe_intermediate_size")


def checked_leaves(m: dict, runtime: str) -> list[tuple]:
    """Leaves whose every scalar value the schema type-checks."""
    out = [p for p in leaves(m[runtime], (runtime,))]
    out += [p for p in leaves(m["model"]["config"], ("model", "config")) if p[2] in CONFIG_KEYS]
    return out + [("model", "name"), ("target",)]


# ---------------------------------------------------------------------------------------------
# The inputs


@dataclass(frozen=True)
class Case:
    label: str
    make: Callable[[], bytes]  # the file's bytes (made when run: a case is megabytes)
    inspect_may_accept: bool = False  # the damage lies where inspect never reads (sections)


# Manifest defects only the section bytes reveal (programs' signatures, the cubins' kernels):
# `inspect` reads neither.
READ_BY_VERIFY_ONLY = {
    "programs swapped", "weight shape unlike the program", "pool shape unlike the program",
    "pool layers unlike the program", "pools fixed, the program's symbolic",
    "scale pool row unlike the program",
    "launch of a kernel the cubin lacks",
    "block past the kernel's bound", "argument dropped", "argument added",
    "cubin sha256 wrong"}


def _manifest_case(p: Parts, label: str, edit: Callable[[dict], None]) -> Case:
    def make() -> bytes:
        q = p.copy()
        edit(q.manifest)
        return assemble(q)

    return Case(f"manifest {label}", make, inspect_may_accept=label in READ_BY_VERIFY_ONLY)


def _raw_manifest_case(p: Parts, label: str, path: tuple, raw: bytes) -> Case:
    """The manifest with the value at `path` replaced by raw JSON text `raw`."""
    def make() -> bytes:
        q = p.copy()
        put(q.manifest, path, "@@RAW@@")
        return assemble(q, manifest_bytes=canonical_json(q.manifest).replace(b'"@@RAW@@"', raw))

    return Case(f"manifest raw {label}", make)


def _section_case(p: Parts, label: str, name: str, data: bytes,
                  edit: Callable[[dict], None] | None = None) -> Case:
    def make() -> bytes:
        q = p.copy()
        q.sections[name] = data
        if edit:
            edit(q.manifest)
        return assemble(q)

    return Case(f"section {name}: {label}", make, inspect_may_accept=True)


def _set(path: tuple, value) -> Callable[[dict], None]:
    return lambda m: put(m, path, value)


def _del(path: tuple) -> Callable[[dict], None]:
    return lambda m: drop(m, path)


def damage_cases(pristine: bytes, p: Parts, rng: random.Random, n: int) -> list[Case]:
    """Truncations, appended bytes and byte flips of the pristine file, hashes untouched."""
    with_sections = []  # [start, end) of section bytes (inspect never reads them)
    pos = HEADER_SIZE
    for data in p.sections.values():
        pos = align_up(pos)
        with_sections.append((pos, pos + len(data)))
        pos += len(data)
    cases = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            cut = rng.randrange(len(pristine))
            cases.append(Case(f"truncated to {cut} bytes", lambda cut=cut: pristine[:cut]))
        elif kind == 1:
            extra = bytes([rng.randrange(256)]) * rng.randint(1, 5000)
            cases.append(Case(f"{len(extra)} bytes appended", lambda e=extra: pristine + e))
        else:
            flips = {rng.randrange(len(pristine)): rng.randrange(1, 256)
                     for _ in range(rng.randint(1, 3))}
            inside = all(any(s <= a < e for s, e in with_sections) for a in flips)
            cases.append(Case(f"bytes flipped at {sorted(flips)}",
                              lambda f=flips: _flipped(pristine, f), inspect_may_accept=inside))
    return cases


def _flipped(data: bytes, flips: dict[int, int]) -> bytes:
    out = bytearray(data)
    for at, mask in flips.items():
        out[at] ^= mask
    return bytes(out)


def header_cases(p: Parts) -> list[Case]:
    def sec(i: int, key: str, value) -> Callable[[dict], None]:
        return lambda d: d["sections"][i].__setitem__(key, value)

    def edit(f: Callable[[dict], None]) -> Callable[[dict], None]:
        return f

    first = next(iter(p.sections))
    edits = {
        "section offset unaligned": sec(0, "offset", HEADER_SIZE + 1),
        "section offset a block late": sec(1, "offset", 0),
        "section offset past EOF": sec(-1, "offset", 1 << 40),
        "section size negative": sec(0, "size", -1),
        "section size huge": sec(0, "size", 1 << 62),
        "section size a string": sec(0, "size", "12"),
        "section name with a newline": sec(0, "name", "weights\nboom"),
        "section named twice": sec(1, "name", first),
        "piece_size zero": edit(lambda d: d.__setitem__("piece_size", 0)),
        "piece_size negative": edit(lambda d: d.__setitem__("piece_size", -4096)),
        "piece_size a float": edit(lambda d: d.__setitem__("piece_size", 1.5)),
        "manifest length past EOF": edit(lambda d: d["manifest"].__setitem__("length", 1 << 33)),
        "manifest offset overlapping": edit(lambda d: d["manifest"].__setitem__("offset",
                                                                               HEADER_SIZE)),
        "digest table too short": edit(lambda d: d["piece_digests"].__setitem__("length", 32)),
        "platforms a string": edit(lambda d: d.__setitem__("platforms", "cpu")),
        "platform with a newline": edit(lambda d: d.__setitem__("platforms", ["cpu\nx"])),
        "requirements a list": edit(lambda d: d.__setitem__("requirements", [])),
        "runtime unknown": edit(lambda d: d["requirements"].__setitem__("runtime", "tpu")),
        "runtime missing": edit(lambda d: d["requirements"].pop("runtime")),
        "target differs": edit(lambda d: d.__setitem__("target", "xla-f32")),
        "target missing": edit(lambda d: d.pop("target")),
        "sections missing": edit(lambda d: d.pop("sections")),
        "sections a dict": edit(lambda d: d.__setitem__("sections", {})),
        "platforms empty": edit(lambda d: d.__setitem__("platforms", [])),
    }
    if p.header["requirements"]["runtime"] == "xla":
        edits["jax requirement differs"] = edit(
            lambda d: d["requirements"].__setitem__("jax", ">=99.0"))
        edits["min_devices without a mesh"] = edit(
            lambda d: d["requirements"].__setitem__("min_devices", 4))
    else:
        edits["arena_bytes differs"] = edit(
            lambda d: d["requirements"].__setitem__("arena_bytes", 4096))
        edits["min_driver a string"] = edit(
            lambda d: d["requirements"].__setitem__("min_driver", "13000"))
        edits["compute_capability an int"] = edit(
            lambda d: d["requirements"].__setitem__("compute_capability", 9))
        edits["platforms not cuda"] = edit(lambda d: d.__setitem__("platforms", ["cpu"]))
    cases = [Case(f"header {k}", lambda e=e: assemble(p, edit_header=e))
             for k, e in edits.items()]
    raw = {
        "nested too deeply": b"[" * 2000 + b"]" * 2000,
        "not JSON": b"{not json",
        "bad UTF-8": b'{"target": "\xff\xfe"}',
        "a list": b"[]",
        "NaN piece size": canonical_json({"x": 1})[:-1] + b',"piece_size":NaN}',
        "empty": b"",
    }
    cases += [Case(f"header JSON {k}", lambda v=v: assemble(p, header_json=v))
              for k, v in raw.items()]
    cases += [Case(f"format version {v}", lambda v=v: assemble(p, version=v))
              for v in (0, FORMAT_VERSION - 1, FORMAT_VERSION + 1, 0xFFFFFFFF)]
    cases.append(Case("header padding not zero",
                      lambda: _flipped(assemble(p), {HEADER_SIZE - 1: 1})))
    return cases


def manifest_cases(p: Parts, rng: random.Random, n_random: int) -> list[Case]:
    m = p.manifest
    runtime = p.header["requirements"]["runtime"]
    vocab = m["model"]["config"]["vocab_size"]
    edits: dict[str, Callable[[dict], None]] = {
        "model missing": _del(("model",)),
        "model config missing": _del(("model", "config")),
        f"{runtime} part missing": _del((runtime,)),
        "the other runtime's part": _set(("h100" if runtime == "xla" else "xla",), {}),
        "vocab_size zero": _set(("model", "config", "vocab_size"), 0),
        "vocab_size negative": _set(("model", "config", "vocab_size"), -1024),
        "vocab_size a string": _set(("model", "config", "vocab_size"), "1024"),
        "vocab_size a float": _set(("model", "config", "vocab_size"), 1024.0),
        "vocab_size true": _set(("model", "config", "vocab_size"), True),
        "layers differ from layer_types": _set(("model", "config", "num_hidden_layers"), 7),
        "layer_types unknown": _set(("model", "config", "layer_types"), ["x"] * 8),
        "heads not a multiple of KV heads": _set(("model", "config", "num_attention_heads"), 3),
        "head_dim odd": _set(("model", "config", "head_dim"), 31),
        "eos past the vocabulary": _set(("model", "config", "eos_token_id"), vocab),
        "eos empty list": _set(("model", "config", "eos_token_id"), []),
        "bos negative": _set(("model", "config", "bos_token_id"), -1),
        "model name with a newline": _set(("model", "name"), "tiny\nrm -rf"),
        "target differs from the header": _set(("target",), "xla-fp8"),
        "passes not a list": _set(("passes",), "cast_bf16"),
        "random_weights seed a string": _set(("random_weights",), {"seed": "0"}),
    }
    if runtime == "xla":
        x = ("xla",)
        decode, prefill = f"decode_{m['xla']['max_seqs']}", f"prefill_{m['xla']['max_chunk']}"
        edits |= {
            "max_seqs zero": _set((*x, "max_seqs"), 0),
            "max_seqs with no decode program": _set((*x, "max_seqs"), 3),
            "max_context below max_chunk": _set((*x, "max_context"), m["xla"]["max_chunk"] - 1),
            "max_chunk not the largest bucket": _set((*x, "max_chunk"),
                                                     m["xla"]["max_chunk"] // 2),
            "prefill_buckets descending": _set((*x, "prefill_buckets"), [32, 8]),
            "prefill_buckets empty": _set((*x, "prefill_buckets"), []),
            "decode loop longer than a chunk": _set((*x, "decode_loop", "steps"), 64),
            "entry_points not the programs": _set((*x, "entry_points"), [decode]),
            "program missing": _del((*x, "programs", decode)),
            "program offset past the section": _set((*x, "programs", decode, "offset"),
                                                    1 << 40),
            "program size zero": _set((*x, "programs", decode, "size"), 0),
            "program size negative": _set((*x, "programs", decode, "size"), -5),
            "program named oddly": lambda mm: mm["xla"]["programs"].update(
                {"warm\nup": mm["xla"]["programs"][decode]}),
            "programs swapped": lambda mm: mm["xla"]["programs"].update({
                decode: mm["xla"]["programs"][prefill], prefill: mm["xla"]["programs"][decode]}),
            "weight offset past the section": _set((*x, "weights", 0, "offset"), 1 << 40),
            "weight nbytes not its shape": _set((*x, "weights", 0, "nbytes"), 4),
            "weight shape negative": _set((*x, "weights", 0, "shape"), [-1, 128]),
            "weight dtype unknown": _set((*x, "weights", 0, "dtype"), "float64"),
            "weight shape unlike the program": lambda mm: mm["xla"]["weights"][0].update(
                shape=[512, 256]),
            "weights named twice": lambda mm: mm["xla"]["weights"][1].update(
                key=mm["xla"]["weights"][0]["key"]),
            "weights empty": _set((*x, "weights"), []),
            "block_size zero": _set((*x, "kv", "block_size"), 0),
            "block_size negative": _set((*x, "kv", "block_size"), -3),
            "block_size huge": _set((*x, "kv", "block_size"), 1 << 40),
            "table_width zero": _set((*x, "kv", "kinds", "full", "table_width"), 0),
            "table too narrow for the context": _set((*x, "kv", "kinds", "full",
                                                      "table_width"), 2),
            "sliding window zero": _set((*x, "kv", "kinds", "sliding", "window"), 0),
            "sliding window null": _set((*x, "kv", "kinds", "sliding", "window"), None),
            "full kind a ring": _set((*x, "kv", "kinds", "full", "ring"), True),
            "default_blocks huge": _set((*x, "kv", "kinds", "full", "default_blocks"), 10**9),
            "KV kinds empty": _set((*x, "kv", "kinds"), {}),
            "KV kind unknown": lambda mm: mm["xla"]["kv"]["kinds"].update(
                medium=mm["xla"]["kv"]["kinds"]["full"]),
            "pool kind unknown": _set((*x, "kv", "pools", 0, "kind"), "medium"),
            "pool block not the block size": _set((*x, "kv", "pools", 0, "block_shape"),
                                                  [8, 2, 32]),
            "pool shape unlike the program": lambda mm: mm["xla"]["kv"]["pools"][0].update(
                block_shape=[16, 2, 33]),
            # a block of one row is a scale pool's form only (format v7's changelog entry)
            "pool block a row, not a scale pool": _set((*x, "kv", "pools", 0, "block_shape"),
                                                       [1, 128]),
            "scale pool row unlike the program": lambda mm: mm["xla"]["kv"]["pools"][0].update(
                key=mm["xla"]["kv"]["pools"][0]["key"] + ".scale", block_shape=[1, 128]),
            "scale pool row of zero lanes": lambda mm: mm["xla"]["kv"]["pools"][0].update(
                key=mm["xla"]["kv"]["pools"][0]["key"] + ".scale", block_shape=[1, 0]),
            "pool layers unlike the program": _set((*x, "kv", "pools", 0, "layers"), 1000),
            "pool dtype unknown": _set((*x, "kv", "pools", 0, "dtype"), "complex64"),
            "fixed_blocks not a bool": _set((*x, "kv", "fixed_blocks"), "yes"),
            "fixed_blocks null": _set((*x, "kv", "fixed_blocks"), None),
            "fixed_blocks a number": _set((*x, "kv", "fixed_blocks"), 1),
            "pools fixed, the program's symbolic": _set((*x, "kv", "fixed_blocks"), True),
            "mesh naming no arrays": _set((*x, "mesh"), {"axis": "tp", "size": 2,
                                                         "weights": {}, "pools": {}}),
            "jax_version not a version": _set((*x, "jax_version"), "latest"),
            "platforms lack the header's": _set((*x, "platforms"), ["tpu"]),
            "layer group negative": _set((*x, "layer_groups", 0, "start"), -1),
            "precompiled without executables": _set((*x, "precompiled"), {"cpu:1": {}}),
        }
    else:
        s = ("h100", "schedule")
        sched = m["h100"]["schedule"]
        decode = f"decode_{sched['max_seqs']}"
        module = sched["entries"][decode]["launches"][0]["module"]
        launch = (*s, "entries", decode, "launches", 0)
        names = [a["name"] for a in sched["entries"][decode]["launches"][0]["args"]]
        pool_arg = next((i, j) for i, x in enumerate(sched["entries"][decode]["launches"])
                        for j, a in enumerate(x["args"]) if a["kind"] == "pool")
        pools = sched["kv"]["pools"]
        edits |= {
            "schedule version missing": _del((*s, "version")),
            "schedule version newer": _set((*s, "version"), 99),
            "schedule version a string": _set((*s, "version"), "1"),
            "arena_bytes zero": _set((*s, "arena_bytes"), 0),
            "arena too small for its regions": _set((*s, "arena_bytes"),
                                                    sched["io_offset"] + 4),
            "weights_bytes not the section": _set((*s, "weights_bytes"), 4096),
            "constants overlapping the weights": _set((*s, "constants_offset"), 0),
            "io overlapping the constants": _set((*s, "io_offset"), sched["constants_offset"]),
            "max_seqs zero": _set((*s, "max_seqs"), 0),
            "max_seqs with no decode entry": _set((*s, "max_seqs"), 3),
            "max_chunk zero": _set((*s, "max_chunk"), 0),
            "vocab_size not the model's": _set((*s, "vocab_size"), 1000),
            "block_size zero": _set((*s, "kv", "block_size"), 0),
            "block_size a string": _set((*s, "kv", "block_size"), "16"),
            "table_width zero": _set((*s, "kv", "kinds", 0, "table_width"), 0),
            "table too narrow for the context": _set((*s, "kv", "kinds", 0, "table_width"), 1),
            "KV pools missing": _del((*s, "kv", "pools")),
            "KV pools empty": _set((*s, "kv", "pools"), []),
            "KV pool of an unknown kind": _set((*s, "kv", "pools", 0, "kind"), "global"),
            "KV pool block_bytes zero": _set((*s, "kv", "pools", 0, "block_bytes"), 0),
            "KV pool block_bytes not whole rows": _set((*s, "kv", "pools", 0, "block_bytes"),
                                                       pools[0]["block_bytes"] + 1),
            "KV pool layer negative": _set((*s, "kv", "pools", 0, "layer"), -1),
            "KV kind without a pool": _set((*s, "kv", "pools"),
                                           [p for p in pools if p["kind"] == pools[0]["kind"]]
                                           if len({p["kind"] for p in pools}) > 1 else []),
            "pool argument naming no pool": _set(
                (*s, "entries", decode, "launches", pool_arg[0], "args", pool_arg[1], "value"),
                len(pools)),
            "pool argument negative": _set(
                (*s, "entries", decode, "launches", pool_arg[0], "args", pool_arg[1], "value"),
                -1),
            "KV io field missing": _set((*s, "kv", "kinds", 0, "io_field"), "table_none"),
            "KV dtype unknown": _set((*s, "kv", "kv_dtype"), "float64"),
            "io field outside the io region": _set((*s, "io", "tokens", "offset"), 0),
            "io field too few rows": _set((*s, "io", "tokens", "shape"), [1]),
            "io field zero rows": _set((*s, "io", "tokens", "shape"), [0]),
            "io field wrong dtype": _set((*s, "io", "temperature", "dtype"), "int32"),
            "io field missing": _del((*s, "io", "seed")),
            "output missing": _del((*s, "outputs", f"{decode}.out_tokens")),
            "output past the arena": _set((*s, "outputs", f"{decode}.out_tokens", "offset"),
                                          1 << 40),
            "output wrong shape": _set((*s, "outputs", f"{decode}.out_tokens", "shape"), [5]),
            "entry missing": _del((*s, "entries", decode)),
            "entry rows not its name": _set((*s, "entries", decode, "rows"), 7),
            "entry named oddly": lambda mm: mm["h100"]["schedule"]["entries"].update(
                {"warmup_1": mm["h100"]["schedule"]["entries"][decode]}),
            "entry without launches": _set((*s, "entries", decode, "launches"), []),
            "launch of a module without a cubin": _set((*launch, "module"), "nope.cu"),
            "launch of a kernel the cubin lacks": _set((*launch, "kernel"), "no_such_kernel"),
            "kernel name not an identifier": _set((*launch, "kernel"), "a b"),
            "grid zero": _set((*launch, "grid"), [0, 1, 1]),
            "grid past CUDA's limit": _set((*launch, "grid"), [1, 1 << 20, 1]),
            "grid of two dims": _set((*launch, "grid"), [1, 1]),
            "block too many threads": _set((*launch, "block"), [1024, 2, 1]),
            "block past the kernel's bound": _set((*launch, "block"), [1024, 1, 1]),
            "smem negative": _set((*launch, "smem"), -1),
            "smem past the device": _set((*launch, "smem"), 1 << 20),
            "argument dropped": lambda mm: get(mm, launch)["args"].pop(),
            "argument added": lambda mm: get(mm, launch)["args"].append(
                {"name": "extra", "kind": "i32", "value": 0}),
            "argument kind unknown": _set((*launch, "args", 0, "kind"), "f64"),
            "argument without a name": _del((*launch, "args", 0, "name")),
            "argument name not an identifier": _set((*launch, "args", 0, "name"), "a b"),
            "argument name a number": _set((*launch, "args", 0, "name"), 3),
            "argument named twice": _set((*launch, "args", 1, "name"), names[0]),
            "argument with an unknown key": lambda mm: get(mm, launch)["args"][0].update(
                unit="bytes"),
            "pointer negative": _set((*launch, "args", 0),
                                     {"name": names[0], "kind": "ptr", "value": -8}),
            "pointer past the arena": _set((*launch, "args", 0),
                                           {"name": names[0], "kind": "ptr",
                                            "value": sched["arena_bytes"]}),
            "null pointer not zero": _set((*launch, "args", 0),
                                          {"name": names[0], "kind": "null", "value": 8}),
            "i32 past int32": lambda mm: get(mm, launch)["args"].__setitem__(
                -1, {"name": names[-1], "kind": "i32", "value": 1 << 31}),
            "f32 past float32": lambda mm: get(mm, launch)["args"].__setitem__(
                2, {"name": names[2], "kind": "f32", "value": 1e39}),
            "cubin past the section": _set((*s, "cubins", module, "offset"), 1 << 40),
            "cubin sha256 not hex": _set((*s, "cubins", module, "sha256"), "xyz"),
            "cubin sha256 wrong": _set((*s, "cubins", module, "sha256"), "0" * 64),
            "cubin missing": _del((*s, "cubins", module)),
            "cubin module named oddly": lambda mm: mm["h100"]["schedule"]["cubins"].update(
                {"../x": mm["h100"]["schedule"]["cubins"][module]}),
            "nvcc a number": _set(("h100", "nvcc"), 13),
            "arch unknown": _set(("h100", "arch"), "sm90"),
        }
    cases = [_manifest_case(p, k, e) for k, e in edits.items()]
    any_leaf = checked_leaves(m, runtime)
    for _ in range(n_random):
        path = rng.choice(any_leaf)
        op = rng.randrange(3) if isinstance(path[-1], str) else rng.randrange(2)
        value = ({"x": 1}, 1 << 200)[op] if op < 2 else None
        label = f"{'.'.join(map(str, path))} := {value!r}" if op < 2 else f"del {path}"
        cases.append(_manifest_case(p, f"random {label}",
                                    _set(path, value) if op < 2 else _del(path)))
    leaf = rng.choice(any_leaf)
    cases += [
        _raw_manifest_case(p, "deep nesting", leaf, b"[" * DEEP + b"]" * DEEP),
        _raw_manifest_case(p, "bad UTF-8", leaf, b'"\xff\xfe"'),
        _raw_manifest_case(p, "NaN", leaf, b"NaN"),
        _raw_manifest_case(p, "Infinity", leaf, b"-Infinity"),
        _raw_manifest_case(p, "a 5000-digit int", leaf, b"9" * 5000),
    ]
    cases += [Case(f"manifest whole {k}", lambda v=v: assemble(p, manifest_bytes=v))
              for k, v in {"a list": b"[]", "a string": b'"x"', "empty": b"", "not JSON": b"{",
                           "nested": b"[" * DEEP + b"]" * DEEP, "an empty object": b"{}"}.items()]
    return cases


def section_cases(p: Parts) -> list[Case]:
    tok = json.loads(p.sections["tokenizer"])
    big_id = copy.deepcopy(tok)
    big_id["added_tokens"].append({**big_id["added_tokens"][0], "id": 5000,
                                   "content": "<zz>"})
    vocab = p.manifest["model"]["config"]["vocab_size"]
    cases = [
        _section_case(p, "empty", "tokenizer", b""),
        _section_case(p, "an empty object", "tokenizer", b"{}"),
        _section_case(p, "bad UTF-8", "tokenizer", b"\xff\xfe{}"),
        _section_case(p, "cut in half", "tokenizer",
                      p.sections["tokenizer"][:len(p.sections["tokenizer"]) // 2]),
        _section_case(p, "a token past the vocabulary", "tokenizer",
                      json.dumps(big_id).encode()),
        _section_case(p, "empty", "generation_config", b""),
        _section_case(p, "a list", "generation_config", b"[]"),
        _section_case(p, "bad UTF-8", "generation_config", b'{"a": "\xff"}'),
        _section_case(p, "nested", "generation_config", b"[" * DEEP + b"]" * DEEP),
        _section_case(p, "eos past the vocabulary", "generation_config",
                      json.dumps({"eos_token_id": vocab + 5}).encode()),
        _section_case(p, "eos an empty list", "generation_config", b'{"eos_token_id": []}'),
        _section_case(p, "bos a string", "generation_config", b'{"bos_token_id": "2"}'),
        _section_case(p, "pad negative", "generation_config", b'{"pad_token_id": -1}'),
        _section_case(p, "unclosed tag", "chat_template", b"{% for m in messages %}x"),
        _section_case(p, "bad syntax", "chat_template", b"{{ messages[ }}"),
        _section_case(p, "bad UTF-8", "chat_template", b"{{ bos_token }}\xff"),
        _section_case(p, "nested", "chat_template", b"{{ " + b"(" * DEEP + b")" * DEEP + b" }}"),
    ]
    if "programs" in p.sections:
        progs = p.sections["programs"]
        decode = f"decode_{p.manifest['xla']['max_seqs']}"
        loc = p.manifest["xla"]["programs"][decode]
        start, end = loc["offset"], loc["offset"] + loc["size"]
        cases += [
            _section_case(p, "a program zeroed", "programs",
                          progs[:start] + bytes(end - start) + progs[end:]),
            _section_case(p, "a program's bytes reversed", "programs",
                          progs[:start] + progs[start:end][::-1] + progs[end:]),
            _section_case(p, "a program cut short", "programs", progs[:start + 100],
                          _set(("xla", "programs", decode, "size"), 100)),
        ]
    if "cubins" in p.sections:
        sched = p.manifest["h100"]["schedule"]
        module = sched["entries"][f"decode_{sched['max_seqs']}"]["launches"][0]["module"]
        loc = sched["cubins"][module]
        blob = p.sections["cubins"]
        cubin = blob[loc["offset"]:loc["offset"] + loc["size"]]

        def with_cubin(label: str, new: bytes) -> Case:
            data = blob[:loc["offset"]] + new + blob[loc["offset"] + loc["size"]:]
            return _section_case(p, f"{module} {label}", "cubins", data, lambda m: m["h100"][
                "schedule"]["cubins"][module].update(sha256=hashlib.sha256(new).hexdigest()))

        # Every parameter-size record (EIATTR_KPARAM_INFO: 04 17 0c 00, then 12 bytes; the
        # size in the top 14 bits of the last word) doubled: no launch of the module fits.
        wider = bytearray(cubin)
        for at in [m.start() for m in re.finditer(re.escape(b"\x04\x17\x0c\x00"), cubin)]:
            word = struct.unpack_from("<I", wider, at + 12)[0]
            size = (word >> 18) & 0x3FFF
            struct.pack_into("<I", wider, at + 12, (word & 0x3FFFF) | ((size * 2) << 18))
        cases += [
            with_cubin("not ELF", b"\0" * 4 + cubin[4:]),
            with_cubin("section table past the end", cubin[:0x28] + struct.pack("<Q", 1 << 40)
                       + cubin[0x30:]),
            with_cubin("cut to 64 bytes", cubin[:64] + bytes(len(cubin) - 64)),
            with_cubin("parameter sizes doubled", bytes(wider)),
            _section_case(p, "a byte flipped, sha256 kept", "cubins",
                          blob[:loc["offset"] + 100] + bytes([blob[loc["offset"] + 100] ^ 1])
                          + blob[loc["offset"] + 101:]),
        ]
    return cases


# ---------------------------------------------------------------------------------------------
# Running every reader


@dataclass
class Tally:
    inputs: int = 0
    outcomes: Counter = field(default_factory=Counter)  # (reader, "refused"/"accepted"/...)
    exceptions: Counter = field(default_factory=Counter)  # (reader, type) of each traceback
    problems: list[str] = field(default_factory=list)

    def report(self, name: str) -> str:
        rows = [f"{name}: {self.inputs} inputs"]
        for r in READERS:
            rows.append(f"  {r:8} refused {self.outcomes[(r, 'refused')]:4}  accepted "
                        f"{self.outcomes[(r, 'accepted')]:4}  tracebacks "
                        f"{self.outcomes[(r, 'traceback')]:4}  other "
                        f"{self.outcomes[(r, 'bad')]:4}")
        return "\n".join(rows)


@dataclass(frozen=True)
class Outcome:
    kind: str  # "refused" (one clean line), "accepted", "traceback", "bad" (any other output)
    message: str  # the error line, the exception, or what was printed


def read_all(path: Path) -> dict[str, Outcome]:
    """What each reader makes of the file at `path`."""
    out: dict[str, Outcome] = {}
    try:
        with Artifact.open(path) as art:
            verify_artifact(art)
        out["api"] = Outcome("accepted", "")
    except ArtifactError as e:
        out["api"] = Outcome("refused" if "\n" not in str(e) else "bad", str(e))
    except BaseException as e:  # noqa: BLE001  the point: nothing else may escape
        out["api"] = Outcome("traceback", f"{type(e).__name__}: {e}")
    # The commands' functions, called as typer would (parsing aside), output captured.
    for cmd, call in (("inspect", lambda: cli.inspect(path, as_json=False, trusted_key=[])),
                      ("verify", lambda: cli.verify(path, trusted_key=[]))):
        out[cmd] = _run(call, "rvcompile")
    out["rvrun"] = _run(lambda: rvrun([str(path), "--prompt", "In the beginning",
                                       "--max-tokens", "1"]), "rvrun")
    return out


def _run(call: Callable, prog: str) -> Outcome:
    """A CLI entry point's outcome: its exit code (returned, None for 0, or raised as
    typer.Exit) and the one stderr line `prog: error: ...` a refusal must print."""
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = call() or 0
    except typer.Exit as e:
        code = e.exit_code
    except BaseException as e:  # noqa: BLE001
        return Outcome("traceback", f"{type(e).__name__}: {e}")
    err = stderr.getvalue()
    lines = err.strip().splitlines()
    if code == 0:
        return Outcome("accepted", err)
    if code == 2 and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "):
        return Outcome("refused", lines[0])
    return Outcome("bad", f"exit {code}: {err}")


def run_readers(path: Path, case: Case, tally: Tally) -> None:
    tally.inputs += 1
    for reader, o in read_all(path).items():
        tally.outcomes[(reader, o.kind)] += 1
        if o.kind == "traceback":
            tally.exceptions[(reader, o.message.split(":")[0])] += 1
        if o.kind in ("traceback", "bad") or (
                o.kind == "accepted" and not (reader == "inspect" and case.inspect_may_accept)):
            tally.problems.append(f"{case.label}: {reader} {o.kind}: {o.message[-600:]}")
        if MACHINE_CHECK in o.message:  # every input is damaged: validation must say so first
            tally.problems.append(f"{case.label}: {reader} passed validation: {o.message}")


def fuzz(pristine_path: Path, tmp: Path, seed: int, n_damage: int, n_random: int) -> Tally:
    rng = random.Random(seed)
    pristine = pristine_path.read_bytes()
    parts = Parts.read(pristine_path)
    assert assemble(parts) == pristine  # the reassembly is byte-exact
    cases = [*damage_cases(pristine, parts, rng, n_damage), *header_cases(parts),
             *manifest_cases(parts, rng, n_random), *section_cases(parts)]
    tally = Tally()
    path = tmp / "fuzzed.rvp"
    for case in cases:
        path.write_bytes(case.make())
        run_readers(path, case, tally)
    return tally


# ---------------------------------------------------------------------------------------------
# Artifacts


@pytest.fixture(scope="module")
def xla_artifact(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzz") / "tiny-xla.rvp"
    build_artifact("gemma-4-tiny", out, BuildOptions("tpu-bf16", **XLA_OPTS, platforms=("cpu",)),
                   random_weights=True, progress=False, log=lambda s: None)
    return out


@pytest.fixture(scope="module")
def h100_artifact(tmp_path_factory) -> Path:
    if shutil.which("nvcc") is None:
        pytest.skip("building an h100-fp8 artifact needs nvcc (no GPU)")
    out = tmp_path_factory.mktemp("fuzz") / "tiny-h100.rvp"
    build_artifact("gemma-4-tiny", out, BuildOptions("h100-fp8", **H100_OPTS),
                   random_weights=True, progress=False, log=lambda s: None)
    return out


def _check(tally: Tally, name: str) -> None:
    print("\n" + tally.report(name))
    assert not tally.problems, "\n".join(tally.problems[:20])
    for reader in ("api", "verify", "rvrun"):
        assert tally.outcomes[(reader, "refused")] == tally.inputs


def test_fuzz_xla_artifact(xla_artifact, tmp_path):
    _check(fuzz(xla_artifact, tmp_path, SEED, n_damage=15, n_random=20), "xla (tpu-bf16, cpu)")


def test_fuzz_h100_artifact(h100_artifact, tmp_path):
    _check(fuzz(h100_artifact, tmp_path, SEED + 1, n_damage=12, n_random=16), "h100-fp8")


# ---------------------------------------------------------------------------------------------
# One regression test per finding of the review (crafted files with valid hashes)


def refused_by_all(path: Path, *needles: str, readers: tuple[str, ...] = READERS) -> None:
    outcomes = read_all(path)
    for reader in readers:
        o = outcomes[reader]
        assert o.kind == "refused", (reader, o)
        for n in needles:
            assert n in o.message, (reader, n, o.message)


def crafted(src: Path, dst: Path, edit: Callable[[Parts], None]) -> Path:
    p = Parts.read(src).copy()
    edit(p)
    dst.write_bytes(assemble(p))
    return dst


def test_inspect_shows_an_h100_schedule(h100_artifact):
    """Was: KeyError 'xla' (inspect read the XLA part of every manifest)."""
    out = read_all(h100_artifact)
    assert out["inspect"].kind == "accepted" and out["api"].kind == "accepted"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        cli.inspect(h100_artifact, as_json=False, trusted_key=[])
    text = stdout.getvalue()
    assert f"schedule          version {SCHEDULE_VERSION}: arena" in text
    assert "launches of" in text
    assert "decode_1" in text and "(CUDA graph)" in text and "nvcc" in text
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        cli.inspect(h100_artifact, as_json=True, trusted_key=[])
    info = json.loads(stdout.getvalue())
    sched = info["schedule"]
    assert sched["launches"] == sum(e["launches"] for e in sched["entries"].values()) > 0
    assert info["entry_points"] == sorted(sched["entries"]) and sched["modules"] > 0


def test_h100_load_refuses_this_machine_after_validation(h100_artifact, tmp_path):
    """No GPU here: a sound h100 artifact stops at the machine check in one line, and a damaged
    one at its damage, before the machine is asked."""
    refused_by_all(h100_artifact, MACHINE_CHECK, readers=("rvrun",))
    bad = crafted(h100_artifact, tmp_path / "bad.rvp", lambda p: put(
        p.manifest, ("h100", "schedule", "entries", "decode_1", "launches", 0, "kernel"),
        "no_such_kernel"))
    refused_by_all(bad, "launches[0]: kernel 'no_such_kernel' is not in",
                   readers=("api", "verify", "rvrun"))


def test_fifo_and_directory_refused(tmp_path):
    """Was: a FIFO given as the artifact hung every reader (open blocked for a writer)."""
    fifo = tmp_path / "pipe.rvp"
    os.mkfifo(fifo)

    def hung(*_) -> None:
        raise TimeoutError("a reader blocked on the FIFO")

    # A hang fails this test instead of stalling the suite (the handler interrupts open()).
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        refused_by_all(fifo, "pipe.rvp: not a regular file (a FIFO)")
        refused_by_all(tmp_path, "not a regular file (a directory)")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_deep_nesting_refused(xla_artifact, tmp_path):
    """Was: RecursionError from json.loads of a manifest (or generation_config) nested deeper
    than Python's stack."""
    p = Parts.read(xla_artifact)
    bad = tmp_path / "deep.rvp"
    bad.write_bytes(assemble(p, manifest_bytes=b"[" * DEEP + b"]" * DEEP))
    refused_by_all(bad, "deep.rvp: manifest: JSON nested too deeply")
    crafted(xla_artifact, bad, lambda p: p.sections.update(
        generation_config=b"[" * DEEP + b"]" * DEEP))
    refused_by_all(bad, "generation_config: JSON nested too deeply",
                   readers=("api", "verify", "rvrun"))


def test_missing_key_refused(xla_artifact, tmp_path):
    """Was: KeyError from a manifest field read where it was used."""
    bad = crafted(xla_artifact, tmp_path / "k.rvp",
                  lambda p: drop(p.manifest, ("xla", "kv", "block_size")))
    refused_by_all(bad, "k.rvp: manifest.xla.kv: missing required key 'block_size'")


def test_zero_block_size_refused(xla_artifact, h100_artifact, tmp_path):
    """Was: ZeroDivisionError in the engine's block arithmetic."""
    bad = crafted(xla_artifact, tmp_path / "z.rvp",
                  lambda p: put(p.manifest, ("xla", "kv", "block_size"), 0))
    refused_by_all(bad, "manifest.xla.kv.block_size: expected an int in [1, 65536], got 0")
    bad = crafted(h100_artifact, tmp_path / "z.rvp",
                  lambda p: put(p.manifest, ("h100", "schedule", "kv", "block_size"), 0))
    refused_by_all(bad, "manifest.h100.schedule.kv.block_size: expected an int in [1, 65536]")


def test_garbage_program_refused(xla_artifact, tmp_path):
    """Was: struct.error (and others) from jax.export's deserializer on program bytes."""
    def zero_decode(p: Parts) -> None:
        loc = p.manifest["xla"]["programs"]["decode_1"]
        a, b = loc["offset"], loc["offset"] + loc["size"]
        p.sections["programs"] = p.sections["programs"][:a] + bytes(b - a) + \
            p.sections["programs"][b:]

    bad = crafted(xla_artifact, tmp_path / "g.rvp", zero_decode)
    refused_by_all(bad, "g.rvp: program decode_1 is not a jax.export program",
                   readers=("api", "verify", "rvrun"))


def test_schedule_version_names_the_range(h100_artifact, tmp_path):
    bad = crafted(h100_artifact, tmp_path / "v.rvp",
                  lambda p: put(p.manifest, ("h100", "schedule", "version"), 99))
    refused_by_all(bad, "manifest.h100.schedule.version: kernel schedule version 99; this "
                        f"runtime reads versions {MIN_SCHEDULE_VERSION}..{MAX_SCHEDULE_VERSION}")


def test_newline_in_a_key_stays_on_one_line(h100_artifact, tmp_path):
    def odd_module(p: Parts) -> None:
        cubins = p.manifest["h100"]["schedule"]["cubins"]
        cubins["x\nboom.cu"] = cubins.pop(next(iter(cubins)))

    bad = crafted(h100_artifact, tmp_path / "n.rvp", odd_module)
    refused_by_all(bad, "manifest.h100.schedule.cubins['x\\nboom.cu']")


@pytest.mark.parametrize("value, needle", [
    (5, "manifest.h100.piece_hash"),
    ({"module": "nope.cu", "kernel": "sha256_pieces"}, "manifest.h100.piece_hash.module"),
    ({"module": "sha256.cu"}, "manifest.h100.piece_hash: missing required key 'kernel'"),
    ({"module": "sha256.cu", "kernel": "x; rm -rf /"}, "manifest.h100.piece_hash.kernel"),
    ({"module": "sha256.cu", "kernel": -1}, "manifest.h100.piece_hash.kernel"),
])
def test_a_bad_piece_hash_field_is_refused(h100_artifact, tmp_path, value, needle):
    """The manifest's h100.piece_hash (format v7): a wrong type, a module outside the cubins, a
    missing or malformed kernel name, each refused in one line by every reader."""
    assert "sha256.cu" in json.dumps(Parts.read(h100_artifact).manifest["h100"]["piece_hash"])
    bad = crafted(h100_artifact, tmp_path / "ph.rvp",
                  lambda p: put(p.manifest, ("h100", "piece_hash"), value))
    refused_by_all(bad, needle)
