"""The sampling step's extras on the XLA targets (issue 16): penalties and a token mask before the
IR's SAMPLE, log-probabilities after it. `Program.step` runs them in prefill_{T} and
decode_{B}; the manifest's `xla.sampler` records the shapes below, so a runtime knows the
entry points take them.

Extra inputs, after the five sampling arrays, per lane (B lanes):
- mask        int32 [B, W], W = ceil(V / 32): bit j of word w allows token 32 w + j; a token
              whose bit is 0 is never sampled (a grammar's mask; all bits set: no constraint).
- pen_ids     int32 [B, P]: the token ids penalties touch (-1: none); P = max_context, since a
              sequence holds at most that many distinct tokens.
- pen_counts  int32 [B, P]: how often each of them was generated (0: a prompt token only).
- presence, frequency, repetition   float32 [B]: OpenAI's presence and frequency penalties
              (logit -= frequency * count + presence * (count > 0)) after the repetition penalty
              (HF's: a listed token's logit divided by it when positive, multiplied when not).
- n_top       int32 [B]: top log-probabilities wanted (0 to TOP_LOGPROBS); any lane above 0
              computes them for all.
Extra outputs: logprob float32 [B] (the sampled token's), top_ids int32 [B, TOP_LOGPROBS] and
top_logprobs float32 [B, TOP_LOGPROBS] (zeros unless some lane asked), all of the model's own
distribution: log_softmax of the head's logits, before penalties, mask and temperature.
Neutral values (mask all ones, no pen_ids, n_top 0) leave the sampled tokens bit for bit those
of the plain sampler. The numpy references are ir/ops.py's ref_penalize and ref_token_mask.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from rvcompile.targets.xla.hlo_traffic import BRANCHES
from rvcompile.targets.xla.lower import mesh_devices, sample_branch, sample_without_sort

TOP_LOGPROBS = 20  # OpenAI's largest top_logprobs


def mask_words(vocab: int) -> int:
    return -(-vocab // 32)


def penalize(logits, pen_ids, pen_counts, presence, frequency, repetition):
    """logits [B, V] with the penalties of the listed ids applied (ids -1 are skipped); the
    gather and scatter of B * P ids run only when some id is listed."""
    with jax.named_scope(BRANCHES.format(name="penalties")):
        return lax.cond(jnp.any(pen_ids >= 0), _penalize, lambda *a: a[0], logits, pen_ids,
                        pen_counts, presence, frequency, repetition)


def _penalize(logits, pen_ids, pen_counts, presence, frequency, repetition):
    b, vocab = logits.shape
    valid = pen_ids >= 0
    x = jnp.take_along_axis(logits, jnp.where(valid, pen_ids, 0), axis=-1)
    r = repetition[:, None]
    x = jnp.where(x > 0, x / r, x * r)
    c = pen_counts.astype(jnp.float32)
    x = x - frequency[:, None] * c - presence[:, None] * (c > 0).astype(jnp.float32)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], pen_ids.shape)
    return logits.at[rows, jnp.where(valid, pen_ids, vocab)].set(x, mode="drop")


def apply_mask(logits, mask):
    """logits [B, V] with tokens whose mask bit is 0 set to -inf."""
    vocab = logits.shape[-1]
    if logits.shape[0] == 1 and vocab % 128 == 0:
        return _apply_mask_rows(logits, mask)
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(mask.shape[0], -1)[:, :vocab] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def _apply_mask_rows(logits, mask):
    """apply_mask of one lane's V = 128 n ids, in rows of 128: each row's 16 mask bytes spread
    over its 128 lanes by a dot with a 0/1 matrix (exact: one product of a byte, 0 to 255, a
    lane; bf16 holds it). On TPU the bits of the form above are broadcast, relaid and read in
    three passes (V = 262144 on v6e: 12 MiB a step, every step); this is one fusion with the
    logits (4.5 MiB, 2 of them the logits' own prefetch). Not for 2 or more lanes: there the
    logits' [B, V / 128, 128] view is a relayout (the 31B at B = 64, TP = 8: a greedy step
    0.15 GiB more, the penalties' identity branch copying the logits into that layout)."""
    b, vocab = logits.shape
    rows = vocab // 128
    byte = (mask[:, :, None] >> (8 * jnp.arange(4, dtype=jnp.int32))) & 0xFF  # ids 8 q .. 8 q + 7
    byte = byte.reshape(b, rows, 16).astype(jnp.bfloat16)
    lane = jnp.arange(128, dtype=jnp.int32)
    spread = (lane[None, :] // 8 == jnp.arange(16)[:, None]).astype(jnp.bfloat16)  # [16, 128]
    word = jnp.einsum("brq,ql->brl", byte, spread, preferred_element_type=jnp.float32)
    allowed = (word.astype(jnp.int32) >> (lane % 8)) & 1
    return jnp.where(allowed != 0, logits.reshape(b, rows, 128), -jnp.inf).reshape(b, vocab)


class Choice(NamedTuple):
    """A step's branches, each chosen over the whole batch (`choose`). Under `split_by_rows`
    each device samples a share of the rows, and the branches it takes must be those the whole
    batch takes on one device: the top-k branch and the sort agree only in exact arithmetic
    (lower.sample), and the top log-probabilities are computed for every lane once some lane
    wants them."""

    sample: jax.Array  # int32 []: lower.sample's branch (lower.sample_branch)
    easy: jax.Array  # bool []: no penalty id listed, every mask bit set, no row needs the sort
    top: jax.Array  # bool []: some lane wants top log-probabilities


def choose(temperature, top_k, mask, pen_ids, n_top) -> Choice:
    """The Choice of a batch's sampling arrays, whole."""
    easy = ~jnp.any(pen_ids >= 0) & jnp.all(mask == -1) & sample_without_sort(temperature, top_k)
    return Choice(sample_branch(temperature, top_k), easy, jnp.any(n_top > 0))


def splits_by_rows(mesh, batch: int) -> bool:
    """Whether `split_by_rows` serves a batch of `batch` rows under `mesh` (None: one device):
    a mesh of N > 1 devices and a batch of a multiple of N rows (B = 1 never: one lane's step
    stays on every device, as it was)."""
    n = mesh_devices(mesh)
    return n > 1 and batch % n == 0


def split_by_rows(fn, mesh, logits, rows: tuple, choice):
    """fn(logits, *rows, choice) on each device's share of the batch: B / N consecutive rows of
    the logits [B, V] and of each per-row array of `rows` (first axis B), with `choice` made
    over the whole batch and whole on every device (Program.step_sampled's Choice,
    Program.step's lower.sample_branch); fn's outputs (first axis B / N) come back
    concatenated, device by device, in row order. Each row's operations are those it has on
    one device on the whole batch, and so are its branches (`choice` is the batch's): the
    outputs are fn's on the whole batch up to the rounding of reductions (Numerics below).

    Why: sampling on the whole batch on every device repeats every pass over the [B, V] logits
    N times (the 31B at B = 64, TP = 8 on v6e: the shaped branch's sort over [64, 262144] is
    2.48 GiB of each device's step, est.). Split by rows each device reads its share; the
    logits, which the head leaves split by vocabulary, move by one all-to-all (each device
    sends (N - 1) / N of its [B, V / N] and keeps [B / N, V]) instead of an all-gather of the
    whole [B, V] to every device. The per-row arrays are whole on every device (the program's
    arguments): each device slices its rows. penalize's conditional is taken by each share
    (its branches agree bit for bit on rows with no id listed).

    The logits are pinned to their split by vocabulary and put behind an optimization barrier
    before they are split by rows: unpinned, the rows' split propagated back through the head
    into the layers, and XLA split the whole decoder by batch rows (the tiny model at TP = 4
    on the CPU: its embedding table all-gathered, the attention's block tables and masks too).

    Numerics: each row's operations are the same, but XLA may round a reduction over a row in
    another order when the array has fewer rows (the CPU's sum over [8, 1000] and over its
    [2, 1000] shares differ in the last bits), so the log-probabilities and the sampling sums
    may differ from one device's by float32 rounding (tests/test_xla_sample_step.py: the
    tokens the same in every case, the log-probabilities within 5e-7)."""
    axis = mesh.axis_names[0]
    split = PartitionSpec(axis)
    logits = lax.optimization_barrier(
        lax.with_sharding_constraint(logits, NamedSharding(mesh, PartitionSpec(None, axis))))
    return jax.shard_map(fn, mesh=mesh, in_specs=(split, *(split,) * len(rows), PartitionSpec()),
                         out_specs=split, check_vma=False)(logits, *rows, choice)


def sample_step(draw, logits, temperature, top_k, mask, pen_ids, pen_counts, presence,
                frequency, repetition, n_top, whole=None, choice=None):
    """(tokens, logprob, top_ids, top_logprobs) of a step's logits [B, V] with its extras (the
    module docstring): the tokens of `draw(x, greedy, sort)` (the IR's sampler on x, given
    their argmax or None, with or without its sort branch: lower.sample) after the penalties
    and mask, the log-probabilities of the logits as they are. Their argmax is taken once, for
    both.

    A step with no penalty id listed, every mask bit set and no row that needs the sort (every
    greedy or top-k <= 64 request without extras) draws from the logits themselves: penalize's
    identity branch and a mask of ones leave them bit for bit as they are, so the tokens are the
    same, but the [B, V] passes of the shaping are skipped (the 31B at B = 64 on v6e: the
    identity branch's copy of the logits, the mask's bits broadcast to [B, V] and its select).
    It is a conditional around the draw, not around the shaping: one returning the [B, V]
    shaped logits copies them, since the log-probabilities still read the unshaped ones. Its
    plain branch has no sort, which only the other holds, so the sort appears once.

    `whole(logits)`: the logits whole on every device (Program._whole: under TP the head leaves
    them split by vocabulary and this all-gathers them; identity without a mesh). They are
    gathered where a whole row is read: for the argmax and log-sum-exp, which come first, and
    inside the branches that need them (the shaped draw, the top log-probabilities). Handed the
    gathered [B, V] as an operand, the draw's conditional had XLA move them from on-chip memory
    to HBM before it (the 31B at B = 64, TP = 4: 128 MiB a step, est.); the split logits it
    gets instead are 1 / TP of that. The plain branch needs no gather: its greedy case
    is the argmax and its logit the max, its top-k case draws from the split logits (XLA
    partitions lax.top_k by device and merges the candidates: the same values and ids). The
    log-sum-exp and top-K conditional come before the draw behind an optimization barrier: else
    XLA ran them after it, with the logits fetched back from HBM.

    `choice`: the step's branches (Choice), made over the whole batch where these rows are one
    device's share of it (split_by_rows; `draw` then passes choice.sample to lower.sample);
    None: made here, of these rows.
    """
    whole = whole or (lambda x: x)
    if choice is None:
        choice = choose(temperature, top_k, mask, pen_ids, n_top)
    x = whole(logits)
    top = jnp.argmax(x.astype(jnp.float32), axis=-1).astype(jnp.int32)
    peak, lse = log_normalizer(x, top)
    ids, vals = top_logprobs(logits, peak, lse, n_top, whole, choice.top)
    logits, top, peak, lse = lax.optimization_barrier((logits, top, peak, lse))

    def drawn(x, toks):  # the tokens and their logits
        return toks, jnp.take_along_axis(x.astype(jnp.float32), toks[:, None], axis=-1)

    def greedy():  # the argmax, whose logit is the max
        return top, peak

    def sampled():  # every row greedy or top-k <= 64 (sample_without_sort): no gather
        return drawn(logits, draw(logits, top, False))

    def plain():
        with jax.named_scope(BRANCHES.format(name="sample")):  # lower.sample's branches 0, 1
            return lax.cond(choice.sample != 0, sampled, greedy)

    def shaped():
        x = whole(logits)
        shaped = apply_mask(penalize(x, pen_ids, pen_counts, presence, frequency, repetition),
                            mask)
        return drawn(x, draw(shaped, None, True))

    with jax.named_scope(BRANCHES.format(name="shaping")):  # branch 0: plain (STEP_CASES)
        toks, chosen = lax.cond(~choice.easy, shaped, plain)
    return toks, ((chosen - peak) - lse)[:, 0], ids, vals


def log_normalizer(logits, top):
    """(max [B, 1], log(sum(exp(x - max))) [B, 1]) of logits [B, V], the max read at their
    argmax `top` [B] (jax.nn.log_softmax's max: the same value, at most the sign of a zero max
    differs, which x - max does not see except in the sign of a zero result)."""
    x = logits.astype(jnp.float32)
    peak = jnp.take_along_axis(x, top[:, None], axis=-1)
    return peak, jnp.log(jnp.sum(jnp.exp(x - peak), axis=-1, keepdims=True))


def chosen_logprob(logits, peak, lse, tokens):
    """log_softmax(logits) [B] at tokens [B]: jax.nn.log_softmax's arithmetic,
    (x - max) - log(sum(exp(x - max))), at that one id."""
    x = jnp.take_along_axis(logits.astype(jnp.float32), tokens[:, None], axis=-1)
    return ((x - peak) - lse)[:, 0]


def top_logprobs(logits, peak, lse, n_top, whole=None, wanted=None):
    """(top ids [B, K], top logprobs [B, K]) of log_softmax(logits), zeros unless some lane
    wants them: the [B, V] log-softmax is made only then (it was written whole every step, with
    a second copy, on TPU: the 31B at B = 64, 0.25 GiB a step, est.). `wanted`: whether some
    lane of the whole batch wants them (Choice.top), where these rows are a share of it."""
    b = logits.shape[0]
    wanted = jnp.any(n_top > 0) if wanted is None else wanted

    def best(_):
        x = logits if whole is None else whole(logits)
        vals, ids = lax.top_k((x.astype(jnp.float32) - peak) - lse, TOP_LOGPROBS)
        return ids.astype(jnp.int32), vals

    def none(_):
        return (jnp.zeros((b, TOP_LOGPROBS), jnp.int32),
                jnp.zeros((b, TOP_LOGPROBS), jnp.float32))

    with jax.named_scope(BRANCHES.format(name="top_logprobs")):
        return lax.cond(wanted, best, none, None)


def logprobs(logits, tokens, n_top):
    """(logprob [B] of tokens, top ids [B, K], top logprobs [B, K]) under log_softmax(logits)."""
    top = jnp.argmax(logits.astype(jnp.float32), axis=-1)
    peak, lse = log_normalizer(logits, top)
    return (chosen_logprob(logits, peak, lse, tokens), *top_logprobs(logits, peak, lse, n_top))


def extras_shapes(batch: int, vocab: int, penalty_ids: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """mask, pen_ids, pen_counts, presence, frequency, repetition, n_top of `batch` lanes."""
    i, f = jnp.int32, jnp.float32
    return (jax.ShapeDtypeStruct((batch, mask_words(vocab)), i),
            jax.ShapeDtypeStruct((batch, penalty_ids), i),
            jax.ShapeDtypeStruct((batch, penalty_ids), i),
            *(jax.ShapeDtypeStruct((batch,), f) for _ in range(3)),
            jax.ShapeDtypeStruct((batch,), i))
