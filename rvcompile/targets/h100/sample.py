"""Device-side sampling (kernels/sample.cu): the numpy reference, the launch plan and the limits.

out[m] = ops.ref_sample over softcap(logits) (cap * tanh(x / cap) in f32; cap <= 0: no softcap):
temperature <= 0 takes the argmax (lowest index on ties), otherwise top_k, then top_p, then the
token at u = sampling_uniform(seed, step), so a decode step copies back token ids only.

Three launches, in order on one stream, sharing one workspace of `workspace_bytes(M, V)` bytes
(scratch only, nothing kept between calls; the kernels zero what they accumulate):
    sample_prepare(const float* logits [M, V], int M, int V, float cap, void* ws)
    sample_filter(int M, int V, int chunk, const float* temperature [M], const int* top_k [M],
                  void* ws)
    sample_pick(int M, int V, const float* temperature, const int* top_k, const float* top_p [M],
                const int* seed [M], const int* step [M], void* ws, int* out [M])
(ratio.py declares the same source's sample_pick_dist, the pick that also writes each row's
record for the speculative ratio rule, and spec_ratio, the rule.)
Geometry and shared memory: `plan(M, V, sm_count)`; the filter and pick kernels need their
dynamic shared memory opted in (CudaContext.set_max_dynamic_smem) before the first launch.

Limits: V % 128 == 0 and 128 <= V <= 2^19; M >= 1; finite logits and temperatures; any top_k,
top_p in (0, 1] (above 1: 1). The kernels sum the weights exp(y / T - y_max / T) as exact 64-bit
fixed point (2^-42 of the largest), which is the reference's rule in exact arithmetic to ~2e-7.
The reference itself runs it in float32: its cumulative sums are off by its rounding, little on
peaked rows but up to ~6e-4 of the mass at V = 262144 with top_k = 0 (each token below ~3e-8 is
lost when added to a sum near 1). A draw whose u or top_p falls within that error of a cumulative
boundary can differ from the reference's token; every other draw is the same token.
top_p <= 0 keeps the first token; the reference instead clamps its empty kept set to the last
token of the sorted row (a degenerate setting the runtime should reject).

The sampler's extras (issue 16: the sampled entry points), around those three:
    sample_penalize(int M, int V, const int* pool, const int* pen_at [M], const int* pen_n [M],
                    const float* presence [M], const float* frequency [M],
                    const float* repetition [M], void* ws)                       after prepare
    sample_mask(int M, int V, const int* pool, const int* mask_at [M], const int* pen_n [M],
                void* ws)                                                        then this
    sample_logprob_stats(const float* logits [M, V], int M, int V, float cap,
                         const int* n_top [M], void* scratch)                   after prepare
    sample_logprobs(const float* logits [M, V], int M, int V, float cap, const int* tokens [M],
                    const int* n_top [M], int K, const void* scratch, float* logprob [M],
                    int* top_ids [M, K], float* top_logprobs [M, K])            after pick
`pool` holds each row's penalty pairs (id, count) from word pen_at[row] (pen_n[row] pairs, ids
distinct and in the vocabulary) and its token mask from word mask_at[row] (V / 32 words; -1: no
mask); `scratch` (logprob_scratch_bytes(M, V), no state between calls) carries the stats of
the unpenalized row, per 4096 elements and per group, from the first logprobs kernel to the
second. References: `penalize` (ops.ref_penalize), `token_mask` (ops.ref_token_mask) and
`logprobs` (log_softmax of softcap(logits), as targets/xla/sampler.py: the model's own
distribution, before penalties, mask and temperature; the stats kernel's work is part of it).
Neutral extras (no pairs, no mask) leave the workspace as sample_prepare wrote it, so the pick
is the plain entry's, bit for bit. Masked tokens are -inf, which the filter and pick weigh 0; a
row must allow some token.

Cost: greedy rows cost the prepare pass and a max. Sampling rows gather the elements at or above
a threshold that at least min(top_k', CAND_RANK) elements reach (top_k' = top_k, or V when top_k
<= 0 or >= V) as candidates, and sort them in shared memory (at most CAP). What lies past the
candidates (top_k' > CAND_RANK, and top_k = 0 with the top_p mass or u * S beyond them: flat
distributions) is found through a 4096-bucket histogram and costs sample_pick one or a few
single-CTA passes over the row, so those draws are slower. More than CAP candidates (logits
clustered by index, or massive ties) cost the same narrowing passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rvcompile.artifacts.kernel_schedule import SAMPLER_KERNEL
from rvcompile.ir import ops
from rvcompile.targets.h100.contract import Call, Entry, f32, i32, ptr
from rvcompile.targets.h100.gemv_fp8 import Launch

SOURCE = "sample.cu"
PREPARE_ENTRY = SAMPLER_KERNEL  # the sampler's first launch: the runtime may split a sampled
# entry there (kernel_schedule.KernelSchedule.sampler_split)
FILTER_ENTRY = "sample_filter"
PICK_ENTRY = "sample_pick"
PENALIZE_ENTRY = "sample_penalize"
MASK_ENTRY = "sample_mask"
LOGPROB_STATS_ENTRY = "sample_logprob_stats"
LOGPROBS_ENTRY = "sample_logprobs"

# must match the kernel (tests/test_h100_sample.py reads them from the source)
THREADS = 1024
GROUP = 128  # elements per group maximum
CAND_RANK = 1024
CAP = 2048
BUCKETS = 4096
MAX_GROUPS = 4096
MAX_TOP = 32  # most top log-probabilities sample_logprobs returns per row
TOP_LOGPROBS = 20  # what the sampled entries return: OpenAI's largest top_logprobs, as XLA's

PREPARE_CHUNK = 4 * THREADS  # elements per sample_prepare CTA: one float4 per thread
MAX_VOCAB = MAX_GROUPS * GROUP
WARPS = THREADS // 32
FILTER_SMEM = MAX_GROUPS * 8 + BUCKETS * 8 + (WARPS + 1) * 8 + BUCKETS * 4
PICK_SMEM = 4 * CAP * 8 + BUCKETS * 8 + (WARPS + 1) * 8 + 2 * 8 + BUCKETS * 4 + 2 * 4


def softcap(logits: np.ndarray, cap: float) -> np.ndarray:
    """The IR's SOFTCAP reference; cap <= 0 is no softcap."""
    logits = np.asarray(logits, np.float32)
    if cap <= 0:
        return logits
    return ops.OPS[ops.Op.SOFTCAP].reference(ops.SoftcapAttrs(cap), logits)


def reference(logits, cap: float, temperature, top_k, top_p, seed, step) -> np.ndarray:
    """int32 [M]: the IR's SAMPLE reference over softcap(logits)."""
    return ops.ref_sample(None, softcap(logits, cap), np.asarray(temperature, np.float32),
                          np.asarray(top_k, np.int32), np.asarray(top_p, np.float32),
                          np.asarray(seed, np.int32), np.asarray(step, np.int32))


def penalize(y, ids, counts, presence: float, frequency: float, repetition: float) -> np.ndarray:
    """float32 [V]: row y with the listed ids penalized (ops.ref_penalize; -0 as +0)."""
    out = ops.ref_penalize(np.asarray(y, np.float32)[None], np.asarray(ids, np.int32)[None],
                           np.asarray(counts, np.int32)[None], [presence], [frequency],
                           [repetition])[0]
    return out + np.float32(0)  # -0 -> +0, as the kernel stores it


def token_mask(y, mask) -> np.ndarray:
    """float32 [V]: row y with the tokens whose bit in mask [V / 32] is 0 set to -inf."""
    return ops.ref_token_mask(np.asarray(y, np.float32)[None], np.asarray(mask)[None])[0]


def logprobs(logits, cap: float, tokens, n_top, k: int):
    """(logprob [M], top_ids [M, k], top_logprobs [M, k]) under log_softmax(softcap(logits)) in
    float32 (jax.nn.log_softmax's steps): the token's where n_top >= 0, the k likeliest (ties:
    the lower index) where n_top > 0, zeros elsewhere."""
    y = softcap(logits, cap)
    shifted = y - y.max(-1, keepdims=True)
    lp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True, dtype=np.float32))
    m = y.shape[0]
    n_top = np.asarray(n_top, np.int32)
    chosen = lp[np.arange(m), np.asarray(tokens, np.int64)]
    logprob = np.where(n_top >= 0, chosen, 0).astype(np.float32)
    ids = np.argsort(-lp, axis=-1, kind="stable")[:, :k].astype(np.int32)
    vals = np.take_along_axis(lp, ids, -1)
    on = (n_top > 0)[:, None]
    return logprob, np.where(on, ids, 0).astype(np.int32), np.where(on, vals, 0).astype(
        np.float32)


def workspace_bytes(m: int, v: int) -> int:
    """Bytes of the kernels' workspace (layout: carve() in the kernel)."""
    per_row = (4 * v + 8 * (v // GROUP) + 8 * CAP + 8 * BUCKETS + 8 + 8 + 4 * BUCKETS + 4)
    return m * per_row


def filter_chunk(m: int, v: int, sm_count: int) -> int:
    """Elements per sample_filter CTA: a multiple of PREPARE_CHUNK, about two CTAs per SM over all
    rows (each CTA also re-derives the row's threshold from its group maxima)."""
    tiles = -(-v // PREPARE_CHUNK)
    ctas_per_row = max(1, min(tiles, -(-2 * sm_count // m)))
    return PREPARE_CHUNK * -(-tiles // ctas_per_row)


def check_top(k: int) -> None:
    if not 1 <= k <= MAX_TOP:
        raise ValueError(f"top log-probabilities per row must be 1 to {MAX_TOP}, not {k}")


def mask_words(v: int) -> int:
    return -(-v // 32)


def logprob_scratch_bytes(m: int, v: int) -> int:
    """Bytes of the logprobs kernels' scratch (layout: lp_carve() in the kernel)."""
    return m * (8 * -(-v // PREPARE_CHUNK) + 8 * (v // GROUP))


@dataclass(frozen=True)
class Extras:
    """The launches of the sampler's extras for [M, V] rows."""

    stats: Launch
    penalize: Launch
    mask: Launch
    logprobs: Launch
    scratch: int  # bytes


def extras_plan(m: int, v: int) -> Extras:
    check_limits(m, v)
    block = (THREADS, 1, 1)
    per_chunk = Launch((-(-v // PREPARE_CHUNK), m, 1), block, 0)
    return Extras(stats=per_chunk, penalize=Launch((m, 1, 1), block, 0), mask=per_chunk,
                  logprobs=Launch((m, 1, 1), block, 0), scratch=logprob_scratch_bytes(m, v))


@dataclass(frozen=True)
class Plan:
    prepare: Launch
    filter: Launch
    pick: Launch
    chunk: int  # sample_filter's `chunk` argument
    workspace: int  # bytes


def check_limits(m: int, v: int) -> None:
    if m < 1 or v % GROUP or not GROUP <= v <= MAX_VOCAB:
        raise ValueError(f"sampling needs M >= 1, V % {GROUP} == 0 and {GROUP} <= V <= "
                         f"{MAX_VOCAB} (M={m}, V={v})")


def plan(m: int, v: int, sm_count: int) -> Plan:
    check_limits(m, v)
    chunk = filter_chunk(m, v, sm_count)
    block = (THREADS, 1, 1)
    return Plan(prepare=Launch((-(-v // PREPARE_CHUNK), m, 1), block, 0),
                filter=Launch((-(-v // chunk), m, 1), block, FILTER_SMEM),
                pick=Launch((m, 1, 1), block, PICK_SMEM),
                chunk=chunk, workspace=workspace_bytes(m, v))


# ---------------------------------------------------------------- entries

def workspace_logits(c: Call) -> np.ndarray:
    """The workspace is the kernels' scratch; the references keep softcap(logits) [M, V] in it
    from the prepare to the pick."""
    m, v = c["M"], c["V"]
    return c.array("workspace", (m * v * 4,)).view(np.float32).reshape(m, v)


def _prepare_call(c: Call) -> None:
    workspace_logits(c)[:] = softcap(c.array("logits", (c["M"], c["V"])), c["cap"])


def _filter_call(c: Call) -> None:
    """Nothing: the candidate selection is part of the pick's reference."""


def pick_call(c: Call) -> None:
    m = c["M"]
    c.array("out", (m,))[:] = reference(
        workspace_logits(c), 0.0, c.array("temperature", (m,)), c.array("top_k", (m,)),
        c.array("top_p", (m,)), c.array("seed", (m,)), c.array("step", (m,)))


def _penalize_call(c: Call) -> None:
    m = c["M"]
    y = workspace_logits(c)
    pen_at, pen_n = c.array("pen_at", (m,)), c.array("pen_n", (m,))
    presence, frequency = c.array("presence", (m,)), c.array("frequency", (m,))
    repetition = c.array("repetition", (m,))
    for row in range(m):
        n = int(pen_n[row])
        if n <= 0:
            continue
        pairs = c.array("pool", (int(pen_at[row]) + 2 * n,))[int(pen_at[row]):].reshape(n, 2)
        y[row] = penalize(y[row], pairs[:, 0], pairs[:, 1], presence[row], frequency[row],
                          repetition[row])


def _mask_call(c: Call) -> None:
    m, v = c["M"], c["V"]
    y = workspace_logits(c)
    mask_at = c.array("mask_at", (m,))
    for row in range(m):
        at = int(mask_at[row])
        if at >= 0:
            y[row] = token_mask(y[row], c.array("pool", (at + mask_words(v),))[at:])


def _logprob_stats_call(c: Call) -> None:
    """Nothing: the stats are part of the logprobs' reference."""


def _logprobs_call(c: Call) -> None:
    m, v, k = c["M"], c["V"], c["K"]
    lp, ids, vals = logprobs(c.array("logits", (m, v)), c["cap"], c.array("tokens", (m,)),
                             c.array("n_top", (m,)), k)
    c.array("logprob", (m,))[:] = lp
    c.array("top_ids", (m, k))[:] = ids
    c.array("top_logprobs", (m, k))[:] = vals


ENTRIES = (
    Entry(PREPARE_ENTRY, SOURCE, (ptr("logits", "float32"), i32("M"), i32("V"), f32("cap"),
                                  ptr("workspace", "bytes", "out")), _prepare_call),
    Entry(FILTER_ENTRY, SOURCE, (i32("M"), i32("V"), i32("chunk"), ptr("temperature", "float32"),
                                 ptr("top_k", "int32"), ptr("workspace", "bytes", "inout")),
          _filter_call),
    Entry(PICK_ENTRY, SOURCE, (i32("M"), i32("V"), ptr("temperature", "float32"),
                               ptr("top_k", "int32"), ptr("top_p", "float32"),
                               ptr("seed", "int32"), ptr("step", "int32"),
                               ptr("workspace", "bytes", "inout"), ptr("out", "int32", "out")),
          pick_call),
    Entry(PENALIZE_ENTRY, SOURCE, (i32("M"), i32("V"), ptr("pool", "int32"),
                                   ptr("pen_at", "int32"), ptr("pen_n", "int32"),
                                   ptr("presence", "float32"), ptr("frequency", "float32"),
                                   ptr("repetition", "float32"),
                                   ptr("workspace", "bytes", "inout")), _penalize_call),
    Entry(MASK_ENTRY, SOURCE, (i32("M"), i32("V"), ptr("pool", "int32"), ptr("mask_at", "int32"),
                               ptr("pen_n", "int32"), ptr("workspace", "bytes", "inout")),
          _mask_call),
    Entry(LOGPROB_STATS_ENTRY, SOURCE, (ptr("logits", "float32"), i32("M"), i32("V"),
                                        f32("cap"), ptr("n_top", "int32"),
                                        ptr("scratch", "bytes", "out")), _logprob_stats_call),
    Entry(LOGPROBS_ENTRY, SOURCE, (ptr("logits", "float32"), i32("M"), i32("V"), f32("cap"),
                                   ptr("tokens", "int32"), ptr("n_top", "int32"), i32("K"),
                                   ptr("scratch", "bytes"), ptr("logprob", "float32", "out"),
                                   ptr("top_ids", "int32", "out"),
                                   ptr("top_logprobs", "float32", "out")), _logprobs_call),
)
