"""The assistant drafter against transformers' Gemma4AssistantForCausalLM (the oracle), float32.

A tiny drafter (tests/oracle.py: 3 layers S S F of width 32) is saved by transformers, read by
rvcompile's loader and run on the target's KV caches:
- on the IR's numpy references (ir.interpret.ReferenceModel), the target prefilled by rvcompile:
  the target's final-normed hidden state, then three chained draft steps (each fed its own
  previous token and state) give transformers' logits and projected states within 1e-4, with
  the query before and past the sliding window (8), for a 31B-like target (K=V full layers)
  with a dense head and an E2B-like one (KV sharing, one KV head) with the centroid-masked head,
  and a 12B-like gemma4_unified_assistant (Gemma4UnifiedAssistantForCausalLM) on the K=V target;
- through an xla-f32 artifact built with an assistant and the XLA executor (runtime side): the
  state verify returns and three draft steps from it equal transformers' within 1e-4 past the
  window; greedy speculative decoding (verify of K drafts, accepting the longest matching
  prefix; a sequence without drafts riding in the same calls) gives exactly transformers'
  greedy tokens; and a draft made after a verify that rejected drafts (their KV rows left
  behind in the caches, past the sliding window) equals the IR reference's on caches that
  never held them.
transformers is driven as the issue says: its assisted `generate` needs a target with KV sharing
and per-layer inputs, so the assistant's `forward` is called on `shared_kv_states` built from the
target's last non-shared sliding and full layers (oracle.oracle_target_states).
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle import (
    make_oracle_assistant,
    oracle_draft,
    oracle_greedy,
    oracle_target_states,
    random_token_ids,
    save_oracle_assistant,
)

from rvcompile import runtime
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.ir.draft_frontend import add_assistant
from rvcompile.ir.frontend import build_model_ir
from rvcompile.ir.interpret import ReferenceModel
from rvcompile.passes.weight_math import encode
from rvcompile.runtime.executor_api import DraftLane, SeqChunk
from rvcompile.runtime.executors.xla import XlaExecutor
from rvcompile.sources.checkpoint import load_assistant_source, load_model_source

# (target oracle case, centroid-masked head): 31B-like K=V + dense head; E2B-like + centroids.
CASES = [("k_eq_v", False), ("kv_shared", True)]
# The IR also against the 12B's kind, gemma4_unified_assistant, on the K=V target.
IR_CASES = [(*c, False) for c in CASES] + [("k_eq_v", False, True)]
MAX_CONTEXT, CHUNK = 64, 32
POSITIONS = (6, 21)  # the drafted token's position: inside, and past, the sliding window 8
STEPS = 3
F32_BOUND = 1e-4


@pytest.fixture(scope="module")
def pair(oracle_dir, tmp_path_factory):
    """(case, ordered) -> (hf target, hf assistant, target source, assistant source)."""
    cache = {}

    def get(case: str, ordered: bool, unified: bool = False):
        key = (case, ordered, unified)
        if key not in cache:
            target, ckpt = oracle_dir(case)
            hf = make_oracle_assistant(case, seed=5, ordered=ordered, unified=unified)
            adir = save_oracle_assistant(hf, tmp_path_factory.mktemp(f"assistant-{case}"))
            source = load_model_source(str(ckpt))
            asrc = load_assistant_source(str(adir), source.config)
            assert asrc.config.model_type == ("gemma4_unified_assistant" if unified
                                              else "gemma4_assistant")
            cache[key] = (target, hf, source, asrc, ckpt, adir)
        return cache[key][:4]

    get.dirs = lambda case, ordered: cache[(case, ordered, False)][4:]
    return get


def reference(source, asrc) -> ReferenceModel:
    ir = add_assistant(build_model_ir(source.config, max_context=MAX_CONTEXT, max_chunk=CHUNK),
                       asrc.config)
    tensors = {t.name: t.load() for t in (*source.tensors, *asrc.tensors)}
    return ReferenceModel(ir, {p.name: encode(p.derive, tensors[p.source]) for p in ir.params})


def close(ours: np.ndarray, ref: np.ndarray, what: str) -> float:
    err = float(np.abs(ours - ref).max())
    assert err <= F32_BOUND, f"{what}: max abs {err:.3g}"
    return err


@pytest.mark.parametrize("case,ordered,unified", IR_CASES)
@pytest.mark.parametrize("position", POSITIONS)
def test_ir_draft_steps_match_oracle(pair, case, ordered, unified, position):
    target, hf, source, asrc = pair(case, ordered, unified)
    ids = random_token_ids(position + 1, seed=31 + position)
    ref = reference(source, asrc)
    tokens = np.zeros((1, CHUNK), np.int32)
    tokens[0, :position] = ids[:position]
    _, ours_hidden = ref.step(tokens, np.array([0]), np.array([position]), hidden=True)
    hf_hidden, shared_kv = oracle_target_states(target, ids[:position])
    worst = close(ours_hidden[0, :position], hf_hidden, "target hidden state")
    hf_tok = ours_tok = int(ids[position])
    hf_state, ours_state = hf_hidden[-1], ours_hidden[0, position - 1]
    for step in range(STEPS):
        hf_logits, hf_state = oracle_draft(hf, target, shared_kv, position, hf_tok, hf_state)
        logits, state = ref.draft(np.array([ours_tok]), ours_state[None], np.array([position]))
        worst = max(worst, close(logits[0], hf_logits, f"step {step} logits"),
                    close(state[0], hf_state, f"step {step} state"))
        hf_tok, ours_tok = int(hf_logits.argmax()), int(logits[0].argmax())
        assert ours_tok == hf_tok, f"step {step}"
        ours_state = state[0]
    if ordered:  # the masked head scored exactly top_k clusters' tokens
        scored = (hf_logits > hf_logits.min()).sum()
        assert scored == asrc.config.centroid_intermediate_top_k * asrc.config.tokens_per_centroid
    print(f"\n[measured] {asrc.config.model_type} {case} ordered={ordered} p={position}: "
          f"max abs {worst:.3g}")


# ---------------------------------------------------------------------------------------------
# The xla-f32 artifact and the XLA executor

K = 3  # drafts per verify
BUCKETS = (16,)  # K + 2 <= 16; one prefill size keeps compile time down
SLOTS = 2


@pytest.fixture(scope="module")
def executor(pair, tmp_path_factory):
    """(case, ordered) -> an XlaExecutor of the pair's xla-f32 artifact (built once)."""
    cache = {}

    def get(case: str, ordered: bool) -> XlaExecutor:
        if (case, ordered) not in cache:
            pair(case, ordered)
            ckpt, adir = pair.dirs(case, ordered)
            out = tmp_path_factory.mktemp(f"spec-{case}") / "spec.rvp"
            opts = BuildOptions("xla-f32", max_context=MAX_CONTEXT, prefill_buckets=BUCKETS,
                                max_seqs=SLOTS, platforms=("cpu",), draft_tokens=K)
            build_artifact(str(ckpt), out, opts, assistant=str(adir), progress=False,
                           log=lambda s: None)
            cache[(case, ordered)] = runtime.load(out).executor
        return cache[(case, ordered)]

    return get


def tables(ex: XlaExecutor, slot: int) -> dict[str, list[int]]:
    """Slot `slot`'s own blocks: the default pools hold a whole sequence per slot."""
    return {k.name: list(range(slot * k.table_width, (slot + 1) * k.table_width))
            for k in ex.kinds.values()}


def prefill(ex: XlaExecutor, ids, slot: int) -> int:
    """Prefill ids in 16-row chunks; the token sampled after them."""
    for s in range(0, len(ids), BUCKETS[-1]):
        tok = ex.prefill(SeqChunk(list(ids[s:s + BUCKETS[-1]]), s, tables(ex, slot)))
    return tok


@pytest.mark.parametrize("case,ordered", CASES)
def test_xla_draft_matches_oracle(pair, executor, case, ordered):
    target, hf, _, _ = pair(case, ordered)
    ex = executor(case, ordered)
    p = POSITIONS[-1]
    ids = random_token_ids(p + 1, seed=71)
    prefill(ex, ids[:p], 0)
    verified = ex.verify([SeqChunk([int(ids[p])], p, tables(ex, 0), step=0)])[0]
    hf_hidden, shared_kv = oracle_target_states(target, ids)
    state = verified.states[0]
    worst = close(np.asarray(state.rows[state.lane, state.row]), hf_hidden[p], "verify state")
    tok = verified.tokens[0]
    assert tok == int(np.argmax(hf_hidden[p] @ target.model.embed_tokens.weight.detach().numpy().T))
    drafted = ex.draft([DraftLane(SeqChunk([tok], p + 1, tables(ex, 0), step=1), state)], K)[0]
    hf_tok, hf_state = tok, hf_hidden[p]
    for i in range(K):
        hf_logits, hf_state = oracle_draft(hf, target, shared_kv, p + 1, hf_tok, hf_state)
        worst = max(worst, close(np.asarray(drafted.logits[i]), hf_logits, f"draft {i} logits"),
                    close(np.asarray(drafted.states[i]), hf_state, f"draft {i} state"))
        hf_tok = int(hf_logits.argmax())
        assert drafted.tokens[i] == hf_tok, f"draft {i}"
    print(f"\n[measured] xla {case} ordered={ordered}: max abs {worst:.3g}")


def speculative_greedy(ex: XlaExecutor, prompt, n_new: int, propose):
    """Greedy speculative decoding of `prompt` on slot 0, the same prompt riding along without
    drafts on slot 1 in the same verify calls. `propose(tokens so far, position q of the last,
    its state)` gives the drafts of a round. Returns (speculative tokens, plain tokens,
    [(drafts, accepted, position, token, state) after each verify])."""
    n = len(prompt)
    spec, plain = [prefill(ex, prompt, 0)], [prefill(ex, prompt, 1)]
    state, log = None, []
    while len(spec) < n_new or len(plain) < n_new:
        q = n + len(spec) - 1  # position of the last accepted token
        drafts = propose(spec, q, state)
        lanes = [SeqChunk([spec[-1], *drafts], q, tables(ex, 0), step=len(spec)),
                 SeqChunk([plain[-1]], n + len(plain) - 1, tables(ex, 1), step=len(plain))]
        mine, other = ex.verify(lanes)
        m = 0
        while m < len(drafts) and drafts[m] == mine.tokens[m]:
            m += 1
        spec += [*drafts[:m], mine.tokens[m]]
        plain.append(other.tokens[0])
        state = mine.states[m]
        log.append((drafts, m, q + m + 1, mine.tokens[m], state))
    return spec[:n_new], plain[:n_new], log


PROMPT, N_NEW = 12, 30  # 42 positions: past the window 8 and the 16-row chunk


@pytest.mark.parametrize("case,ordered", CASES)
def test_greedy_speculation_with_the_assistant(pair, executor, case, ordered):
    target = pair(case, ordered)[0]
    ex = executor(case, ordered)
    prompt = random_token_ids(PROMPT, seed=72)

    def assistant(spec, q, state):
        if state is None:  # just prefilled: a plain step first yields a state
            return []
        lane = DraftLane(SeqChunk([spec[-1]], q, tables(ex, 0), step=len(spec)), state)
        return ex.draft([lane], K)[0].tokens

    spec, plain, log = speculative_greedy(ex, prompt, N_NEW, assistant)
    want = oracle_greedy(target, prompt, N_NEW)
    assert plain == want and spec == want
    print(f"\n[measured] {case}: {N_NEW} tokens in {len(log)} verify calls, "
          f"{sum(e[1] for e in log)} drafts accepted (random drafter)")


@pytest.mark.parametrize("case,ordered", CASES)
def test_greedy_verify_accepts_exactly_the_matching_drafts(pair, executor, case, ordered):
    """Drafts whose first c are the target's greedy tokens (c = 0..K by turns) and the rest
    wrong: every round accepts exactly c, the tokens are transformers' greedy ones, and a draft
    from a state after a partial rejection (KV rows of rejected drafts left behind) past the
    window equals the IR reference's on caches that never held those rows."""
    target, _, source, asrc = pair(case, ordered)
    ex = executor(case, ordered)
    prompt = random_token_ids(PROMPT, seed=73)
    want = oracle_greedy(target, prompt, N_NEW + K + 1)
    vocab = source.config.vocab_size

    rounds = []

    def known(spec, q, state):
        c = len(rounds) % (K + 1)
        rounds.append(c)
        nxt = want[len(spec):len(spec) + K]
        return [*nxt[:c], *[(t + 1) % vocab for t in nxt[c:]]]

    spec, plain, log = speculative_greedy(ex, prompt, N_NEW, known)
    assert plain == want[:N_NEW] and spec == want[:N_NEW]
    for drafts, m, *_ in log:
        c = next((i for i, d in enumerate(drafts) if d not in want), len(drafts))
        assert m == min(c, len(drafts))
    assert {m for _, m, *_ in log} == set(range(K + 1))
    drafts, m, q, tok, state = next(e for e in log if 0 < e[1] < K and e[2] > 20)
    ref = reference(source, asrc)
    seq = [*prompt, *spec][:q]
    for s in range(0, q, CHUNK):
        piece = seq[s:s + CHUNK]
        tokens = np.zeros((1, CHUNK), np.int32)
        tokens[0, :len(piece)] = piece
        ref.step(tokens, np.array([s]), np.array([len(piece)]))
    drafted = ex.draft([DraftLane(SeqChunk([tok], q, tables(ex, 0), step=0), state)], K)[0]
    ours = np.asarray(state.rows[state.lane, state.row])[None]
    t = np.array([tok])
    for i in range(K):
        logits, ours = ref.draft(t, ours, np.array([q]))
        close(np.asarray(drafted.logits[i]), logits[0], f"draft {i} after {K - m} rejections")
        t = logits.argmax(-1)
