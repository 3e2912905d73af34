"""Train the assistant (multi-token-prediction drafter) of the embedded default model
(models/rv-gemma4-tiny) with transformers' own Gemma 4 assistant classes, so the result is a
Hugging Face `gemma4_assistant` checkpoint by construction, on the corpus that
examples/tiny_gemma4_corpus.py prepares. The target stays frozen.

    python examples/tiny_gemma4_corpus.py --out .train            # data + tokenizer (CPU, apt)
    python examples/train_tiny_assistant.py --data .train --target models/rv-gemma4-tiny \\
        --out models/rv-gemma4-tiny-assistant                      # CPU, 23 minutes

The drafter (MODEL below, `Gemma4AssistantForCausalLM`): width 128, 4 layers S S S F, 4 query
heads, MLP 512, a dense head tied to its own embedding (8192 x 128, started from the target's
embedding projected on its top 128 principal directions). Its layers have no k/v weights: the
sliding ones read the target's cache of layer 5 (its last non-shared sliding layer: head dim
64, 2 KV heads), the full one the cache of layer 3 (head dim 128, K=V, 1 KV head), so their
cache layouts are the target's.

How a drafter step runs (rvcompile/model/assistant.py, transformers' assisted generation): the
target has cached positions [0, q) and sampled token x_q from its final-normed hidden state
h_(q-1). Step 1 reads concat(target embedding of x_q, h_(q-1)), its query at position q over the
target's keys at [0, q) (sliding: the last W + 1 of them, W = 128), and gives logits for
x_(q+1) and a projected state s_1. Step j > 1 reads concat(embedding of the step j - 1 token,
s_(j-1)), at the same position q over the same keys.

Training (teacher forcing, distillation): windows of SEQ_LEN tokens, BOS + corpus tokens from a
random offset (the form the target was trained on), and, for a `greedy_fraction` of the batches,
BOS + a corpus prompt + the target's own greedy continuation of it (speculative decoding drafts
along the target's greedy path; a pool is generated before training, inside the budget). The
frozen target runs each window once (float32, no grad): logits, final-normed hidden states and
its layer 3 and 5 K/V (transformers' `shared_kv_states`). The drafter then runs `draft_steps`
chained steps for `queries` random query positions q of the window at once (step j's token is
the window's x_(q+j-1), its state step j - 1's output), with masks that let position q see
only keys < q (and, sliding, >= q - W - 1): exactly one assisted-generation step per q
(tests/test_default_assistant.py checks it against Gemma4AssistantForCausalLM.forward at one
position at a time). Step j's loss is
KL(target || drafter) against the target's distribution after x_(q+j-1); the steps' losses are
averaged. AdamW, linear warm-up then cosine, float32 on the CPU, one thread. The run is budgeted
in seconds: after `probe_steps` steps the step time fixes the schedule's length; held-out
metrics (KL and top-1 agreement with the target per step) every `eval_every` steps keep the best
weights. The checkpoint is stored in bfloat16; training_log.json beside it records the data,
seed, hyper-parameters, versions, curves and the final held-out metrics of the stored weights.

transformers 5.23's `Gemma4TextConfig.kv_sharing_modes` refuses a config whose layers are all
KV-shared, i.e. every assistant's; `all_kv_shared_allowed` patches it, while a drafter is built
or loaded, to say "reuse" for each layer (what the assistant means; tests/oracle.py does the
same). `--toy` swaps in a 2-layer drafter, short windows and a short budget, to test the whole
script on a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import (
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
)

S, FULL = "sliding_attention", "full_attention"
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2

# The drafter's decoder. Head dims, KV heads, K=V, window and RoPE are those of the target
# layers it reads (3 and 5); width, depth, query heads and MLP are its own.
MODEL = {
    "model_type": "gemma4_text",
    "vocab_size": 8192,
    "vocab_size_per_layer_input": 0,
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "layer_types": [S, S, S, FULL],
    "num_kv_shared_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "global_head_dim": 128,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "use_double_wide_mlp": False,
    "hidden_size_per_layer_input": 0,
    "enable_moe_block": False,
    "sliding_window": 128,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "final_logit_softcapping": None,
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_parameters": {
        S: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
               "rope_theta": 1_000_000.0},
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}
TOY_MODEL = {**MODEL, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "layer_types": [S, FULL], "num_kv_shared_layers": 2}


@dataclass(frozen=True)
class HParams:
    seed: int = 0
    batch: int = 8  # windows per step
    seq_len: int = 256  # tokens per window, BOS included
    draft_steps: int = 4  # chained drafter steps trained per query position
    queries: int = 64  # query positions per window trained at each step (drawn at random)
    greedy_fraction: float = 0.5  # share of batches drawn from the target's greedy continuations
    greedy_pool: int = 96  # greedy windows generated before training (inside the budget)
    greedy_prompt: int = 64  # corpus tokens (after BOS) each greedy continuation starts from
    peak_lr: float = 2e-3
    final_lr_fraction: float = 0.05  # the cosine ends at peak_lr * this
    warmup_steps: int = 30
    weight_decay: float = 0.01  # on matrices and embeddings, not on norm weights
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    train_seconds: float = 1320.0  # optimizer steps stop here; evaluation and saving come after
    probe_steps: int = 20  # steps timed to fix the schedule's length (the first 5 not counted)
    eval_every: int = 100
    eval_windows: int = 32  # held-out windows scored at each evaluation
    threads: int = 1  # torch CPU threads (the machine is shared)
    # q_norm weights start at head_dim**-0.25, as the target's did (Gemma 4 uses no 1/sqrt(d)).
    qk_norm_init: str = "head_dim**-0.25"
    embed_init: str = "target embedding on its top principal directions"

    def __post_init__(self) -> None:
        if not 5 < self.probe_steps <= self.warmup_steps:
            raise ValueError("need 5 < probe_steps <= warmup_steps (the schedule's length is "
                             "fixed by the probe, which must end inside the warm-up)")
        if not 0 <= self.greedy_fraction <= 1:
            raise ValueError("greedy_fraction must be in [0, 1]")
        if not 0 < self.greedy_prompt < self.seq_len - self.draft_steps:
            raise ValueError("greedy_prompt must leave room for a continuation in seq_len")


TOY_HPARAMS = HParams(batch=2, seq_len=48, draft_steps=3, queries=16, greedy_pool=4,
                      greedy_prompt=16, warmup_steps=8, train_seconds=15.0, probe_steps=6,
                      eval_every=5, eval_windows=4)


@contextlib.contextmanager
def all_kv_shared_allowed() -> Iterator[None]:
    """transformers 5.23's Gemma4TextConfig.kv_sharing_modes raises for a config whose layers
    are all KV-shared (every assistant); while inside, it says "reuse" for each layer."""
    original = Gemma4TextConfig.kv_sharing_modes

    def modes(self):
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return original.fget(self)

    Gemma4TextConfig.kv_sharing_modes = property(modes)
    try:
        yield
    finally:
        Gemma4TextConfig.kv_sharing_modes = original


def load_target(path: Path) -> Gemma4ForCausalLM:
    """The frozen target, float32, eval mode, SDPA attention."""
    model = Gemma4ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    return model


def shared_kv_layers(target: Gemma4ForCausalLM) -> dict[str, int]:
    """The target layer each drafter layer kind reads: its last non-shared layer of the kind."""
    cfg = target.config
    first_shared = cfg.num_hidden_layers - cfg.num_kv_shared_layers
    return {cfg.layer_types[i]: i for i in range(first_shared)}


def build_assistant(config_kwargs: dict, target: Gemma4ForCausalLM) -> Gemma4AssistantForCausalLM:
    """A float32 drafter: transformers' initialisation, q_norm at head_dim**-0.25, and the
    tied embedding / head started from the target's embedding on its top principal
    directions (so tokens the target's head tells apart start apart)."""
    cfg = Gemma4AssistantConfig(text_config=copy.deepcopy(config_kwargs),
                                backbone_hidden_size=target.config.hidden_size,
                                use_ordered_embeddings=False, tie_word_embeddings=True)
    cfg.text_config._attn_implementation = "sdpa"
    with all_kv_shared_allowed():
        model = Gemma4AssistantForCausalLM(cfg)
    d = config_kwargs["hidden_size"]
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(".q_norm"):
                module.weight.fill_(module.weight.numel() ** -0.25)
        table = target.model.embed_tokens.weight.float()
        centred = table - table.mean(0, keepdim=True)
        _, _, vh = torch.linalg.svd(centred, full_matrices=False)
        model.model.embed_tokens.weight.copy_(table @ vh[:d].T)
    return model.float()


@dataclass(frozen=True)
class Teacher:
    """What the frozen target gives for a batch of windows [B, T]."""

    log_probs: torch.Tensor  # [B, T, V] float32: the target's next-token log-probabilities
    hidden: torch.Tensor  # [B, T, H]: final-normed hidden states (the drafter's first state)
    embeds: torch.Tensor  # [B, T, H]: the target's scaled embeddings of the window's tokens
    shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]]  # kind -> (K, V) [B, KVh, T, D]


@torch.no_grad()
def teacher(target: Gemma4ForCausalLM, inputs: torch.Tensor) -> Teacher:
    out = target.model(input_ids=inputs, use_cache=False, return_shared_kv_states=True)
    logits = target.lm_head(out.last_hidden_state)
    cap = target.config.final_logit_softcapping
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    kv = {kind: out.shared_kv_states[kind] for kind in shared_kv_layers(target)}
    return Teacher(F.log_softmax(logits.float(), -1), out.last_hidden_state,
                   target.get_input_embeddings()(inputs), kv)


def draft_masks(queries: torch.Tensor, seq_len: int, window: int) -> dict[str, torch.Tensor]:
    """Boolean masks [1, 1, Q, T] (True: attend) for queries at positions `queries` [Q] over the
    target's keys 0..T-1: query q sees keys k < q, and on sliding layers only the last
    window + 1 of them (k >= q - window - 1), as one assisted-generation step at q does
    (rvcompile/ir/draft_frontend.py)."""
    q = queries[:, None]
    k = torch.arange(seq_len)[None, :]
    full = k < q
    sliding = full & (k >= q - window - 1)
    return {FULL: full[None, None], S: sliding[None, None]}


def draft_step(assistant: Gemma4AssistantForCausalLM, x: torch.Tensor, positions: torch.Tensor,
               masks: dict[str, torch.Tensor], kv: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One drafter step for Q query rows at once: x [B, Q, 2H] -> (logits [B, Q, V], the next
    state [B, Q, H]). Gemma4AssistantForCausalLM.forward, but with the given per-row masks
    (its own builds masks for one query position)."""
    h = assistant.pre_projection(x)
    # logits_to_keep=None: transformers 5.23 slices a multi-row input to `logits_to_keep` rows
    # before KV-shared layers and then fails on the absent per-layer inputs; only an integer
    # asks for that.
    h = assistant.model(inputs_embeds=h, attention_mask=masks, position_ids=positions,
                        shared_kv_states=dict(kv), use_cache=False,
                        logits_to_keep=None).last_hidden_state
    return assistant.lm_head(h), assistant.post_projection(h)


def unrolled(assistant, t: Teacher, queries: torch.Tensor, window: int,
             steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For the query positions `queries` [Q] (each in 1..T-steps), steps j = 1..steps of the
    chain: (drafter log-probs [B, Q, V], the target's log-probs after x_(q+j-1) [B, Q, V])."""
    b, n = t.hidden.shape[:2]
    masks = draft_masks(queries, n, window)
    positions = queries.expand(b, -1)
    state = t.hidden[:, queries - 1]  # h_(q-1)
    out = []
    for j in range(1, steps + 1):
        rows = queries + j - 1  # step j reads x_(q+j-1) and predicts what follows it
        x = torch.cat([t.embeds[:, rows], state], dim=-1)
        logits, state = draft_step(assistant, x, positions, masks, t.shared_kv)
        out.append((F.log_softmax(logits.float(), -1), t.log_probs[:, rows]))
    return out


def kl_loss(pairs) -> tuple[torch.Tensor, list[float], list[float]]:
    """Mean over steps of KL(target || drafter); per step KL and top-1 agreement."""
    losses, kls, agree = [], [], []
    for student, target in pairs:
        kl = (target.exp() * (target - student)).sum(-1).mean()
        losses.append(kl)
        kls.append(kl.item())
        agree.append((student.argmax(-1) == target.argmax(-1)).float().mean().item())
    return torch.stack(losses).mean(), kls, agree


def lr_at(step: int, total: int | None, hp: HParams) -> float:
    """Linear warm-up, then cosine from peak_lr to peak_lr * final_lr_fraction over `total`
    steps (unknown, None, only during the probe, which ends inside the warm-up)."""
    if step < hp.warmup_steps:
        return hp.peak_lr * (step + 1) / hp.warmup_steps
    assert total is not None, "the probe must end inside the warm-up"
    t = min(1.0, (step - hp.warmup_steps) / max(1, total - hp.warmup_steps))
    lo = hp.peak_lr * hp.final_lr_fraction
    return lo + 0.5 * (hp.peak_lr - lo) * (1 + math.cos(math.pi * t))


def windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, seq_len]: BOS + tokens[s : s + seq_len - 1] for each start s."""
    idx = starts[:, None] + torch.arange(seq_len - 1)[None, :]
    return torch.cat([torch.full((len(starts), 1), BOS_ID), tokens[idx]], dim=1)


@torch.no_grad()
def greedy_pool(target, tokens: torch.Tensor, hp: HParams, gen: torch.Generator,
                log) -> torch.Tensor:
    """[greedy_pool, seq_len]: BOS + greedy_prompt corpus tokens + the target's greedy
    continuation (EOS allowed: it is what the target would do)."""
    out = []
    chunk = 32
    starts = torch.randint(0, tokens.numel() - hp.seq_len, (hp.greedy_pool,), generator=gen)
    for s in starts.split(chunk):
        prompts = windows(tokens, s, hp.greedy_prompt + 1)
        seqs = target.generate(prompts, attention_mask=torch.ones_like(prompts),
                               do_sample=False, max_new_tokens=hp.seq_len - prompts.shape[1],
                               min_new_tokens=hp.seq_len - prompts.shape[1],
                               pad_token_id=PAD_ID, eos_token_id=None)
        out.append(seqs[:, :hp.seq_len])
        log(f"greedy pool: {sum(len(o) for o in out)}/{hp.greedy_pool}")
    return torch.cat(out)


def parameter_groups(model, weight_decay: float):
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0}]


@torch.no_grad()
def evaluate(assistant, target, heldout: torch.Tensor, hp: HParams) -> dict:
    """Held-out metrics over `eval_windows` non-overlapping windows: per drafter step, the mean
    KL(target || drafter) and the share of positions whose argmax is the target's."""
    assistant.eval()
    n = min(hp.eval_windows, (heldout.numel() - 1) // hp.seq_len)
    starts = torch.arange(n) * hp.seq_len
    kls = np.zeros(hp.draft_steps)
    agree = np.zeros(hp.draft_steps)
    queries = torch.arange(1, hp.seq_len - hp.draft_steps + 1)  # every one
    for chunk in starts.split(hp.batch):
        t = teacher(target, windows(heldout, chunk, hp.seq_len))
        _, k, a = kl_loss(unrolled(assistant, t, queries, target.config.sliding_window,
                                   hp.draft_steps))
        kls += np.array(k) * len(chunk)
        agree += np.array(a) * len(chunk)
    assistant.train()
    return {"kl": [round(float(x) / n, 4) for x in kls],
            "top1_agreement": [round(float(x) / n, 4) for x in agree],
            "mean_kl": round(float(kls.sum()) / n / hp.draft_steps, 4)}


def train(assistant, target, train_tokens, heldout, hp: HParams, log) -> dict:
    """Runs the budgeted loop; returns the record (curves, timings) with the best weights under
    'best_state'."""
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(hp.seed)
    window = target.config.sliding_window
    pool = greedy_pool(target, train_tokens, hp, gen, log) if hp.greedy_fraction else None
    rec = {"greedy_pool_seconds": round(time.perf_counter() - t0, 1), "train_curve": [],
           "heldout_curve": [], "total_steps": None}
    opt = torch.optim.AdamW(parameter_groups(assistant, hp.weight_decay), lr=hp.peak_lr,
                            betas=(hp.beta1, hp.beta2))
    max_start = train_tokens.numel() - hp.seq_len
    best = (math.inf, -1, None)
    total = None
    probe_t0 = None
    step = 0
    assistant.train()
    while True:
        if time.perf_counter() - t0 >= hp.train_seconds or (total is not None and step >= total):
            break
        if step == 5:
            probe_t0 = time.perf_counter()
        if step == hp.probe_steps:
            step_s = (time.perf_counter() - probe_t0) / (hp.probe_steps - 5)
            eval_t0 = time.perf_counter()
            val = evaluate(assistant, target, heldout, hp)
            eval_s = time.perf_counter() - eval_t0
            rec["heldout_curve"].append({"step": step, **val})
            left = hp.train_seconds - (time.perf_counter() - t0)
            total = max(step, step + int(left / (step_s + eval_s / hp.eval_every)))
            rec.update(total_steps=total, probe_step_s=round(step_s, 4), eval_s=round(eval_s, 2))
            log(f"step {step_s:.2f} s, held-out evaluation {eval_s:.1f} s (KL {val['kl']}) -> "
                f"schedule of {total} steps")
        lr = lr_at(step, total, hp)
        for g in opt.param_groups:
            g["lr"] = lr
        greedy = pool is not None and torch.rand((), generator=gen).item() < hp.greedy_fraction
        if greedy:
            inputs = pool[torch.randint(0, len(pool), (hp.batch,), generator=gen)]
        else:
            inputs = windows(train_tokens,
                             torch.randint(0, max_start + 1, (hp.batch,), generator=gen),
                             hp.seq_len)
        # a random subset of query positions: the drafter's rows cost more than the target's
        queries = torch.randperm(hp.seq_len - hp.draft_steps, generator=gen)[:hp.queries] + 1
        loss, kls, agree = kl_loss(unrolled(assistant, teacher(target, inputs),
                                            queries.sort().values, window, hp.draft_steps))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(assistant.parameters(), hp.grad_clip)
        opt.step()
        step += 1
        if step % 10 == 0 or step == 1:
            rec["train_curve"].append({
                "step": step, "seconds": round(time.perf_counter() - t0, 1), "lr": lr,
                "greedy_batch": greedy, "loss": round(loss.item(), 4),
                "top1_agreement": [round(a, 3) for a in agree],
                "grad_norm": round(grad_norm.item(), 3)})
        if step % hp.eval_every == 0:
            val = evaluate(assistant, target, heldout, hp)
            rec["heldout_curve"].append({"step": step, **val})
            log(f"step {step} {time.perf_counter() - t0:.0f} s lr {lr:.2e} train "
                f"{loss.item():.3f} held-out KL {val['kl']} top-1 {val['top1_agreement']}")
            if val["mean_kl"] < best[0]:
                best = (val["mean_kl"], step, copy.deepcopy(assistant.state_dict()))
    rec["steps"] = step
    rec["train_seconds"] = round(time.perf_counter() - t0, 1)
    val = evaluate(assistant, target, heldout, hp)
    rec["heldout_curve"].append({"step": step, **val})
    if val["mean_kl"] < best[0]:
        best = (val["mean_kl"], step, copy.deepcopy(assistant.state_dict()))
    rec["best_heldout_mean_kl"], rec["best_step"], rec["best_state"] = best
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="tiny_gemma4_corpus.py's --out")
    p.add_argument("--target", type=Path, required=True, help="the target's model directory")
    p.add_argument("--out", type=Path, required=True, help="assistant directory to write")
    p.add_argument("--train-seconds", type=float, default=None)
    p.add_argument("--toy", action="store_true", help="tiny drafter and budget (CPU test)")
    a = p.parse_args(argv)
    hp = TOY_HPARAMS if a.toy else HParams()
    if a.train_seconds is not None:
        hp = HParams(**{**asdict(hp), "train_seconds": a.train_seconds})
    config_kwargs = TOY_MODEL if a.toy else MODEL
    torch.set_num_threads(hp.threads)
    torch.manual_seed(hp.seed)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def log(msg: str) -> None:
        print(f"[train] {msg}", flush=True)

    corpus = json.loads((a.data / "corpus.json").read_text())
    train_tokens = torch.from_numpy(np.load(a.data / "train.npy").astype(np.int64))
    heldout = torch.from_numpy(np.load(a.data / "heldout.npy").astype(np.int64))
    target = load_target(a.target)
    if int(train_tokens.max()) >= target.config.vocab_size:
        raise SystemExit(f"{a.data}/train.npy: token ids exceed the target's vocabulary")
    if config_kwargs["vocab_size"] != target.config.vocab_size:
        raise SystemExit(f"{a.target}: vocab_size {target.config.vocab_size} is not the "
                         f"drafter's {config_kwargs['vocab_size']}")
    assistant = build_assistant(config_kwargs, target)
    n_params = sum(p.numel() for p in assistant.parameters())
    log(f"drafter {n_params / 1e6:.2f}M parameters; target {a.target} reads layers "
        f"{shared_kv_layers(target)}; {train_tokens.numel():,} train tokens")

    rec = train(assistant, target, train_tokens, heldout, hp, log)
    assistant.load_state_dict(rec.pop("best_state"))
    with torch.no_grad():  # round to the stored bf16
        for param in assistant.parameters():
            param.copy_(param.to(torch.bfloat16))
    stored = evaluate(assistant, target, heldout, hp)
    log(f"best step {rec['best_step']}: stored bf16 weights held-out KL {stored['kl']} top-1 "
        f"{stored['top1_agreement']}")

    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    assistant.to(torch.bfloat16).save_pretrained(out)
    tokens_seen = rec["steps"] * hp.batch * hp.seq_len
    record = {
        "started_utc": started,
        "script": "examples/train_tiny_assistant.py" + (" --toy" if a.toy else ""),
        "target": str(a.target),
        "seed": hp.seed,
        "hparams": asdict(hp),
        "model": config_kwargs,
        "parameters": n_params,
        "device": f"CPU ({platform.processor() or platform.machine()}), "
                  f"{torch.get_num_threads()} thread(s)",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "data": corpus,
        "tokens_seen": tokens_seen,
        **rec,
        "stored_dtype": "bfloat16",
        "stored_heldout": stored,
    }
    (out / "training_log.json").write_text(json.dumps(record, indent=1) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
