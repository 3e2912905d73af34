"""The manifest of a model artifact: what `rvcompile build` writes and rvrun, `inspect` and
`verify` read, checked field by field against the header and the section table, and returned as
frozen dataclasses. `read_manifest(art)` is the one place a model artifact's JSON is trusted;
everything after it reads the returned `Manifest`. A field that breaks the schema is refused in
one line naming its JSON path and what is wrong, e.g.

    tiny.rvp: manifest.xla.kv.block_size: expected an int in [1, 65536], got -3

Fields (format v3; required unless marked optional):
    model             {"name": str, "origin": str, "config": the model's config.json as
                      config.Gemma4Config.to_hf_dict writes it}; of the config, the runtime relies
                      on vocab_size, the token ids and the layer shapes checked in `_model`
    target            str, the header's target
    compiler_version  str
    passes            list of str
    random_weights    null, or {"seed": int, optional "ranges": str}
    xla               (runtime "xla") the XLA lowering, see `_xla`: jax_version, jaxlib_version,
                      platforms (the programs'; the header names some or all), max_seqs,
                      max_context, max_chunk, prefill_buckets (ascending, the largest is
                      max_chunk), optional decode_loop {steps, stop_ids}, entry_points,
                      programs {entry: {offset, size}} (in section "programs"), weights [{key,
                      shape, dtype, offset, nbytes}] (in section "weights"), kv {block_size,
                      kinds {name: {table_width, ring, window, default_blocks}}, pools [{key,
                      kind, layers, block_shape ([block_size, ...]; an int8 pool's scale pool
                      "<key>.scale" also [1, S], one row a block), dtype}], optional fixed_blocks
                      true (2026-11-29: the programs take exactly default_blocks blocks of each
                      kind, which the runtime then cannot change; absent: symbolic, sized at
                      load)},
                      layer_groups [{start, period, count}], optional mesh {axis, size,
                      weights, pools} (tensor parallelism),
                      optional precompiled {topology: record} (section "executables"),
                      optional speculative {draft_tokens K, verify "verify_{max_seqs}x{K+1}", draft
                      "draft_{max_seqs}" or null, hidden_size (the model's), reads [the target
                      layer each assistant layer reads]} (speculative decoding, see
                      targets/xla/program.py's verify and draft; since v6, with a draft entry
                      point, draft returns draft_probs and verify takes draft_probs and
                      draft_lane: the ratio rule, targets/xla/rejection.py),
                      sampler {top_logprobs K, penalty_ids P (max_context), mask_words W
                      (ceil(vocab / 32))} (v5): prefill_T and decode_B take penalties, a token
                      mask and the top log-probabilities wanted, and return log-probabilities
                      (targets/xla/sampler.py)
    assistant         optional (with xla.speculative.draft, or an h100 schedule of version 9:
                      its draft entries) the assistant drafter: {"name": str,
                      "origin": str, "config": its config.json as
                      model.assistant.AssistantConfig.to_hf_dict writes it}; of the config,
                      `_assistant` checks what `inspect` shows and that it drafts for this model
    h100              (runtime "h100") {"schedule": kernel_schedule.KernelSchedule (its own
                      version and schema), "nvcc": str, "arch": str, optional (v7)
                      "tensor_parallel": {"ranks": N (2..8), "schedules": [the schedules of
                      ranks 1..N-1; "schedule" is rank 0's], "weights": [N byte offsets: each
                      rank's weights region in section weights, one after another],
                      "constants": [N, the same in section constants]}: one schedule per GPU
                      (rvcompile build --tp N), each with collective steps (schedule version
                      5); absent: one GPU, optional (v7, 2026-11-29) "piece_hash": {"module":
                      a module of the schedule's cubins, "kernel": str}: the kernel that hashes
                      a section's pieces on the GPU (artifacts/piece_hash.py; contents.py checks
                      its parameters against the cubin); absent: built before it, the runtime
                      hashes the weights on the CPU}
    provenance        optional (v4, 2026-11-24) how the artifact was built (rvcompile/
                      provenance.py): {"recipe": the build recipe (rvcompile/recipe.py: model,
                      assistant, chat_template, target (the header's), options; its fields are
                      checked by the compiler, which alone reads them), "toolchain":
                      {"rvcompile" (the header's compiler_version), "numpy", "ml_dtypes", "jax",
                      "jaxlib", "libtpu", "nvcc": str, or null for a tool the build did not
                      use}, "inputs": {"model", "assistant" and/or "chat_template": {file name:
                      sha256 hex}}}; absent: built without a recipe (build_artifact called
                      directly)
Header requirements, by runtime:
    xla               runtime "xla", jax ">=X.Y[.Z]", optional min_devices (the mesh size)
    h100              runtime "h100", compute_capability "M.N", min_driver int, arena_bytes (the
                      schedule's fixed part, the KV pools not included: they are sized at
                      load; the largest rank's with tensor_parallel), optional
                      kernel_launch str (h100_executor refuses others)

Sections a model artifact holds: weights, tokenizer, generation_config, chat_template, and
programs (xla), optional executables (xla), cubins and constants (h100). Their contents are
checked once hashed, by contents.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from rvcompile.artifacts.container import Artifact
from rvcompile.artifacts.format import ArtifactError, ArtifactHeader
from rvcompile.artifacts.kernel_schedule import (
    MAX_BYTES,
    TP_SCHEDULE_VERSION,
    Collective,
    KernelSchedule,
    min_table_width,
)
from rvcompile.artifacts.schema import INT32_MAX, At, SchemaError

RUNTIMES = ("xla", "h100")
XLA_PLATFORMS = ("tpu", "cuda", "cpu")
XLA_DTYPES = ("float32", "bfloat16", "float16", "int8", "int32", "float8_e4m3fn")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "int32": 4,
               "float8_e4m3fn": 1}
TEXT_SECTIONS = ("tokenizer", "generation_config", "chat_template")
LAYER_TYPES = ("sliding_attention", "full_attention")
MAX_DIM = 1 << 24  # any model dimension beyond this is damage
VERSION = r"[0-9]+(\.[0-9]+){1,2}([.a-z0-9+-]*)"
NAME = r"[A-Za-z0-9_.:/+-]{1,200}"


@dataclass(frozen=True)
class ModelInfo:
    name: str
    origin: str
    vocab_size: int
    num_layers: int
    eos_ids: tuple[int, ...]  # config.json's eos_token_id (generation_config may override)
    bos_id: int
    pad_id: int
    config: dict[str, Any]  # config.json as stored, its checked fields above included


@dataclass(frozen=True)
class Span:
    """Bytes [offset, offset + size) of a section."""

    offset: int
    size: int


@dataclass(frozen=True)
class XlaWeight:
    key: str
    shape: tuple[int, ...]
    dtype: str  # one of XLA_DTYPES
    offset: int  # in section "weights"
    nbytes: int


@dataclass(frozen=True)
class XlaKvKind:
    name: str  # "full" or "sliding"
    table_width: int
    ring: bool
    window: int | None  # tokens; None for full attention
    default_blocks: int  # a whole sequence per decode slot


@dataclass(frozen=True)
class XlaPool:
    key: str
    kind: str
    layers: int
    block_shape: tuple[int, ...]  # [block_size, ...], or a scale pool's row [1, S]
    dtype: str


@dataclass(frozen=True)
class XlaMesh:
    axis: str
    size: int  # devices
    specs: dict[str, tuple[str | None, ...]]  # weight or pool key -> its PartitionSpec


@dataclass(frozen=True)
class XlaSampler:
    """What prefill_{T} and decode_{B} take and return beyond a token (targets/xla/sampler.py)."""

    top_logprobs: int  # K: top log-probabilities per row they return
    penalty_ids: int  # P: token ids per lane the penalty inputs list (max_context)
    mask_words: int  # int32 words of a row's token mask: ceil(vocab / 32)


@dataclass(frozen=True)
class XlaSpeculative:
    draft_tokens: int  # K: most drafts one verify call checks
    verify: str  # entry point verify_{max_seqs}x{K+1}
    draft: str | None  # entry point draft_{max_seqs}; None without an assistant
    hidden_size: int  # width of the states verify returns and draft takes
    reads: tuple[int, ...]  # the target layer whose KV cache each assistant layer reads


@dataclass(frozen=True)
class AssistantInfo:
    name: str
    origin: str
    model_type: str  # "gemma4_assistant" or "gemma4_unified_assistant"
    hidden_size: int  # the drafter's own width
    layer_types: tuple[str, ...]
    num_heads: int
    intermediate_size: int
    num_centroids: int  # 0: a dense (tied) head
    top_k: int  # clusters scored, with centroids
    config: dict[str, Any]  # config.json as stored


@dataclass(frozen=True)
class XlaManifest:
    jax_version: str
    platforms: tuple[str, ...]
    max_seqs: int
    max_context: int
    max_chunk: int
    prefill_buckets: tuple[int, ...]
    decode_loop_steps: int  # 0: built without a decode loop
    decode_loop_stops: int
    programs: dict[str, Span]  # entry -> its serialized jax.export program in "programs"
    weights: tuple[XlaWeight, ...]
    block_size: int
    kinds: dict[str, XlaKvKind]
    pools: tuple[XlaPool, ...]
    mesh: XlaMesh | None  # None: one device
    precompiled: dict[str, dict]  # topology -> record (runtime/executors/precompiled.py), checked
    sampler: XlaSampler  # what prefill/decode take and return beyond a token (v5)
    speculative: XlaSpeculative | None = None  # verify (and draft) entry points, if built
    fixed_blocks: bool = False  # the programs' pools hold exactly each kind's default_blocks


@dataclass(frozen=True)
class H100TensorParallel:
    """A --tp build's ranks: rank r runs schedules[r] over its weights region (section weights
    from weights[r], schedules[r].weights_bytes long) and constants likewise."""

    schedules: tuple[KernelSchedule, ...]  # every rank's, rank 0's first (= H100Manifest's)
    weights: tuple[int, ...]
    constants: tuple[int, ...]

    @property
    def ranks(self) -> int:
        return len(self.schedules)


@dataclass(frozen=True)
class PieceHash:
    """The kernel that hashes pieces on the device (artifacts/piece_hash.py)."""

    module: str  # in the schedule's cubins
    kernel: str


@dataclass(frozen=True)
class H100Manifest:
    schedule: KernelSchedule  # rank 0's with tensor_parallel
    nvcc: str
    arch: str
    tensor_parallel: H100TensorParallel | None = None  # None: one GPU
    piece_hash: PieceHash | None = None  # None: built without one (the CPU hashes)


@dataclass(frozen=True)
class Manifest:
    model: ModelInfo
    target: str
    runtime: str  # "xla" or "h100": which of the two below is set
    xla: XlaManifest | None
    h100: H100Manifest | None
    assistant: AssistantInfo | None = None  # the drafter compiled in, if any
    provenance: Provenance | None = None  # how it was built, if recorded


@dataclass(frozen=True)
class Provenance:
    recipe: dict[str, Any]  # as stored; rvcompile/recipe.py checks and reads its fields
    toolchain: dict[str, str | None]  # tool -> version; None: not installed / not used
    inputs: dict[str, dict[str, str]]  # input role (INPUT_ROLES) -> file name -> sha256 hex


def read_manifest(art: Artifact) -> Manifest:
    """`art`'s manifest and header requirements, checked against its section table; one-line
    ArtifactError naming the file and the field otherwise."""
    return parse_manifest(art.header, art.manifest,
                          {name: s.size for name, s in art.sections.items()}, art.path.name)


def parse_manifest(header: ArtifactHeader, manifest: Any, sections: dict[str, int],
                   fname: str) -> Manifest:
    """The same check on parts not yet written (the build checks what it is about to write):
    `sections` maps each section name to its size."""
    try:
        return _manifest(header, At(manifest, "manifest"), sections)
    except SchemaError as e:
        raise ArtifactError(f"{fname}: {e}") from None


def _manifest(header: ArtifactHeader, m: At, sections: dict[str, int]) -> Manifest:
    req = At(header.requirements, "header.requirements")
    runtime = req["runtime"].str(RUNTIMES)
    if m["target"].str() != header.target:
        m["target"].fail(f"{m['target'].value!r} differs from the header's {header.target!r}")
    m["compiler_version"].str(max_len=200, printable=True)
    for p in m["passes"].items(0, 64):
        p.str(pattern=NAME)
    rw = m["random_weights"].nullable()
    if rw is not None:
        rw["seed"].int()
        if rw.get("ranges") is not None:
            rw["ranges"].str()
    for name in ("weights", *TEXT_SECTIONS, *(("programs",) if runtime == "xla"
                                              else ("cubins", "constants"))):
        if name not in sections:
            m.fail(f"the artifact has no {name!r} section, which a {runtime} model needs")
    model = _model(m["model"])
    provenance = (_provenance(m["provenance"], header) if m.get("provenance") is not None
                  else None)
    other = "h100" if runtime == "xla" else "xla"
    if m.get(other) is not None:
        m[other].fail(f"present in an artifact whose header says runtime {runtime!r}")
    if runtime == "xla":
        xla = _xla(m["xla"], req, header, sections, model)
        drafter = m.get("assistant")
        if (drafter is not None) != bool(xla.speculative and xla.speculative.draft):
            (drafter or m).fail("an assistant comes with the xla.speculative draft entry point, "
                                "and only with it")
        assistant = _assistant(drafter, model, xla.speculative) if drafter is not None else None
        return Manifest(model, header.target, runtime, xla, None, assistant, provenance)
    h100 = _h100(m["h100"], req, header, model, sections)
    drafter = m.get("assistant")
    if (drafter is not None) != h100.schedule.has_drafter:
        (drafter or m).fail("an assistant comes with the h100 schedule's draft entries (version "
                            "9), and only with them")
    assistant = _assistant(drafter, model, None) if drafter is not None else None
    return Manifest(model, header.target, runtime, None, h100, assistant, provenance)


TOOLS = ("rvcompile", "numpy", "ml_dtypes", "jax", "jaxlib", "libtpu", "nvcc")
INPUT_ROLES = ("model", "assistant", "chat_template")
FILE_NAME = r"[A-Za-z0-9_.+-]{1,200}"


def _provenance(p: At, header: ArtifactHeader) -> Provenance:
    recipe = p["recipe"]
    for key in ("model", "options"):
        recipe[key].obj()
    if recipe["target"].str() != header.target:
        recipe["target"].fail(f"{recipe['target'].value!r} differs from the header's "
                              f"{header.target!r}")
    for key in ("assistant", "chat_template"):  # chat_template: absent before it existed
        if recipe.obj().get(key) is not None:
            recipe[key].obj()
    tools = p["toolchain"]
    if set(tools.obj()) != set(TOOLS):
        tools.fail(f"names {sorted(tools.obj())}, not {list(TOOLS)}")
    versions = {t: None if tools[t].value is None else tools[t].str(max_len=200, printable=True)
                for t in TOOLS}
    if versions["rvcompile"] != header.compiler_version:
        tools["rvcompile"].fail(f"{versions['rvcompile']!r} differs from the header's "
                                f"compiler_version {header.compiler_version!r}")
    inputs = {}
    for role, files in p["inputs"].members(len(INPUT_ROLES)).items():
        if role not in INPUT_ROLES:
            files.fail(f"an input is one of {', '.join(INPUT_ROLES)}")
        for name in files.members(1 << 12):
            if not re.fullmatch(FILE_NAME, name):
                files.fail(f"{name[:40]!r} is not a file name")
        inputs[role] = {name: d.sha256() for name, d in files.members().items()}
    return Provenance(recipe.value, versions, inputs)


def _token_id(at: At, vocab: int) -> int:
    return at.int(0, vocab - 1)


def token_ids(at: At, vocab: int) -> tuple[int, ...]:
    """An id or a non-empty list of ids, each in [0, vocab)."""
    if isinstance(at.value, list):
        return tuple(_token_id(x, vocab) for x in at.items(1, 64))
    return (_token_id(at, vocab),)


def _model(at: At) -> ModelInfo:
    c = at["config"]
    c.obj()
    dims = {k: c[k].int(1, MAX_DIM) for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "global_head_dim", "max_position_embeddings",
        "sliding_window")}
    vocab = c["vocab_size"].int(1, INT32_MAX)
    layers = dims["num_hidden_layers"]
    kinds = [t.str(LAYER_TYPES) for t in c["layer_types"].items(layers, layers)]
    if kinds[-1] != "full_attention":
        c["layer_types"].fail("the last layer must be full_attention")
    heads = dims["num_attention_heads"]
    kv_heads = [dims["num_key_value_heads"]]
    global_kv = c["num_global_key_value_heads"].nullable()
    if global_kv is not None:
        global_kv.int(1, MAX_DIM)
        if c["attention_k_eq_v"].bool():  # K=V full layers have their own KV head count
            kv_heads.append(global_kv.value)
    if any(heads % k for k in kv_heads):
        c["num_attention_heads"].fail(f"{heads} heads are not a multiple of the KV heads "
                                      f"{kv_heads}")
    for key in ("head_dim", "global_head_dim"):
        if dims[key] % 2:
            c[key].fail(f"{dims[key]} is odd; RoPE needs an even head dim")
    c["num_kv_shared_layers"].int(0, layers - 1)
    c["hidden_size_per_layer_input"].int(0, MAX_DIM)
    c["vocab_size_per_layer_input"].int(0, INT32_MAX)
    c["rms_norm_eps"].number(0.0, 1.0)
    softcap = c["final_logit_softcapping"].nullable()
    if softcap is not None:
        softcap.number(0.0)
    for key in ("attention_k_eq_v", "enable_moe_block", "use_double_wide_mlp"):
        c[key].bool()
    if c["enable_moe_block"].value:
        experts = c["num_experts"].int(1, MAX_DIM)
        c["top_k_experts"].int(1, experts)
        c["moe_intermediate_size"].int(1, MAX_DIM)
    return ModelInfo(
        name=at["name"].str(max_len=200, printable=True), origin=at["origin"].str(),
        vocab_size=vocab,
        num_layers=layers, eos_ids=token_ids(c["eos_token_id"], vocab),
        bos_id=_token_id(c["bos_token_id"], vocab), pad_id=_token_id(c["pad_token_id"], vocab),
        config=c.value)


def _span(at: At, section: str, sections: dict[str, int], min_size: int = 1) -> Span:
    span = Span(at["offset"].int(0, MAX_BYTES), at["size"].int(min_size, MAX_BYTES))
    if span.offset + span.size > sections[section]:
        at.fail(f"bytes [{span.offset}, {span.offset + span.size}) fall outside section "
                f"{section!r} of {sections[section]} bytes")
    return span


def _unique(at: At, keys: list[str], what: str) -> None:
    if len(set(keys)) != len(keys):
        at.fail(f"names a {what} twice")


ENTRY_POINT = re.compile(r"(?:(prefill|decode|decode_loop|logits|draft)_([1-9][0-9]{0,6})|"
                         r"(verify)_([1-9][0-9]{0,6})x([1-9][0-9]{0,6}))")


def entry_rows(name: str) -> tuple[int, int] | None:
    """(lanes, token rows per lane) of an entry point's tokens argument, None for a name that is
    not an entry point's: prefill_T and logits_T (1, T); decode_B, decode_loop_B and draft_B
    (B, 1); verify_BxR (B, R)."""
    m = ENTRY_POINT.fullmatch(name)
    if m is None:
        return None
    kind, size, _, lanes, rows = m.groups()
    if kind is None:
        return int(lanes), int(rows)
    return (int(size), 1) if kind in ("decode", "decode_loop", "draft") else (1, int(size))


def _xla(x: At, req: At, header: ArtifactHeader, sections: dict[str, int],
         model: ModelInfo) -> XlaManifest:
    jax_version = x["jax_version"].str(pattern=VERSION)
    x["jaxlib_version"].str(pattern=VERSION)
    if req["jax"].str() != f">={jax_version}":
        req["jax"].fail(f"{req['jax'].value!r} is not '>={jax_version}' (manifest.xla."
                        "jax_version)")
    platforms = tuple(p.str(XLA_PLATFORMS) for p in x["platforms"].items(1, 3))
    if not header.platforms:
        At([], "header.platforms").expected("at least one platform")
    if not set(header.platforms) <= set(platforms):  # the header may promise fewer
        x["platforms"].fail(f"{list(platforms)} lack platforms the header names "
                            f"{list(header.platforms)}")
    max_seqs = x["max_seqs"].int(1, 1 << 16)
    max_context = x["max_context"].int(1, INT32_MAX)
    max_chunk = x["max_chunk"].int(1, max_context)
    buckets = tuple(b.int(1, max_chunk) for b in x["prefill_buckets"].items(1, 64))
    if list(buckets) != sorted(set(buckets)) or buckets[-1] != max_chunk:
        x["prefill_buckets"].fail(f"{list(buckets)} must ascend and end at max_chunk "
                                  f"{max_chunk}")
    loop = x.get("decode_loop")
    steps = loop["steps"].int(0, max_chunk) if loop is not None else 0
    stops = loop["stop_ids"].int(0, 1024) if loop is not None else 0
    programs = {}
    for name, loc in x["programs"].members(256).items():
        if entry_rows(name) is None:
            loc.fail("an entry point is named prefill_N, decode_N, decode_loop_N, logits_N, "
                     "verify_NxR or draft_N")
        programs[name] = _span(loc, "programs", sections)
    names = [e.str() for e in x["entry_points"].items(1, 256)]
    if names != sorted(programs):
        x["entry_points"].fail(f"{names} are not the programs' names {sorted(programs)}")
    needed = [*(f"prefill_{b}" for b in buckets), f"decode_{max_seqs}", f"logits_{max_chunk}",
              *([f"decode_loop_{max_seqs}"] if steps else [])]
    for name in needed:
        if name not in programs:
            x["programs"].fail(f"missing entry point {name!r}")
    weights = tuple(_weight(w, sections) for w in x["weights"].items(1, 1 << 16))
    _unique(x["weights"], [w.key for w in weights], "weight array")
    kv = x["kv"]
    block = kv["block_size"].int(1, 1 << 16)
    kinds = {name: _xla_kind(k, name, block, max_context, max_chunk, max_seqs)
             for name, k in kv["kinds"].members(2).items()}
    if not kinds:
        kv["kinds"].fail("no KV kind")
    pools = tuple(_pool(p, kinds, block) for p in kv["pools"].items(1, 1 << 16))
    _unique(kv["pools"], [p.key for p in pools], "KV pool")
    fixed = kv.get("fixed_blocks")
    fixed_blocks = fixed is not None and fixed.bool()
    for g in x["layer_groups"].items(1, 1 << 12):
        g["start"].int(0, MAX_DIM)
        g["period"].int(1, MAX_DIM)
        g["count"].int(1, MAX_DIM)
    mesh = _mesh(x["mesh"], weights, pools) if x.get("mesh") is not None else None
    devices = req.get("min_devices")
    if (devices.int(2, 1 << 16) if devices is not None else 1) != (mesh.size if mesh else 1):
        req.fail(f"min_devices {devices.value if devices else 'absent'} does not match the "
                 f"mesh of {mesh.size if mesh else 1} devices")
    precompiled = x.get("precompiled")
    records = {}
    if precompiled is not None and precompiled.members():
        if "executables" not in sections:
            precompiled.fail("the artifact has no 'executables' section")
        records = {name: _precompiled(rec, name, programs, kinds, mesh, sections)
                   for name, rec in precompiled.members(64).items()}
    spec = (_speculative(x["speculative"], max_seqs, max_chunk, model)
            if x.get("speculative") is not None else None)
    ours = {spec.verify, spec.draft} if spec else set()
    for name in programs:
        if name.startswith(("verify_", "draft_")) and name not in ours:
            x["programs"].fail(f"entry point {name!r} is not xla.speculative's")
    for name in ours - {None}:
        if name not in programs:
            x["programs"].fail(f"missing entry point {name!r} (xla.speculative)")
    return XlaManifest(jax_version, platforms, max_seqs, max_context, max_chunk, buckets, steps,
                       stops, programs, weights, block, kinds, pools, mesh, records,
                       _sampler(x["sampler"], max_context, model), spec, fixed_blocks)


def _sampler(at: At, max_context: int, model: ModelInfo) -> XlaSampler:
    top = at["top_logprobs"].int(1, 1024)
    if top > model.vocab_size:
        at["top_logprobs"].fail(f"{top}, more than the vocabulary's {model.vocab_size} tokens")
    pen = at["penalty_ids"].int(1, INT32_MAX)
    if pen != max_context:
        at["penalty_ids"].fail(f"{pen}, not max_context {max_context}")
    words = at["mask_words"].int(1, INT32_MAX)
    if words != -(-model.vocab_size // 32):
        at["mask_words"].fail(f"{words}, not ceil(vocab_size / 32) = "
                              f"{-(-model.vocab_size // 32)}")
    return XlaSampler(top, pen, words)


def _speculative(at: At, max_seqs: int, max_chunk: int, model: ModelInfo) -> XlaSpeculative:
    k = at["draft_tokens"].int(1, max_chunk - 1)  # a token and K drafts fit one chunk
    verify = at["verify"].str()
    if verify != f"verify_{max_seqs}x{k + 1}":
        at["verify"].expected(f"'verify_{max_seqs}x{k + 1}'")
    draft = at["draft"].nullable()
    if draft is not None and draft.str() != f"draft_{max_seqs}":
        draft.expected(f"null or 'draft_{max_seqs}'")
    hidden = at["hidden_size"].int(1, MAX_DIM)
    if hidden != model.config["hidden_size"]:
        at["hidden_size"].fail(f"{hidden}, not the model's hidden_size "
                               f"{model.config['hidden_size']}")
    reads = tuple(r.int(0, model.num_layers - 1) for r in at["reads"].items(0, 1 << 10))
    if (draft is None) != (not reads):
        at["reads"].fail("lists the target layers an assistant reads, and only with one")
    return XlaSpeculative(k, verify, draft and draft.value, hidden, reads)


def _assistant(at: At, model: ModelInfo, spec: XlaSpeculative | None) -> AssistantInfo:
    """The assistant record; `spec`: an XLA artifact's speculative entry points (None: an h100
    artifact's, whose schedule records no layer reads)."""
    c = at["config"]
    c.obj()
    model_type = c["model_type"].str(("gemma4_assistant", "gemma4_unified_assistant"))
    if c["backbone_hidden_size"].int(1, MAX_DIM) != model.config["hidden_size"]:
        c["backbone_hidden_size"].fail(f"{c['backbone_hidden_size'].value}, not the model's "
                                       f"hidden_size {model.config['hidden_size']}")
    t = c["text_config"]
    if t["vocab_size"].int(1, INT32_MAX) != model.vocab_size:
        t["vocab_size"].fail(f"{t['vocab_size'].value}, not the model's {model.vocab_size}")
    layers = t["num_hidden_layers"].int(1, MAX_DIM)
    kinds = tuple(k.str(LAYER_TYPES) for k in t["layer_types"].items(layers, layers))
    if spec is not None and len(spec.reads) != layers:
        At(list(spec.reads), "manifest.xla.speculative.reads").fail(
            f"names {len(spec.reads)} layers; the assistant has {layers}")
    centroids = top_k = 0
    if c["use_ordered_embeddings"].bool():
        centroids = c["num_centroids"].int(1, MAX_DIM)
        top_k = c["centroid_intermediate_top_k"].int(1, centroids)
    return AssistantInfo(
        name=at["name"].str(max_len=200, printable=True), origin=at["origin"].str(),
        model_type=model_type, hidden_size=t["hidden_size"].int(1, MAX_DIM), layer_types=kinds,
        num_heads=t["num_attention_heads"].int(1, MAX_DIM),
        intermediate_size=t["intermediate_size"].int(1, MAX_DIM), num_centroids=centroids,
        top_k=top_k, config=c.value)


def _weight(w: At, sections: dict[str, int]) -> XlaWeight:
    shape = tuple(d.int(1, MAX_DIM) for d in w["shape"].items(0, 8))
    dtype = w["dtype"].str(XLA_DTYPES)
    nbytes = w["nbytes"].int(0, MAX_BYTES)
    if nbytes != math.prod(shape) * DTYPE_BYTES[dtype]:
        w["nbytes"].fail(f"{nbytes} bytes, but shape {list(shape)} of {dtype} is "
                         f"{math.prod(shape) * DTYPE_BYTES[dtype]}")
    offset = w["offset"].int(0, MAX_BYTES)
    if offset + nbytes > sections["weights"]:
        w.fail(f"bytes [{offset}, {offset + nbytes}) fall outside section 'weights' of "
               f"{sections['weights']} bytes")
    return XlaWeight(w["key"].str(pattern=NAME), shape, dtype, offset, nbytes)


def _xla_kind(k: At, name: str, block: int, max_context: int, max_chunk: int,
              max_seqs: int) -> XlaKvKind:
    if name not in ("full", "sliding"):
        k.fail("a KV kind is 'full' or 'sliding'")
    ring = k["ring"].bool()
    if ring != (name == "sliding"):
        k["ring"].fail(f"the {name} kind {'must not' if ring else 'must'} be a ring")
    window = k["window"].int(1, INT32_MAX) if ring else None
    if not ring and k["window"].value is not None:
        k["window"].expected("null (full attention)")
    width = k["table_width"].int(1, INT32_MAX)
    need = min_table_width(ring, window or 0, block, max_context, max_chunk)
    if width < need:
        k["table_width"].fail(f"{width} blocks of {block} tokens cannot hold the "
                              f"{'window and a chunk' if ring else 'context'}; need {need}")
    blocks = k["default_blocks"].int(1, INT32_MAX)
    if blocks != max_seqs * width:
        k["default_blocks"].fail(f"{blocks}, not a whole sequence per decode slot "
                                 f"({max_seqs} x {width})")
    return XlaKvKind(name, width, ring, window, blocks)


def _pool(p: At, kinds: dict[str, XlaKvKind], block: int) -> XlaPool:
    kind = p["kind"].str(tuple(kinds))
    key = p["key"].str(pattern=NAME)
    shape = tuple(d.int(1, MAX_DIM) for d in p["block_shape"].items(2, 4))
    row = len(shape) == 2 and shape[0] == 1 and key.endswith(".scale")  # one row a block
    if shape[0] != block and not row:
        p["block_shape"].fail(f"{list(shape)} must start with the block size {block} (a "
                              f"scale pool's may be one row [1, S])")
    return XlaPool(key, kind, p["layers"].int(1, MAX_DIM), shape, p["dtype"].str(XLA_DTYPES))


def _mesh(at: At, weights: tuple[XlaWeight, ...], pools: tuple[XlaPool, ...]) -> XlaMesh:
    axis = at["axis"].str(pattern=r"[a-z_]{1,16}")
    size = at["size"].int(2, 1 << 16)
    specs = {}
    for group, arrays in (("weights", {w.key: len(w.shape) for w in weights}),
                          ("pools", {p.key: 2 + len(p.block_shape) for p in pools})):
        members = at[group].members()
        if set(members) != set(arrays):
            at[group].fail(f"names {len(members)} arrays; the manifest has {len(arrays)} "
                           f"{group}")
        for key, spec in members.items():
            parts = spec.items(0, arrays[key])
            for s in parts:
                if s.value is not None and s.value != axis:
                    s.expected(f"null or the mesh axis {axis!r}")
            specs[key] = tuple(s.value for s in parts)
    return XlaMesh(axis, size, specs)


def _precompiled(rec: At, name: str, programs: dict[str, Span], kinds: dict[str, XlaKvKind],
                 mesh: XlaMesh | None, sections: dict[str, int]) -> dict:
    """A topology's record (targets/xla/precompile.py writes it, runtime/executors/precompiled.py
    reads it), returned as it is once every field the runtime and `inspect` read is checked."""
    n = mesh.size if mesh else 1
    if rec["topology"].str() != name:
        rec["topology"].fail(f"differs from its key {name!r}")
    for key in ("platform", "device_kind", "jax", "jaxlib"):
        rec[key].str()
    if rec["libtpu"].nullable() is not None:
        rec["libtpu"].str()
    for d in rec["device_ids"].items(n, n):
        d.int(0, INT32_MAX)
    for c in rec["coords"].items(n, n):
        for x in c.items(0, 8):
            x.int(0, INT32_MAX)
    blocks = rec["kv_blocks"].members()
    if set(blocks) != set(kinds):
        rec["kv_blocks"].fail(f"names kinds {sorted(blocks)}, not {sorted(kinds)}")
    for b in blocks.values():
        b.int(1, INT32_MAX)
    for entry, loc in rec["entries"].members(256).items():
        if entry not in programs:
            loc.fail(f"{entry!r} is not an entry point of the artifact")
        _span(loc, "executables", sections)
        loc["sha256"].sha256()
    if rec.get("cost") is not None:
        _cost(rec["cost"])
    return rec.value


def _cost(c: At) -> None:
    """The fields of a cost estimate that `inspect` prints (targets/xla/cost_report.py)."""
    c["label"].str()
    c["context"].int(0)
    c["fits_at_max_seqs"].bool()
    for key in ("hbm_bytes_per_s", "bf16_flops", "hbm_bytes"):
        c["chip"][key].number(0.0)
    c["chip"]["generation"].str()
    dev = c["per_device"]
    for key in ("weight_bytes", "dense_bytes", "expert_bytes", "kv_bytes_per_lane",
                "peak_bytes", "xla_flops", "xla_bytes_accessed", "xla_amplification"):
        dev[key].number(0.0)
    dev["max_seqs"].int(0)
    for r in c["decode"].items(0, 1 << 12):
        r["batch"].int(1)
        for key in ("step_ms", "tok_s", "tok_s_xla", "hbm_need_bytes"):
            r[key].number(0.0)
        r["bound"].str()
        r["fits"].bool()
    t = c.get("traffic")  # added with the traffic table (issue 19); older files lack it
    if t is not None:
        _traffic(t)


def _traffic(t: At) -> None:
    """The fields of a traffic table that `inspect --cost` prints (targets/xla/hlo_traffic.py)."""
    t["label"].str()
    for key in ("total_bytes", "once_bytes", "on_chip_bytes", "amplification"):
        t[key].number(0.0)
    for loop in t["trips"].members(1 << 12).values():
        loop.int(0)
    for loop in t["unknown_trips"].items(0, 1 << 12):
        loop.str()
    for cls in ("weights", "embeddings", "kv", "io", "temps", "activations"):
        t["classes"][cls]["read"].number(0.0)
        t["classes"][cls]["written"].number(0.0)
    for r in t["top"].items(0, 1 << 8):
        for key in ("name", "op", "calls", "written_class"):
            r[key].str()
        r["runs"].int(0)
        for key in ("written", "on_chip", "step_bytes"):
            r[key].number(0.0)
        for b in r["read"].members(16).values():
            b.number(0.0)


def _h100(h: At, req: At, header: ArtifactHeader, model: ModelInfo,
          sections: dict[str, int]) -> H100Manifest:
    if header.platforms != ("cuda",):
        At(list(header.platforms), "header.platforms").expected("['cuda']")
    req["compute_capability"].str(pattern=r"[0-9]{1,2}\.[0-9]")
    req["min_driver"].int(1, 1 << 20)
    if req.get("kernel_launch") is not None:
        req["kernel_launch"].str()
    where = h["schedule"]
    schedule = KernelSchedule.from_json(where.value, where.path)
    tp = None if h.get("tensor_parallel") is None else _tensor_parallel(
        h["tensor_parallel"], schedule, model, sections)
    schedules = tp.schedules if tp else (schedule,)
    if tp is None and _has_collectives(schedule):
        where.fail("has collective steps, which only the ranks of tensor_parallel take")
    arena = max(x.arena_bytes for x in schedules)
    if req["arena_bytes"].int(1, MAX_BYTES) != arena:
        req["arena_bytes"].fail(f"{req['arena_bytes'].value} differs from the schedule's "
                                f"arena_bytes {arena}")
    if schedule.vocab_size != model.vocab_size:
        where["vocab_size"].fail(f"{schedule.vocab_size} differs from the model's "
                                 f"{model.vocab_size}")
    for region, size in (("weights", schedule.weights_bytes),
                         ("constants", schedule.constants_bytes)):
        if tp is None and sections[region] != size:
            where[f"{region}_bytes"].fail(f"{size}, but section {region!r} holds "
                                          f"{sections[region]} bytes")
    for module, c in schedule.cubins.items():
        if c.offset + c.size > sections["cubins"]:
            where["cubins"][module].fail(
                f"bytes [{c.offset}, {c.offset + c.size}) fall outside section 'cubins' of "
                f"{sections['cubins']} bytes")
    piece_hash = None
    if h.get("piece_hash") is not None:
        at = h["piece_hash"]
        module = at["module"].str(tuple(schedule.cubins))
        piece_hash = PieceHash(module, at["kernel"].str(pattern=r"[A-Za-z_][A-Za-z0-9_]{0,63}"))
    return H100Manifest(schedule, h["nvcc"].str(max_len=200, printable=True),
                        h["arch"].str(pattern=r"sm_[0-9]{2,3}a?"), tp, piece_hash)


MAX_TP_RANKS = 8  # the GPUs of one host


def _has_collectives(schedule: KernelSchedule) -> bool:
    return any(isinstance(x, Collective) for e in schedule.entries.values() for x in e.launches)


def _tensor_parallel(t: At, first: KernelSchedule, model: ModelInfo,
                     sections: dict[str, int]) -> H100TensorParallel:
    """The ranks' schedules: each a version-8 schedule of the model (9 with verify entries), the
    same entry points, draft_tokens and cubins as rank 0's, the same collectives in the same
    order (the ranks run in lockstep), an all-gather's destination holding every rank's part;
    the ranks' weights and constants regions one after another, filling their sections."""
    ranks = t["ranks"].int(2, MAX_TP_RANKS)
    peers = t["schedules"].items(ranks - 1, ranks - 1)
    schedules = (first, *(KernelSchedule.from_json(p.value, p.path) for p in peers))
    steps = _collective_steps(first)
    for r, (x, at) in enumerate(zip(schedules, [t, *peers], strict=True)):
        if x.version < TP_SCHEDULE_VERSION or x.version != first.version:
            at.fail(f"rank {r}'s schedule has version {x.version}; a rank's is version "
                    f"{TP_SCHEDULE_VERSION} or later, rank 0's ({first.version})")
        if x.vocab_size != model.vocab_size or x.cubins != first.cubins \
                or x.draft_tokens != first.draft_tokens:
            at.fail(f"rank {r}'s schedule differs from rank 0's in vocab_size, cubins or "
                    "draft_tokens")
        if x.entries.keys() != first.entries.keys() or _collective_steps(x) != steps:
            at.fail(f"rank {r}'s entry points or collectives differ from rank 0's (the ranks "
                    "run in lockstep)")
        for e in x.entries.values():
            for c in e.launches:
                if isinstance(c, Collective) and c.op == "all_gather" \
                        and c.dst + 4 * c.rows * c.cols * ranks > x.arena_bytes:
                    at.fail(f"rank {r}, {e.name}: an all-gather's destination runs past the "
                            "arena")
    offsets = {}
    for region, size in (("weights", "weights_bytes"), ("constants", "constants_bytes")):
        at = t[region]
        got = tuple(v.int(0, MAX_BYTES) for v in at.items(ranks, ranks))
        want, end = [], 0
        for x in schedules:
            want.append(end)
            end += getattr(x, size)
        if got != tuple(want) or end != sections[region]:
            at.fail(f"expected {want} (the ranks' {region} one after another), with section "
                    f"{region!r} of {end} bytes; got {list(got)} and {sections[region]}")
        offsets[region] = got
    return H100TensorParallel(schedules, offsets["weights"], offsets["constants"])


def _collective_steps(x: KernelSchedule) -> dict[str, list[tuple[str, int, int]]]:
    return {name: [(c.op, c.rows, c.cols) for c in e.launches if isinstance(c, Collective)]
            for name, e in x.entries.items()}

