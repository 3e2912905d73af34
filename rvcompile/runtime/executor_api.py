"""The engine <-> executor contract: what a target's executor offers so that the engine (and so
Model and `rvrun serve`) can drive it, whatever target built the artifact.

The executor runs entry points over *sequences of KV blocks*; it makes no policy. The engine
owns block ids (one BlockPool per kind), decides what runs in each call and builds each
sequence's block tables:
- a "full" table entry j holds the sequence's positions [j * block_size, (j + 1) * block_size);
- a "sliding" table is a ring: entry j % table_width holds logical block j. It is wide enough
  for a window of keys behind a chunk's first token plus the chunk itself, so the engine swaps
  a fresh block into an entry only once the block there has left every later token's window.
An entry nobody reads (past the sequence's length, or outside the window) may hold any id.
Rows a call writes always land in blocks the sequence owns alone (full blocks are shared only
once complete).

Reproducibility: sampling runs on the device from (seed, step), and a row's result may depend on
the shape of the call it runs in (the prefill row count, the decode width) but never on the
other rows' values. The engine therefore runs every sequence through the same calls however it
is batched, cached or preempted (`SeqChunk.rows`), and the same request gives the same tokens.

Failures: a call that raises DeviceError has left the device unusable, and the engine stops;
a call that raises anything else ends only the sequences it ran, whose blocks go back to the
pools, and the engine goes on with the next call.

Packed prefill (optional, `packs_prefill(executor)`; issue 14): `prefill_packed` runs the
prompt chunks of several sequences in one call, so short prompts share the weight reads of one
wide call. The executor promises that each chunk's rows compute bit for bit as in the prefill
call `prefill` would run it in (its SeqChunk.rows), so packing changes no recipe; `packed_rows`
says whether chunks can share a call and how many rows they need. Chunks with extras run alone,
unless the executor also offers `prefill_packed_sampled` (`packs_sampled(executor)`; issue 16):
prefill_packed with each chunk's SampleExtras applied to its sampled token, as prefill_sampled
applies them, returning each chunk's Sampled (chunks without extras sample what
prefill_packed gives them).

Mixed calls (optional, `mixes_decode(executor)`; issue 14): `prefill_decode` runs packed
prompt chunks and a step's decode lanes in one call, so the chunks ride along the lanes' read
of the weights. The executor promises that the chunks compute bit for bit as `prefill_packed`
runs them and the lanes as `decode` does, so mixing changes no token; `mixes(chunks, lanes)`
says whether a call takes them (only some decode widths have mixed calls). Neither the chunks
nor the lanes may carry extras.

Handoff (optional: an executor with a `while_running` attribute): the caller may set it to a
function, which the executor calls once, right after its next device launch and before it waits
for the device, and then clears; so host work of the caller's (handing a step's outputs to an
event loop) runs while the device computes instead of beside the caller's own host work.

Sampler extras (optional, `top_logprobs(executor)` > 0; issue 16): `prefill_sampled` and
`decode_sampled` apply a chunk's SampleExtras (penalties, a token mask) before sampling and
return the token's log-probability and the top ones; neutral extras sample what `prefill` and
`decode` do, bit for bit.

Late masks (optional, `takes_late_masks(executor)`; issue 16): a grammar mask needs the token
before it, so the engine may not have a lane's mask when the call starts. `decode_late_masks`
and `prefill_late_masks` are decode_sampled and prefill_sampled with the token masks handed
over later: the executor starts the forward pass, then calls `masks()` on the caller's thread
(which may wait for them meanwhile: the device runs the forward pass), then samples each lane
under masks()[i] in place of its extras.mask (None: no mask). The tokens are decode_sampled's
with those masks, bit for bit. If masks() raises, the call raises it (its lanes sampled
nothing); the executor is then ready for the next call.

Decode loop (optional, `decode_loop_steps` > 0): `decode_many` runs up to that many decode
steps in one call, each bit for bit a `decode` call of the same lanes, so the engine is not in
the per-token path (the XLA targets run the loop as one device program; the h100 executor
replays its decode graph once per step, moving the lanes on in the io between replays). Every
lane must own the blocks of the positions its budget can reach; a call never runs more than
max_chunk steps, so the sliding ring holds them. Engines check the capability with
`decode_loop_steps(executor)`, never the executor's type.

Progressive decode loop (optional, `loop_progress(executor)`; issue 14): `decode_many(lanes,
progress, group)` launches its steps in groups of `group` (>= 1) and keeps the next group
queued on the device while the host handles the last one: it launches group g + 1, then waits
for group g's tokens and calls `progress(new)`, new[i] being lane i's tokens of group g (up to
its budget and first stop id, as decode_many returns them; [] once the lane has ended), so the
caller's work on them (detokenizing, streaming) overlaps the device's next group. progress
returns whether to go on: after False no further group is launched, but the group already
launched runs and its tokens come through progress too. The call returns every lane's tokens
(all that progress was given). The lanes' blocks are the call's until it returns: the device
may write into them up to each lane's budget, also after the lane ended (a stop id, or the
caller no longer wanting it), so the caller frees none of them before.

Masked decode loop (optional, `masked_loop(executor)`; issue 16): `decode_many_masked(lanes,
masks, progress)` is a progressive decode_many of one step a group whose lanes sample under
token masks that depend on the tokens before them (grammars), so constrained sequences keep the
device loop. A lane's chunk.extras may hold a mask only (None: no mask; no penalties nor
log-probabilities). Step 0 samples each lane under its chunk's mask; every step's tokens (`new`,
as progress gets them) go first to `masks(new)`, on the caller's thread while the device runs
the next step's forward pass, which returns the next step's masks, one per lane (None:
unmasked; the last step's are not used); then to `progress(new)`, once the next step's sampler
and the step after's forward pass are queued, so the caller's work on them overlaps the device.
Each step's tokens are decode_sampled's of the same lanes under those masks (the RNG step one
on), bit for bit. progress returning False, the blocks, and the return value: as for the
progressive loop. If masks raises, the call raises it once the device is done.

Speculative decoding (optional, `max_draft_tokens(executor)` > 0; issue 15). One round of a
sequence whose target has cached positions [0, p) and whose last accepted token x sits at p:
- `verify`: one call runs x and up to max_draft_tokens drafts d1..dk as k + 1 rows at
  positions p..p+k (writing their KV) and returns, per row, the token after it and an opaque
  state (the target's final-normed hidden state there). The caller keeps the longest prefix of
  drafts with d(i+1) == tokens[i] (m of them) and takes tokens[m] as the next token; rows past
  m wrote KV that later writes overwrite (the engine's block bookkeeping must not count them,
  nor hash them into the prefix cache). Which tokens come back depends on the lane:
  - by exact match (a lane without draft_probs: n-gram drafts, no drafts, greedy): row i's
    token is the target's, sampled at RNG step `step + i` (what `decode` would give after x,
    d1..di), so a draft is kept where it equals the token the target samples there;
  - by the ratio rule (a lane whose SeqChunk.draft_probs is its Drafted.draft_probs, at
    temperature > 0): the executor accepts d(i+1) with probability min(1, p(d) / q(d)) (p the
    target's sampling distribution at row i, q the drafter's), and at the first rejection
    draws the next token from max(0, p - q) renormalised (all accepted: the target's token
    after row k, at step + k); it returns the accepted drafts, then the new token, then -1,
    so the same comparison finds m (a rejected draft is never the residual's token).
  Both keep the output distribution the target's.
- `draft` (with an assistant, `has_drafter(executor)`): from a token at position q (the target
  has cached [0, q): after a verify accepting m drafts, q = p + m + 1, the token tokens[m], the
  state `states[m]`) n assistant steps at that position over the target's caches, which it only
  reads; draft i is sampled at RNG step `step + i` (greedy lanes draft the assistant's argmax,
  as transformers does) from a distribution it returns, opaque, as `draft_probs` for verify's
  ratio rule. A sequence with no state yet (just prefilled) runs one verify with no drafts
  first: a decode step that also yields a state.
A verify lane with no drafts is a decode lane; a sequence not drafting can ride along in one.
Verify needs the blocks of positions [p, p + k] like a prefill chunk of k + 1 rows does. The
engine (engine.py, speculative.py) runs every speculating sequence's tokens through verify and
keeps plain sequences in decode calls, so each sequence's rows come from one call shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from rvcompile.progress import Phases
from rvcompile.runtime.pending_checks import PendingChecks


@dataclass(frozen=True)
class KvKind:
    """The layers whose KV caches share one block table and one block id space."""

    name: str  # "full" or "sliding"
    table_width: int  # entries of one sequence's block table
    ring: bool  # the table is a ring over logical blocks (sliding layers)
    window: int | None  # sliding window in tokens; None for full attention
    num_blocks: int  # blocks in this kind's pool


@dataclass(frozen=True)
class Sampling:
    """A sequence's sampling parameters, as the device takes them (float32 and int32 lanes);
    request_limits.check_sampling makes them so before any reaches an executor."""

    temperature: float = 0.0  # 0 = greedy; finite, <= float32's largest
    top_k: int = 0  # 0 = no top-k cut; at most the vocabulary size
    top_p: float = 1.0  # in (0, 1]
    seed: int = 0  # 31-bit: [0, 2**31)


@dataclass(frozen=True)
class Penalties:
    """A sequence's logit penalties (request_limits checks them): OpenAI's presence and frequency
    penalties over its generated tokens, after HF's repetition penalty over its prompt and
    generated tokens (a logit divided by it when positive, multiplied when not)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0  # 1: none

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0)


@dataclass(frozen=True, eq=False)
class SampleExtras:
    """What a sequence's next sampling step takes beyond Sampling (executors offering
    `top_logprobs(executor)` > 0 apply it on the device; targets/xla/sampler.py)."""

    top_logprobs: int = -1  # -1: no log-probabilities; 0..K: the token's and the K likeliest
    penalties: Penalties = field(default_factory=Penalties)
    pen_ids: np.ndarray | None = None  # int32 [n <= max_context]: the ids penalties touch
    pen_counts: np.ndarray | None = None  # int32 [n]: times each was generated
    mask: np.ndarray | None = None  # int32 [ceil(vocab / 32)]: bit j of word w allows token
    # 32 w + j; None: every token allowed


@dataclass(frozen=True)
class Sampled:
    """A sampled token with what the sampler says of it (executors with log-probabilities)."""

    token: int
    logprob: float | None = None  # log p(token) under the model (before penalties, mask and
    # temperature); None when not asked for
    top: tuple[tuple[int, float], ...] = ()  # the likeliest (id, logprob), most likely first


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of one executor call."""

    tokens: Sequence[int]  # tokens to run: a prefill chunk, or the one token of a decode lane
    start: int  # the sequence's tokens already in its KV blocks (the first token's position)
    tables: dict[str, Sequence[int]]  # kind name -> block table, table_width ids
    sampling: Sampling = field(default_factory=Sampling)
    step: int = 0  # the RNG step of the token sampled after this chunk: tokens generated so far
    rows: int = 0  # prefill: run padded to this many rows, a prefill bucket (0: smallest fit)
    extras: SampleExtras | None = None  # penalties, mask, log-probabilities; None: none
    draft_probs: object = None  # verify: the Drafted.draft_probs its drafts came with, which
    # it accepts by the ratio rule (at temperature > 0); None: by exact match


@dataclass(frozen=True)
class LoopLane:
    """One sequence's share of a decode_many call."""

    chunk: SeqChunk  # its first step, as for decode: its last token, start, tables, step
    budget: int  # most tokens to sample in this call (its blocks must reach start + budget)
    stop_ids: frozenset[int]  # sampling one of these ends the lane (it is returned)


@dataclass(frozen=True)
class LoadOptions:
    """What `runtime.load` asks of the executor that opens an artifact (its module's
    `open_executor(art, manifest, opts)`), which refuses (ArtifactError) what it cannot do."""

    verify: tuple[str, ...] = ()  # sections to re-hash once the machine fits, before upload
    kv_blocks: dict[str, int] | None = None  # KV pool blocks by kind; None: the artifact's
    # (XLA), or a share of the GPU's memory (h100)
    max_num_seqs: int | None = None  # the engine's caps, refused before any upload or compile
    max_model_len: int | None = None  # when the artifact cannot meet them (check_limits)
    trust_executables: bool = False  # load precompiled XLA executables (signed artifacts only)
    # h100: the share of the GPU's total memory the arena and the KV pools its kinds without
    # kv_blocks may take (None: executors/kv_budget.DEFAULT_UTILIZATION)
    gpu_memory_utilization: float | None = None
    # the load's phases as the person running it sees them (verify, upload, compile, ...)
    phases: Phases = field(default_factory=lambda: Phases("rvrun", "off"))
    # runtime.load's checks still running on their own thread (the text sections): the executor
    # waits for them before it runs anything on the device, and stops early once they failed
    # (pending_checks.py); default: none pending
    checks: PendingChecks = field(default_factory=PendingChecks)
    # what the runtime module's `begin(art)` started when the file opened (runtime.load; h100:
    # the GPU's context, opening on a thread of its own), or None
    begun: Future | None = None


@dataclass(frozen=True)
class LoadTimes:
    """What an executor's load cost, phase by phase (runtime.load adds the open and the checks
    before it: runtime/load_report.py). Seconds of wall time, but read_s and hash_s: busy time
    summed over the threads that streamed the weights, which overlap one another and the
    copies. A phase the executor does not have stays 0."""

    context_s: float = 0.0  # h100: the GPU's context taken (waited for, when it opened
    # alongside the checks) and the GPU checked (check_fits)
    context_open_s: float = 0.0  # h100: the driver's context opening (cuInit, primary context),
    # on a thread of its own from the file's open (runtime.load), or in context_s
    verify_s: float = 0.0  # sections re-hashed before the upload (all but a streamed weights)
    arena_s: float = 0.0  # h100: the arena allocated, zeroed, its constants copied
    upload_s: float = 0.0  # the weights to the device (h100: the streamed, checked read)
    weight_bytes: int = 0  # of the weights section
    streamed: bool = False  # weights read once, each piece hashed as it was uploaded (h100)
    hashed_on: str = ""  # where the weights' pieces were hashed and compared, "cpu" (hashlib:
    # in verify_s or as they streamed) or "gpu" (h100: the artifact's piece hash, gpu_hash_s);
    # "": not checked (--no-verify)
    gpu_hash_s: float = 0.0  # h100, hashed on the GPU: the piece hash's kernel over the
    # uploaded weights, the digests copied back and compared (after the upload, during capture)
    threads: int = 0  # streamed: threads that read and hashed the weights
    read_s: float = 0.0  # streamed: thread-seconds reading the file
    hash_s: float = 0.0  # streamed: thread-seconds hashing
    cubin_load_s: float = 0.0  # h100: modules loaded, launches prepared (during the upload)
    graph_capture_s: float = 0.0  # h100: CUDA graphs captured, instantiated (during the upload)
    warm_up_s: float = 0.0  # h100: graphs uploaded to the device (cuGraphUpload), not run,
    # once the weights and runtime.load's checks passed
    finish_s: float = 0.0  # h100: staging buffers freed, the device synchronized
    checks_during_upload_s: float = 0.0  # h100: of runtime.load's checks alongside (LoadOptions
    # .checks), the seconds that ran while the weights streamed (the rest ran before it)
    programs_s: float = 0.0  # XLA: the exported programs deserialized and checked
    compile_s: float = 0.0  # XLA: programs compiled (or loaded from a cache), or executables
    # checked (sha256, operands) for deserializing on first use
    deferred: tuple[str, ...] = ()  # XLA: the entries whose executables XLA deserializes on
    # their first call, not during the load (checked at load all the same)
    overlapped: tuple[str, ...] = ()  # phases that ran while the weights uploaded

    @property
    def checked(self) -> bool:
        """The weights' sha256 compared (in verify_s, in the stream, or on the GPU after the
        upload)."""
        return self.hashed_on != ""


class DeviceError(RuntimeError):
    """The device can no longer run this executor's programs (a sticky CUDA error, KV pools lost
    in a failed call): every later call would fail too. Any other exception from a call fails
    only the sequences in it; the engine keeps serving."""


@dataclass(frozen=True)
class Verified:
    """One lane's result of a verify call."""

    tokens: list[int]  # the token after each row: tokens[i] follows rows 0..i (by the ratio
    # rule: the accepted drafts, the new token, then -1)
    states: tuple[object, ...]  # per row, opaque: what `draft` starts from after tokens[i]
    # (empty when the executor has no drafter)


@dataclass(frozen=True)
class DraftLane:
    """One sequence's share of a draft call."""

    chunk: SeqChunk  # tokens: [the token to draft after]; start: its position q (the target's
    # cached tokens); tables; sampling; step: the RNG step of the first draft
    state: object  # a Verified.states entry: the target's hidden state before that token


@dataclass(frozen=True)
class Drafted:
    """One lane's result of a draft call."""

    tokens: list[int]  # the n drafted tokens
    logits: object  # float32 [n, vocab] as an array-like (np.asarray copies it to the host): the
    # drafter's logits at each step, kept on the device until asked for (an executor whose
    # device memory the next call reuses, h100's, refuses to read them after that call)
    states: object  # float32 [n, H], likewise: the drafter's projected state after each step
    draft_probs: object = None  # opaque: the distribution each draft was sampled from, for
    # verify's ratio rule (SeqChunk.draft_probs); None: verify checks the drafts by exact match


class Executor(Protocol):
    max_context: int  # longest sequence (prompt + generated) the programs take
    max_chunk: int  # most tokens in one prefill or logits call
    prefill_buckets: tuple[int, ...]  # row counts of the prefill calls, ascending
    max_seqs: int  # most sequences in one decode call
    block_size: int  # tokens per KV block
    kinds: dict[str, KvKind]  # by name
    load_note: str  # one line on what loading cost (compile time, upload), for rvrun's summary
    load_times: LoadTimes  # what loading cost, phase by phase (Model.load_report)

    def prefill(self, chunk: SeqChunk) -> int:
        """Run one chunk of one sequence; return the token sampled after its last token."""
        ...

    def decode(self, lanes: Sequence[SeqChunk]) -> list[int]:
        """Run up to max_seqs sequences, one token each; return each one's next token."""
        ...

    def logits(self, chunk: SeqChunk) -> np.ndarray:
        """Run one chunk of one sequence; return float32 logits [len(tokens), vocab]."""
        ...


class LoopExecutor(Executor, Protocol):
    """An executor that also offers the device-side decode loop."""

    decode_loop_steps: int  # most steps of one decode_many call (0: not offered)
    decode_loop_stops: int  # most stop ids per lane

    def decode_many(self, lanes: Sequence[LoopLane]) -> list[list[int]]:
        """Run up to max_seqs sequences through up to decode_loop_steps decode steps,
        feeding each its sampled token, until every lane sampled a stop id or its budget;
        return each lane's sampled tokens (its stop id included)."""
        ...


class ProgressiveLoopExecutor(LoopExecutor, Protocol):
    """A decode loop that hands its tokens over group by group while the next group runs."""

    loop_progress: bool  # decode_many takes progress and group (the module docstring)

    def decode_many(self, lanes: Sequence[LoopLane],
                    progress: Callable[[list[list[int]]], bool] | None = None,
                    group: int = 0) -> list[list[int]]:
        """LoopExecutor.decode_many, each group of `group` steps' tokens given to progress
        while the next group runs (0: the executor's own group size)."""
        ...


class MaskedLoopExecutor(ProgressiveLoopExecutor, Protocol):
    """A progressive decode loop whose lanes may sample under per-step token masks."""

    masked_loop: bool  # decode_many_masked is offered

    def decode_many_masked(self, lanes: Sequence[LoopLane],
                           masks: Callable[[list[list[int]]], Sequence[np.ndarray | None]],
                           progress: Callable[[list[list[int]]], bool] | None = None
                           ) -> list[list[int]]:
        """decode_many a step at a time, each step's masks from masks(the step before's
        tokens) (the module docstring)."""
        ...


class SamplingExecutor(Executor, Protocol):
    """An executor whose sampler also applies SampleExtras and returns log-probabilities."""

    top_logprobs: int  # K: most top log-probabilities per token (0: extras not offered)

    def prefill_sampled(self, chunk: SeqChunk) -> Sampled:
        """prefill, with chunk.extras applied to its sampling step."""
        ...

    def decode_sampled(self, lanes: Sequence[SeqChunk]) -> list[Sampled]:
        """decode, with each lane's extras applied."""
        ...


class LateMaskExecutor(SamplingExecutor, Protocol):
    """A sampling executor that takes the token masks while the forward pass runs."""

    late_masks: bool  # the two calls below are offered

    def decode_late_masks(self, lanes: Sequence[SeqChunk],
                          masks: Callable[[], Sequence[np.ndarray | None]]) -> list[Sampled]:
        """decode_sampled, each lane's mask masks()[i], asked for once the forward pass runs."""
        ...

    def prefill_late_masks(self, chunk: SeqChunk,
                           masks: Callable[[], Sequence[np.ndarray | None]]) -> Sampled:
        """prefill_sampled, the chunk's mask masks()[0], asked for likewise."""
        ...


def takes_late_masks(executor: Executor) -> bool:
    """Whether the executor offers decode_late_masks and prefill_late_masks."""
    return bool(getattr(executor, "late_masks", False))


def load_pending(executor: Executor) -> list[str]:
    """Load now what the executor left for first use (an XLA executor's executables, each
    deserialized on its first call by default), so a server pays it before it listens rather
    than in its first requests, and an executable XLA cannot load stops the start instead of
    failing requests; the entries loaded (none for executors that defer nothing)."""
    load = getattr(executor, "load_pending", None)
    return load() if load is not None else []


def top_logprobs(executor: Executor) -> int:
    """Top log-probabilities per token the executor's sampler returns; 0 when it takes no
    SampleExtras (no log-probabilities, penalties or masks)."""
    return getattr(executor, "top_logprobs", 0)


class SpeculativeExecutor(Executor, Protocol):
    """An executor that also verifies drafts in one call (and, with a drafter, drafts)."""

    max_draft_tokens: int  # most drafts one verify call checks (0: not offered)
    has_drafter: bool  # draft() is offered: the artifact carries an assistant

    def verify(self, lanes: Sequence[SeqChunk]) -> list[Verified]:
        """Run up to max_seqs sequences, each its last token and 0..max_draft_tokens drafts
        as rows at positions start, start + 1, ...; return each row's next token and state
        (by exact match, or by the ratio rule for lanes with draft_probs)."""
        ...

    def draft(self, lanes: Sequence[DraftLane], n: int) -> list[Drafted]:
        """Up to max_seqs sequences: n (1..max_draft_tokens) assistant drafts each."""
        ...


def max_draft_tokens(executor: Executor) -> int:
    """Drafts one verify call checks; 0 when the executor has no speculative entry points."""
    return getattr(executor, "max_draft_tokens", 0)


def has_drafter(executor: Executor) -> bool:
    """Whether the executor drafts with an assistant (draft())."""
    return bool(getattr(executor, "has_drafter", False))


class PackingExecutor(Executor, Protocol):
    """An executor that runs several sequences' prompt chunks in one prefill call."""

    prefill_packing: object | None  # None: not offered

    def packed_rows(self, chunks: Sequence[SeqChunk]) -> int:
        """Rows a prefill_packed call of these chunks needs; ValueError where they cannot share
        a call (too many, a chunk of a small entry)."""
        ...

    def prefill_packed(self, chunks: Sequence[SeqChunk]) -> list[int]:
        """Run the chunks (of different sequences) in one call; each one's sampled token."""
        ...

    def prefill_packed_sampled(self, chunks: Sequence[SeqChunk]) -> list[Sampled]:
        """prefill_packed, each chunk's extras applied (offered where packs_sampled)."""
        ...


class MixingExecutor(PackingExecutor, Protocol):
    """An executor that runs packed prompt chunks and decode lanes in one call."""

    def mixes(self, chunks: Sequence[SeqChunk], lanes: int) -> bool:
        """Whether one prefill_decode call takes these chunks and that many decode lanes."""
        ...

    def prefill_decode(self, chunks: Sequence[SeqChunk],
                       lanes: Sequence[SeqChunk]) -> tuple[list[int], list[int]]:
        """Run the chunks and the lanes in one call: each chunk's and each lane's token."""
        ...


def packs_sampled(executor: Executor) -> bool:
    """Whether the executor offers prefill_packed_sampled."""
    return bool(getattr(executor, "packs_sampled", False)) and packs_prefill(executor)


def mixes_decode(executor: Executor) -> bool:
    """Whether the executor offers prefill_decode."""
    return callable(getattr(executor, "prefill_decode", None))


def packs_prefill(executor: Executor) -> bool:
    """Whether the executor offers prefill_packed."""
    return getattr(executor, "prefill_packing", None) is not None


def decode_loop_steps(executor: Executor) -> int:
    """Steps per decode_many call the executor offers; 0 when it has no decode loop."""
    return getattr(executor, "decode_loop_steps", 0)


def loop_progress(executor: Executor) -> bool:
    """Whether the executor's decode_many hands its tokens over group by group (progress)."""
    return bool(getattr(executor, "loop_progress", False)) and decode_loop_steps(executor) > 0


def masked_loop(executor: Executor) -> bool:
    """Whether the executor offers decode_many_masked."""
    return bool(getattr(executor, "masked_loop", False)) and loop_progress(executor)
