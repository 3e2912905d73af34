"""The transformers Gemma 4 oracle: tiny random models, their checkpoints, logits and greedy text.

Not a test file: tests import it (`from oracle import ...`; pytest puts tests/ on sys.path).
transformers 5.23.0 is the ground truth for every numerical test of the compiler.

- `ORACLE_CASES[case]`: full `Gemma4TextConfig` kwargs for one tiny model per feature:
  "dense", "k_eq_v", "kv_shared", "ple", "moe" and "all". Every field is set, since the class
  defaults match no released model. Windows (8) are shorter than test sequences, and every case
  has at least two full-attention layers.
- `make_oracle_model(case, seed)`: float32, eager attention, eval mode, every tensor redrawn from
  `seed`; everything transformers initialises to 1 (RMSNorm weights, `layer_scalar`, the router's
  `scale` and `per_expert_scale`) is moved away from 1 so `w` vs `1 + w` or a dropped
  `layer_scalar` shows in the logits.
- `save_oracle_checkpoint(model, dir)`: config.json + model.safetensors (transformers' own
  `save_pretrained`), tokenizer.json (vocab 1024) and generation_config.json (greedy).
- `load_oracle_model(dir)`: the saved checkpoint back, logits bit-identical to the original.
- `oracle_logits`, `oracle_greedy` (HF `generate` with its KV cache), `oracle_greedy_nocache`
  (repeated full forwards), `random_token_ids`, `oracle_config` (the `Gemma4TextConfig`).

KV sharing without PLE crashes stock transformers 5.23.0; models from this module carry a
per-instance workaround (see `_work_around_kv_shared_without_ple`) that changes no logit.

Assistant drafters (`Gemma4AssistantForCausalLM`, or `Gemma4UnifiedAssistantForCausalLM` with
`unified`, issue 15): `make_oracle_assistant(case, seed, ordered=...)` is a tiny drafter for the
target of `case` (3 layers S S F of width 32 that read the target's caches; `ordered` gives the
centroid-masked head: 16 clusters, top 4), its tensors redrawn like a target's and
token_ordering a random permutation. transformers 5.23.0's `kv_sharing_modes` (of
Gemma4TextConfig and Gemma4UnifiedTextConfig) refuses a config whose layers are all KV-shared
(every assistant); `all_kv_shared_allowed()` patches it, while such models are built, to say
"reuse" for each layer, as the assistant means. `oracle_target_states(target, ids)` runs the
target once and returns its final-normed hidden states and the K/V of its last non-shared
sliding and full layers (transformers' `shared_kv_states`, made to store on any target), and
`oracle_draft` one assistant step on them.

Embedding rows of the special ids 0-3 (pad, eos, bos, unk) are drawn small, so their logits sit
near 0 while the top logit is ~10: greedy decoding never picks EOS, and `min_new_tokens` in
`oracle_greedy` never changes which token wins.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    Gemma4UnifiedAssistantConfig,
    Gemma4UnifiedAssistantForCausalLM,
)
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4RMSNorm,
    Gemma4TextDecoderLayer,
    Gemma4TextExperts,
    Gemma4TextRouter,
)
from transformers.models.gemma4_unified.configuration_gemma4_unified import (
    Gemma4UnifiedTextConfig,
)
from transformers.models.gemma4_unified.modeling_gemma4_unified import (
    Gemma4UnifiedRMSNorm,
    Gemma4UnifiedTextDecoderLayer,
)

VOCAB = 1024
NUM_SPECIAL = 4  # ids 0 <pad>, 1 <eos>, 2 <bos>, 3 <unk>
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
BYTE_OFFSET = 300  # fallback tokenizer: byte b is token 300 + b

# Conditioning. The logits are tied to the embeddings and attention has scale 1 (q . k of two
# RMS-normalised vectors), so large embeddings, norm weights above 1 and deep softmaxes amplify
# float32 rounding: with embeddings std 0.5, norms in [0.5, 1.5] and layer_scalar in [0.5, 1]
# transformers float32 itself differed from transformers float64 by up to ~8e-4 on these logits,
# which left no room for a 1e-4 test. With the values below that difference is ~1e-5 (every
# case, several seeds). Every 1-initialised tensor stays well away from 1.
EMBED_STD = 0.2  # token embeddings (times sqrt(H) at input): logits std still ~1-1.6, top ~7
SPECIAL_EMBED_STD = 0.05  # rows 0-3: special tokens never win greedy decoding
NORM_RANGE = (0.5, 1.0)  # RMSNorm weights and the router's scales (transformers: all 1)
QK_NORM_RANGE = (0.25, 0.5)  # q_norm / k_norm weights: attention scores ~sqrt(d) * w_q * w_k
LAYER_SCALAR_RANGE = (0.6, 0.9)  # transformers: 1
# The router sees RMSNorm(r) * scale * H^-0.5, so a 1/sqrt(H) projection gave router logits of
# std ~0.07: all 8 expert probabilities in [0.11, 0.15], the top-k choice decided by gaps of
# ~1e-4, and any rounding (bf16 weights) swapping experts. std 1.5 gives logits of std ~1.
ROUTER_PROJ_STD = 1.5

S, F = "sliding_attention", "full_attention"

# The models are tiny: with more than one intra-op thread a forward took ~0.8 s instead of
# ~10 ms on a 2-core machine under load (threads waiting on each other). Test processes only.
torch.set_num_threads(1)

_BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "layer_types": [S, S, F, S, S, F],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # sliding layers
    "global_head_dim": 64,  # full layers; save_pretrained writes it as per_layer_config
    "num_global_key_value_heads": None,  # full layers, only when attention_k_eq_v
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "use_double_wide_mlp": False,
    "hidden_size_per_layer_input": 0,
    "enable_moe_block": False,
    "num_experts": None,
    "top_k_experts": None,
    "moe_intermediate_size": None,
    "sliding_window": 8,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "final_logit_softcapping": 30.0,
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {
            "rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0,
        },
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_bidirectional_attention": None,
    "tie_word_embeddings": True,
    "use_cache": True,
    "initializer_range": 0.02,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}

_MOE = {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 32}
# 8 layers S S F S S F | S F with the last 4 KV-shared: they read layer 3 (S) and layer 2 (F).
_SHARED = {
    "num_hidden_layers": 8, "layer_types": [S, S, F, S, S, F, S, F],
    "num_kv_shared_layers": 4, "use_double_wide_mlp": True,
}

ORACLE_CASES: dict[str, dict[str, Any]] = {
    # sliding + full with their own head dims (32 / 64), GQA 4:2, separate K and V.
    "dense": {**_BASE},
    # like 31B: full layers K=V (no v_proj) with their own KV-head count (1; sliding keep 2).
    "k_eq_v": {**_BASE, "attention_k_eq_v": True, "num_global_key_value_heads": 1},
    # like E2B: one KV head (MQA), last 4 layers KV-shared with a double-wide MLP.
    "kv_shared": {**_BASE, **_SHARED, "num_key_value_heads": 1},
    # like E4B's per-layer embeddings. num_global_key_value_heads is set but K=V is off, so
    # transformers ignores it: a parser reading the Hub-style kwargs must ignore it too.
    "ple": {**_BASE, "hidden_size_per_layer_input": 16, "num_global_key_value_heads": 1},
    # like 26B-A4B's expert branch (8 experts, top-2) beside the dense MLP; K=V off here.
    "moe": {**_BASE, **_MOE},
    # everything at once: K=V, KV sharing + double-wide MLP, PLE, MoE.
    "all": {
        **_BASE, **_SHARED, **_MOE, "hidden_size": 128,
        "attention_k_eq_v": True, "num_global_key_value_heads": 1,
        "hidden_size_per_layer_input": 16,
    },
}


def oracle_config(case: str) -> Gemma4TextConfig:
    """The transformers config of one case (eager attention)."""
    if case not in ORACLE_CASES:
        raise KeyError(f"unknown oracle case {case!r} (known: {', '.join(ORACLE_CASES)})")
    kwargs = copy.deepcopy(ORACLE_CASES[case])
    return Gemma4TextConfig(**kwargs, attn_implementation="eager")


def make_oracle_model(case: str, seed: int) -> Gemma4ForCausalLM:
    """A float32, eager, eval-mode model of `case` with every tensor redrawn from `seed`."""
    with torch.random.fork_rng(devices=[]):  # transformers' own init must not move the global RNG
        torch.manual_seed(seed)
        model = Gemma4ForCausalLM(oracle_config(case))
    model = model.to(torch.float32).eval()
    _randomise(model, torch.Generator().manual_seed(seed))
    return _work_around_kv_shared_without_ple(model)


def load_oracle_model(dir: Path) -> Gemma4ForCausalLM:  # noqa: A002
    """Reload a saved oracle checkpoint the way `make_oracle_model` builds one.

    Tensors are copied out of the memory-mapped file: CPU kernels (the MoE experts' grouped_mm
    at least) round differently on unaligned data, which moved logits by ~1e-5."""
    model = Gemma4ForCausalLM.from_pretrained(
        dir, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()  # fresh, aligned memory; ties survive (same object)
    return _work_around_kv_shared_without_ple(model.eval())


def _work_around_kv_shared_without_ple(model: Gemma4ForCausalLM) -> Gemma4ForCausalLM:
    """transformers 5.23.0 crashes (`None[:, slice]`) on KV sharing without PLE: before the first
    shared layer `_maybe_slice_kv_shared_inputs` slices `per_layer_inputs` even when it is None.
    That method only drops positions whose logits are not asked for, so skipping it on such a
    model (this instance only) changes no kept logit."""
    text = model.model
    if text.config.num_kv_shared_layers and not text.config.hidden_size_per_layer_input:
        def no_slice(hidden_states, per_layer_inputs, position_embeddings, causal_mask_mapping,
                     *args, **kwargs):
            return hidden_states, per_layer_inputs, position_embeddings, causal_mask_mapping

        text._maybe_slice_kv_shared_inputs = no_slice
    return model


def _randomise(model: Gemma4ForCausalLM, gen: torch.Generator) -> None:
    """Redraw every parameter and `layer_scalar`; raise if a parameter kind is not covered."""
    done: set[int] = set()

    def normal_(t: torch.Tensor, std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * std)
        done.add(id(t))

    def uniform_(t: torch.Tensor, lo: float, hi: float) -> None:
        t.copy_(lo + (hi - lo) * torch.rand(t.shape, generator=gen, dtype=torch.float32))
        done.add(id(t))

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Embedding):
                normal_(module.weight, EMBED_STD)
                if module is model.model.embed_tokens:
                    module.weight[:NUM_SPECIAL] *= SPECIAL_EMBED_STD / EMBED_STD
            elif isinstance(module, torch.nn.Linear):
                if module.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr():
                    continue  # lm_head, tied to embed_tokens
                router = name.endswith(".router.proj")
                normal_(module.weight,
                        ROUTER_PROJ_STD if router else 1.0 / math.sqrt(module.in_features))
            elif isinstance(module, Gemma4RMSNorm | Gemma4UnifiedRMSNorm) and module.with_scale:
                qk = name.endswith((".q_norm", ".k_norm"))
                uniform_(module.weight, *(QK_NORM_RANGE if qk else NORM_RANGE))
            elif isinstance(module, Gemma4TextRouter):
                uniform_(module.scale, *NORM_RANGE)
                uniform_(module.per_expert_scale, *NORM_RANGE)
            elif isinstance(module, Gemma4TextExperts):
                normal_(module.gate_up_proj, 1.0 / math.sqrt(module.hidden_dim))  # [E, 2Im, H]
                normal_(module.down_proj, 1.0 / math.sqrt(module.intermediate_dim))  # [E, H, Im]
            if isinstance(module, Gemma4TextDecoderLayer | Gemma4UnifiedTextDecoderLayer):
                uniform_(module.layer_scalar, *LAYER_SCALAR_RANGE)
    missed = [name for name, p in model.named_parameters() if id(p) not in done]
    if missed:
        raise RuntimeError(f"oracle: parameters not re-randomised (new in transformers?): {missed}")


def save_oracle_checkpoint(model: Gemma4ForCausalLM, dir: Path) -> Path:  # noqa: A002
    """Write a loadable text checkpoint of `model` into `dir` and return `dir`."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dir, safe_serialization=True)
    (dir / "tokenizer.json").write_text(_tokenizer_json(model.config.vocab_size))
    eos = model.config.eos_token_id
    generation = {
        "do_sample": False,
        "bos_token_id": model.config.bos_token_id,
        "eos_token_id": eos if isinstance(eos, list) else [eos],
        "pad_token_id": model.config.pad_token_id,
    }
    (dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return dir


def oracle_logits(model: Gemma4ForCausalLM, token_ids: np.ndarray) -> np.ndarray:
    """Logits [T, vocab] (float32) of one full forward over token_ids [T], no cache."""
    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))[None, :]
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    return out.logits[0].to(torch.float32).numpy()


def oracle_greedy(model: Gemma4ForCausalLM, prompt_ids: np.ndarray, n_new: int) -> list[int]:
    """`n_new` greedy tokens after prompt_ids [T] from HF `generate` (its cached decode path)."""
    ids = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64))[None, :]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=model.config.pad_token_id,
        )
    return out[0, ids.shape[1]:].tolist()


def oracle_greedy_nocache(model: Gemma4ForCausalLM, prompt_ids: np.ndarray,
                          n_new: int) -> list[int]:
    """`n_new` greedy tokens by a full forward over the whole sequence per step (plain argmax)."""
    seq = [int(t) for t in prompt_ids]
    for _ in range(n_new):
        seq.append(int(np.argmax(oracle_logits(model, np.array(seq))[-1])))
    return seq[len(prompt_ids):]


def agreement_with_oracle(model, hf, seq: int = 40, seeds=(11, 12, 13, 14)) -> dict:
    """A runtime Model's teacher-forced logits against the oracle's over a few random
    sequences: {"top1", "mean", "max", "ref_std", "finite"} (top-1 agreement, abs errors)."""
    ours, ref = [], []
    for seed in seeds:
        ids = random_token_ids(seq, seed=seed)
        ours.append(model.logits(ids))
        ref.append(oracle_logits(hf, ids))
    ours, ref = np.concatenate(ours), np.concatenate(ref)
    err = np.abs(ours - ref)
    return {"top1": float((ours.argmax(-1) == ref.argmax(-1)).mean()), "mean": float(err.mean()),
            "max": float(err.max()), "ref_std": float(ref.std()),
            "finite": bool(np.isfinite(ours).all())}


# --- assistant drafters ---------------------------------------------------------------------

ASSISTANT_WIDTH = 32
ASSISTANT_CENTROIDS, ASSISTANT_TOP_K = 16, 4


@contextlib.contextmanager
def all_kv_shared_allowed() -> Iterator[None]:
    """While open, a Gemma4TextConfig or Gemma4UnifiedTextConfig whose layers are all KV-shared
    says "reuse" for each one (transformers 5.23.0 raises instead); every other config answers
    as before."""
    originals = {cls: cls.kv_sharing_modes for cls in (Gemma4TextConfig, Gemma4UnifiedTextConfig)}

    def patched(original):
        def modes(self):
            if self.num_kv_shared_layers == self.num_hidden_layers:
                return ["reuse"] * self.num_hidden_layers
            return original.fget(self)
        return property(modes)

    for cls, original in originals.items():
        cls.kv_sharing_modes = patched(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.kv_sharing_modes = original


def oracle_assistant_config(case: str, *, ordered: bool, unified: bool = False):
    """A drafter config for the target of `case`: the target's cache layout (head dims, KV
    heads, K=V, window, RoPE), its own width, MLP and query heads. `unified`: the 12B's kind,
    Gemma4UnifiedAssistantConfig over a gemma4_unified_text config (no per-layer-input, MoE or
    double-wide MLP fields)."""
    t = ORACLE_CASES[case]
    text = {
        **{k: copy.deepcopy(t[k]) for k in (
            "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "global_head_dim", "num_global_key_value_heads", "attention_k_eq_v",
            "sliding_window", "max_position_embeddings", "rms_norm_eps", "hidden_activation",
            "rope_parameters", "attention_bias", "attention_dropout", "pad_token_id",
            "bos_token_id", "eos_token_id", "initializer_range")},
        "model_type": "gemma4_text", "hidden_size": ASSISTANT_WIDTH, "intermediate_size": 64,
        "num_hidden_layers": 3, "layer_types": [S, S, F], "num_kv_shared_layers": 3,
        "final_logit_softcapping": None, "tie_word_embeddings": True,
    }
    if unified:
        text.update(model_type="gemma4_unified_text", use_bidirectional_attention=None)
    else:
        text.update(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
    cls = Gemma4UnifiedAssistantConfig if unified else Gemma4AssistantConfig
    return cls(
        text_config=text, backbone_hidden_size=t["hidden_size"], use_ordered_embeddings=ordered,
        num_centroids=ASSISTANT_CENTROIDS, centroid_intermediate_top_k=ASSISTANT_TOP_K,
        tie_word_embeddings=True)


def make_oracle_assistant(case: str, seed: int, *, ordered: bool, unified: bool = False):
    """A float32, eager, eval-mode drafter (Gemma4AssistantForCausalLM, or with `unified`
    Gemma4UnifiedAssistantForCausalLM) for `case`'s target, every tensor redrawn from `seed`
    (token_ordering a random permutation)."""
    cfg = oracle_assistant_config(case, ordered=ordered, unified=unified)
    cfg.text_config._attn_implementation = "eager"
    cls = Gemma4UnifiedAssistantForCausalLM if unified else Gemma4AssistantForCausalLM
    with torch.random.fork_rng(devices=[]), all_kv_shared_allowed():
        torch.manual_seed(seed)
        model = cls(cfg)
    model = model.to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    _randomise(model, gen)
    if ordered:
        with torch.no_grad():
            model.masked_embedding.token_ordering.copy_(
                torch.randperm(cfg.text_config.vocab_size, generator=gen))
    return model


def save_oracle_assistant(model, dir: Path) -> Path:  # noqa: A002
    """config.json + model.safetensors (transformers' `save_pretrained`) into `dir`."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dir, safe_serialization=True)
    return dir


def oracle_target_states(target: Gemma4ForCausalLM,
                         token_ids: np.ndarray) -> tuple[np.ndarray, dict[str, tuple]]:
    """One full forward of the target over token_ids [T] (no cache): its final-normed hidden
    states [T, H] (transformers' `hidden_states[-1]`, what assisted generation feeds the
    drafter) and {"sliding_attention" | "full_attention": (K, V)}, each [1, KV heads, T, D],
    of its last non-shared layer of that kind (transformers' `shared_kv_states`; only targets
    with KV sharing store them, so the two layers are told to, on this call only)."""
    cfg = target.config
    first_shared = cfg.num_hidden_layers - cfg.num_kv_shared_layers
    producers = {cfg.layer_types[i]: i for i in range(first_shared)}
    attns = [target.model.layers[i].self_attn for i in producers.values()]
    before = [a.store_full_length_kv for a in attns]
    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))[None, :]
    try:
        for a in attns:
            a.store_full_length_kv = True
        with torch.no_grad():
            out = target(input_ids=ids, use_cache=False, output_hidden_states=True,
                         return_shared_kv_states=True)
    finally:
        for a, b in zip(attns, before, strict=True):
            a.store_full_length_kv = b
    return out.hidden_states[-1][0].numpy(), dict(out.shared_kv_states)


def oracle_draft(assistant, target: Gemma4ForCausalLM,
                 shared_kv: dict[str, tuple], position: int, token: int,
                 hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One assistant step as transformers' assisted generation runs it: the target's embedding
    of `token` beside `hidden` [H], the query at `position`, the target's K/V of positions
    [0, position) (the target has not run `token` yet). Returns (logits [V], next state [H])."""
    kv = {k: (v[0][:, :, :position], v[1][:, :, :position]) for k, v in shared_kv.items()}
    with torch.no_grad():
        emb = target.get_input_embeddings()(torch.tensor([[token]]))
        x = torch.cat([emb, torch.as_tensor(hidden, dtype=torch.float32)[None, None]], dim=-1)
        out = assistant(inputs_embeds=x, position_ids=torch.tensor([[position]]),
                        shared_kv_states=kv,
                        attention_mask=torch.ones(1, position + 1, dtype=torch.long))
    return out.logits[0, 0].numpy(), out.last_hidden_state[0, 0].numpy()


def random_token_ids(n: int, seed: int, vocab: int = VOCAB) -> np.ndarray:
    """n token ids [n] (int64) drawn uniformly from the non-special ids [4, vocab)."""
    return np.random.default_rng(seed).integers(NUM_SPECIAL, vocab, size=n, dtype=np.int64)


# --- tokenizer.json ---------------------------------------------------------------------------


def _tokenizer_json(vocab_size: int) -> str:
    """rvcompile's synthetic tokenizer; the local fallback only while that module is absent."""
    try:
        from rvcompile.sources.tokenizer_files import synthetic_tokenizer_json
    except ImportError:
        return _byte_bpe_tokenizer_json(vocab_size)
    return synthetic_tokenizer_json(vocab_size)


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _byte_bpe_tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE with no merges: specials 0-3, byte b at 300 + b, placeholders elsewhere.
    Like rvcompile.sources.tokenizer_files, it adds no BOS itself."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < BYTE_OFFSET + 256:
        raise ValueError(f"fallback tokenizer needs vocab_size >= {BYTE_OFFSET + 256}")
    tokens = [f"<unused_{i}>" for i in range(vocab_size)]
    tokens[:NUM_SPECIAL] = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tokens[BYTE_OFFSET:BYTE_OFFSET + 256] = _byte_chars()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[],
                               unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in tokens[:NUM_SPECIAL]])
    return tok.to_str()
