"""Train the embedded default model, a ~10M-parameter Gemma 4, with transformers' own Gemma 4
classes (so the result is a Hugging Face checkpoint by construction) on the corpus that
examples/tiny_gemma4_corpus.py prepares.

    python examples/tiny_gemma4_corpus.py --out .train            # data + tokenizer (CPU, apt)
    python examples/train_tiny_gemma4.py --data .train --out models/rv-gemma4-tiny   # GPU

The model (MODEL below): 8 layers S S S F S S S F (sliding window 128), 4 query heads, sliding
head dim 64 with 2 KV heads, full head dim 128 with K=V and 1 KV head (the released 256/512
split, halved twice), per-layer embeddings (P = 8), the last two layers KV-shared (they read
layers 5 and 3) with a double-wide MLP, tied embeddings, final logit softcap 30.

Training: windows of SEQ_LEN tokens, each BOS followed by SEQ_LEN - 1 corpus tokens from a
random offset (the form `rvrun ppl` scores), AdamW, linear warm-up then cosine decay, bf16
autocast over float32 weights. The run is budgeted in seconds and epochs: after `probe_steps`
steps the step time fixes the schedule's length (at most `max_epochs` passes over the corpus);
the loop also stops at the deadline. The held-out loss is
measured every `eval_every` steps and the best weights are kept. The checkpoint is stored in
bfloat16 (two safetensors shards and an index); training_log.json beside it records the data
(corpus.json), seed, hyper-parameters, versions, device, the loss curves and the final held-out
loss of the stored bf16 weights.

`--toy` swaps in a 2-layer model and a short budget, to test the whole script on a CPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

S, FULL = "sliding_attention", "full_attention"
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2

MODEL = {
    "vocab_size": 8192,
    "vocab_size_per_layer_input": 8192,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 8,
    "layer_types": [S, S, S, FULL, S, S, S, FULL],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "global_head_dim": 128,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "num_kv_shared_layers": 2,
    "use_double_wide_mlp": True,
    "hidden_size_per_layer_input": 8,
    "enable_moe_block": False,
    "sliding_window": 128,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "final_logit_softcapping": 30.0,
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
# For --toy: the same features (K=V, PLE, KV sharing) at the smallest size.
TOY_MODEL = {**MODEL, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
             "layer_types": [S, FULL, FULL], "num_kv_shared_layers": 1}


@dataclass(frozen=True)
class HParams:
    seed: int = 0
    batch: int = 64  # windows per step
    seq_len: int = 512  # tokens per window, BOS included
    peak_lr: float = 3e-3
    final_lr_fraction: float = 0.05  # the cosine ends at peak_lr * this
    warmup_steps: int = 150
    weight_decay: float = 0.1  # on matrices and embeddings, not on norm weights
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    train_seconds: float = 330.0  # optimizer steps stop here; evaluation and saving come after
    max_epochs: float = 16.0  # the schedule is also capped at this many passes over the corpus
    probe_steps: int = 40  # steps timed to fix the schedule's length (the first 5 not counted)
    eval_every: int = 150
    # q_norm / k_norm weights start at head_dim**-0.25, so q.k (Gemma 4 uses no 1/sqrt(d)) starts
    # at the usual 1/sqrt(d) scale; transformers initialises them to 1.
    qk_norm_init: str = "head_dim**-0.25"

    def __post_init__(self) -> None:
        if not 5 < self.probe_steps <= self.warmup_steps:
            raise ValueError("need 5 < probe_steps <= warmup_steps (the schedule's length is "
                             "fixed by the probe, which must end inside the warm-up)")


TOY_HPARAMS = HParams(batch=4, seq_len=64, warmup_steps=10, train_seconds=20.0, probe_steps=8,
                      eval_every=10)


def build_model(config_kwargs: dict) -> Gemma4ForCausalLM:
    model = Gemma4ForCausalLM(Gemma4TextConfig(**copy.deepcopy(config_kwargs),
                                               attn_implementation="sdpa"))
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith((".q_norm", ".k_norm")):
                module.weight.fill_(module.weight.numel() ** -0.25)
    return model.float()


def lr_at(step: int, total: int | None, hp: HParams) -> float:
    """Linear warm-up, then cosine from peak_lr to peak_lr * final_lr_fraction over `total`
    steps (unknown, None, only during the probe, which ends inside the warm-up)."""
    if step < hp.warmup_steps:
        return hp.peak_lr * (step + 1) / hp.warmup_steps
    assert total is not None, "the probe must end inside the warm-up"
    t = min(1.0, (step - hp.warmup_steps) / max(1, total - hp.warmup_steps))
    lo = hp.peak_lr * hp.final_lr_fraction
    return lo + 0.5 * (hp.peak_lr - lo) * (1 + math.cos(math.pi * t))


def batch(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int):
    """Inputs [B, seq_len] = BOS + tokens[s : s+seq_len-1]; targets [B, seq_len] =
    tokens[s : s+seq_len] (position i predicts target i)."""
    idx = starts[:, None] + torch.arange(seq_len, device=tokens.device)[None, :]
    targets = tokens[idx]
    bos = torch.full_like(targets[:, :1], BOS_ID)
    return torch.cat([bos, targets[:, :-1]], dim=1), targets


def loss_of(model, inputs, targets, device: torch.device) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def heldout_loss(model, heldout: torch.Tensor, hp: HParams, device: torch.device) -> float:
    """Mean loss over non-overlapping BOS-led windows covering the held-out tokens."""
    model.eval()
    n = (heldout.numel() - 1) // hp.seq_len
    starts = torch.arange(n, device=device) * hp.seq_len
    total, count = 0.0, 0
    for chunk in starts.split(hp.batch):
        inputs, targets = batch(heldout, chunk, hp.seq_len)
        total += loss_of(model, inputs, targets, device).item() * targets.numel()
        count += targets.numel()
    model.train()
    return total / count


def parameter_groups(model, weight_decay: float):
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0}]


def train(model, train_tokens, heldout, hp: HParams, device: torch.device, log) -> dict:
    """Runs the budgeted loop; returns the record (curves, timings) with the best weights under
    'best_state' (float32, on the CPU)."""
    opt = torch.optim.AdamW(parameter_groups(model, hp.weight_decay), lr=hp.peak_lr,
                            betas=(hp.beta1, hp.beta2), fused=device.type == "cuda")
    gen = torch.Generator(device="cpu").manual_seed(hp.seed)
    max_start = train_tokens.numel() - hp.seq_len
    rec = {"train_curve": [], "heldout_curve": [], "total_steps": None}
    best = (math.inf, -1, None)
    total = None
    t0 = time.perf_counter()
    probe_t0 = None
    step = 0
    model.train()
    while True:
        elapsed = time.perf_counter() - t0
        if elapsed >= hp.train_seconds or (total is not None and step >= total):
            break
        if step == 5:
            probe_t0 = time.perf_counter()
        if step == hp.probe_steps:
            step_s = (time.perf_counter() - probe_t0) / (hp.probe_steps - 5)
            eval_t0 = time.perf_counter()
            val = heldout_loss(model, heldout, hp, device)
            eval_s = time.perf_counter() - eval_t0
            rec["heldout_curve"].append({"step": step, "loss": round(val, 4)})
            # steps k that fit: k * step_s + (k / eval_every) * eval_s = the time left
            left = hp.train_seconds - (time.perf_counter() - t0)
            epoch_cap = int(hp.max_epochs * train_tokens.numel() / (hp.batch * hp.seq_len))
            total = max(step, min(epoch_cap,
                                  step + int(left / (step_s + eval_s / hp.eval_every))))
            rec.update(total_steps=total, probe_step_s=round(step_s, 5),
                       eval_s=round(eval_s, 3))
            log(f"step {step_s * 1e3:.1f} ms, held-out evaluation {eval_s:.2f} s (loss "
                f"{val:.3f}) -> schedule of {total} steps")
        lr = lr_at(step, total, hp)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, max_start + 1, (hp.batch,), generator=gen).to(device)
        inputs, targets = batch(train_tokens, starts, hp.seq_len)
        loss = loss_of(model, inputs, targets, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp.grad_clip)
        opt.step()
        step += 1
        if step % 10 == 0 or step == 1:
            rec["train_curve"].append({"step": step, "seconds": round(time.perf_counter() - t0, 2),
                                       "lr": lr, "loss": round(loss.item(), 4),
                                       "grad_norm": round(grad_norm.item(), 3)})
        if step % hp.eval_every == 0:
            val = heldout_loss(model, heldout, hp, device)
            rec["heldout_curve"].append({"step": step, "loss": round(val, 4)})
            log(f"step {step} {time.perf_counter() - t0:.0f} s lr {lr:.2e} train "
                f"{loss.item():.3f} heldout {val:.3f}")
            if val < best[0]:
                best = (val, step, {k: v.detach().to("cpu", copy=True)
                                    for k, v in model.state_dict().items()})
    rec["steps"] = step
    rec["train_seconds"] = round(time.perf_counter() - t0, 1)
    val = heldout_loss(model, heldout, hp, device)
    rec["heldout_curve"].append({"step": step, "loss": round(val, 4)})
    if val < best[0]:
        best = (val, step, {k: v.detach().to("cpu", copy=True)
                            for k, v in model.state_dict().items()})
    rec["best_step"], rec["best_heldout_loss"], rec["best_state"] = best[1], best[0], best[2]
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="tiny_gemma4_corpus.py's --out")
    p.add_argument("--out", type=Path, required=True, help="model directory to write")
    p.add_argument("--train-seconds", type=float, default=None)
    p.add_argument("--toy", action="store_true", help="tiny model and budget (CPU test)")
    a = p.parse_args(argv)
    hp = TOY_HPARAMS if a.toy else HParams()
    if a.train_seconds is not None:
        hp = HParams(**{**asdict(hp), "train_seconds": a.train_seconds})
    config_kwargs = TOY_MODEL if a.toy else MODEL
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(hp.seed)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def log(msg: str) -> None:
        print(f"[train] {msg}", flush=True)

    corpus = json.loads((a.data / "corpus.json").read_text())
    train_tokens = torch.from_numpy(np.load(a.data / "train.npy").astype(np.int64)).to(device)
    heldout = torch.from_numpy(np.load(a.data / "heldout.npy").astype(np.int64)).to(device)
    if int(train_tokens.max()) >= config_kwargs["vocab_size"]:
        raise SystemExit(f"{a.data}/train.npy: token ids exceed the vocabulary")
    model = build_model(config_kwargs).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{n_params / 1e6:.2f}M parameters on {device}; {train_tokens.numel():,} train tokens, "
        f"{heldout.numel():,} held-out tokens")

    rec = train(model, train_tokens, heldout, hp, device, log)
    best_state = rec.pop("best_state")
    model.load_state_dict(best_state)
    with torch.no_grad():  # round to the stored bf16 (buffers such as RoPE's stay float32)
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16))
    stored_loss = heldout_loss(model, heldout, hp, device)
    log(f"best step {rec['best_step']}: held-out loss {rec['best_heldout_loss']:.4f} "
        f"(stored bf16 weights: {stored_loss:.4f}, perplexity {math.exp(stored_loss):.2f})")

    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="12MB")
    shutil.copy(a.data / "tokenizer.json", out / "tokenizer.json")
    generation = {"do_sample": False, "bos_token_id": BOS_ID, "eos_token_id": [EOS_ID],
                  "pad_token_id": PAD_ID}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokens_seen = rec["steps"] * hp.batch * (hp.seq_len - 1)
    record = {
        "started_utc": started,
        "script": "examples/train_tiny_gemma4.py" + (" --toy" if a.toy else ""),
        "seed": hp.seed,
        "hparams": asdict(hp),
        "model": config_kwargs,
        "parameters": n_params,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "data": corpus,
        "tokens_seen": tokens_seen,
        "epochs": round(tokens_seen / train_tokens.numel(), 2),
        **rec,
        "peak_gpu_memory_gib": (round(torch.cuda.max_memory_allocated() / 2**30, 2)
                                if device.type == "cuda" else None),
        "stored_dtype": "bfloat16",
        "stored_heldout_loss": round(stored_loss, 4),
        "stored_heldout_perplexity": round(math.exp(stored_loss), 3),
    }
    (out / "training_log.json").write_text(json.dumps(record, indent=1) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
