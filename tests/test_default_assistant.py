"""The default model's trained assistant (models/rv-gemma4-tiny-assistant, trained by
examples/train_tiny_assistant.py) beside its target (models/rv-gemma4-tiny).

- The directory is a Gemma 4 assistant in Hugging Face layout that fits the target: rvcompile's
  loader reads it and maps its sliding layers to the target's layer 5 and its full layer to
  layer 3; transformers' Gemma4AssistantForCausalLM loads the same tensors (its 5.23
  kv_sharing_modes patched, tests/oracle.py); it is small; its training record is beside it.
- The training script's teacher-forced drafter steps (many query positions in one call, with
  per-row masks) are the steps transformers' Gemma4AssistantForCausalLM.forward runs at one
  position at a time, before and past the sliding window: the objective trains what runs.
- The issue's correctness bar on the CPU: on xla-f32, greedy decoding with the assistant's
  drafts (and with n-gram drafts) gives plain greedy decoding's 256 tokens, token for token, and
  the trained drafter gets drafts accepted (docs/QUALITY.md has the acceptance per k).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from oracle import all_kv_shared_allowed
from transformers import Gemma4AssistantForCausalLM

from rvcompile import runtime
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.sources.checkpoint import load_assistant_source, load_model_source

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "rv-gemma4-tiny"
ASSISTANT_DIR = ROOT / "models" / "rv-gemma4-tiny-assistant"
MAX_WEIGHT_BYTES = 6 * 2**20  # "a few MB": 2.26M parameters in bf16 are 4.5 MB
N_NEW, K = 256, 3
# Share of the assistant's drafts accepted over the test's 256 greedy tokens at k = 3: measured
# 109 of 433 (0.252; transformers' Gemma4AssistantForCausalLM run on the same greedy tokens
# accepts the same 109); the bound leaves room for near-tie argmaxes that move with the XLA
# version, not for an untrained drafter (docs/QUALITY.md: a random one accepted 0 of 756).
MIN_ACCEPTED_SHARE = 0.2


@pytest.fixture(scope="module")
def sources():
    target = load_model_source(str(MODEL_DIR))
    return target, load_assistant_source(str(ASSISTANT_DIR), target.config)


def test_assistant_dir_fits_the_default_model(sources):
    target, asrc = sources
    a = asrc.config
    assert a.model_type == "gemma4_assistant" and not a.use_ordered_embeddings
    assert a.backbone_hidden_size == target.config.hidden_size == 256
    assert a.vocab_size == target.config.vocab_size
    # three sliding layers read the target's last non-shared sliding layer, the full one its
    # last non-shared full layer (layers 6 and 7 of the target are KV-shared)
    assert a.target_layers(target.config) == (5, 5, 5, 3)
    weights = list(ASSISTANT_DIR.glob("*.safetensors"))
    assert weights and sum(f.stat().st_size for f in weights) <= MAX_WEIGHT_BYTES
    log = json.loads((ASSISTANT_DIR / "training_log.json").read_text())
    assert log["script"] == "examples/train_tiny_assistant.py"
    assert log["seed"] == 0 and log["target"].endswith("rv-gemma4-tiny")
    assert log["data"]["train_sha256"] == json.loads(
        (MODEL_DIR / "training_log.json").read_text())["data"]["train_sha256"]


def test_transformers_loads_the_same_weights(sources):
    _, asrc = sources
    with all_kv_shared_allowed():
        hf = Gemma4AssistantForCausalLM.from_pretrained(ASSISTANT_DIR, dtype=torch.float32)
    log = json.loads((ASSISTANT_DIR / "training_log.json").read_text())
    assert sum(p.numel() for p in hf.parameters()) == log["parameters"]
    # every tensor transformers holds, but the head tied to the embedding, is one rvcompile read
    state = {k: v.numpy() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    ours = {t.name: t.load() for t in asrc.tensors}
    hf_names = {}
    for name in ours:
        rel = name.removeprefix("assistant.")  # the checkpoint's name, "model." dropped
        hf_names[name] = rel if rel in state else "model." + rel
    assert sorted(hf_names.values()) == sorted(state)
    for name, value in ours.items():
        np.testing.assert_array_equal(value.astype(np.float32), state[hf_names[name]],
                                      err_msg=name)


def load_training_script():
    path = ROOT / "examples" / "train_tiny_assistant.py"
    spec = importlib.util.spec_from_file_location("train_tiny_assistant", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_training_steps_are_transformers_assisted_steps():
    tta = load_training_script()
    torch.manual_seed(0)
    target = tta.load_target(MODEL_DIR)
    with all_kv_shared_allowed():
        drafter = Gemma4AssistantForCausalLM.from_pretrained(
            ASSISTANT_DIR, dtype=torch.float32, attn_implementation="sdpa").eval()
    n, steps = 200, 3  # past the sliding window 128
    ids = torch.cat([torch.tensor([[tta.BOS_ID]]), torch.randint(4, 8192, (1, n - 1))], dim=1)
    t = tta.teacher(target, ids)
    queries = torch.tensor([1, 5, 100, 129, 130, 131, 150, 196])
    with torch.no_grad():
        pairs = tta.unrolled(drafter, t, queries, target.config.sliding_window, steps)
    worst = 0.0
    for i, q in enumerate(queries.tolist()):
        state = t.hidden[:, q - 1:q]
        kv = {k: (v[0][:, :, :q], v[1][:, :, :q]) for k, v in t.shared_kv.items()}
        for j in range(steps):
            x = torch.cat([t.embeds[:, q + j:q + j + 1], state], dim=-1)
            with torch.no_grad():
                out = drafter(inputs_embeds=x, position_ids=torch.tensor([[q]]),
                              shared_kv_states=kv,
                              attention_mask=torch.ones(1, q + 1, dtype=torch.long))
            want = torch.log_softmax(out.logits[0, 0], -1)
            worst = max(worst, float((pairs[j][0][0, i] - want).abs().max()))
            assert torch.equal(pairs[j][1][0, i], t.log_probs[0, q + j])
            state = out.last_hidden_state
    print(f"\n[measured] training steps vs transformers' forward: max abs {worst:.2g}")
    assert worst <= 1e-4


def test_greedy_speculation_gives_greedy_tokens(tmp_path):
    out = tmp_path / "pair.rvp"
    opts = BuildOptions("xla-f32", max_context=512, prefill_buckets=(64,), max_seqs=1,
                        platforms=("cpu",), draft_tokens=K, decode_loop_steps=0)
    build_artifact(str(MODEL_DIR), out, opts, assistant=str(ASSISTANT_DIR), progress=False,
                   log=lambda s: None)
    m = runtime.load(out)
    ids = m.encode((MODEL_DIR / "heldout_sample.txt").read_text(), add_bos=False)
    prompt = [m.bos_id, *ids[:32]]
    plain = m.generate(prompt, max_tokens=N_NEW, ignore_eos=True).token_ids
    assert len(plain) == N_NEW
    spec = m.generate(prompt, max_tokens=N_NEW, ignore_eos=True, speculative="assistant",
                      num_draft_tokens=K)
    assert spec.token_ids == plain
    ngram = m.generate(prompt, max_tokens=N_NEW, ignore_eos=True, speculative="ngram",
                       num_draft_tokens=K)
    assert ngram.token_ids == plain
    share = spec.accepted_tokens / spec.drafted_tokens
    print(f"\n[measured] assistant k={K}: {spec.accepted_tokens}/{spec.drafted_tokens} drafts "
          f"accepted ({share:.3f}); n-gram {ngram.accepted_tokens}/{ngram.drafted_tokens}")
    assert share >= MIN_ACCEPTED_SHARE
