"""The transformers oracle checks itself: sane logits, cached == uncached greedy, checkpoints that
reload exactly, nothing left at transformers' 1-init, and our config parser agreeing with the
layers transformers actually built."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from oracle import (
    BOS_ID,
    EOS_ID,
    NUM_SPECIAL,
    ORACLE_CASES,
    PAD_ID,
    UNK_ID,
    load_oracle_model,
    oracle_config,
    oracle_greedy,
    oracle_greedy_nocache,
    oracle_logits,
    random_token_ids,
)
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import Gemma4ForCausalLM

from rvcompile.model.config import AttnKind, Gemma4Config

CASES = list(ORACLE_CASES)
PROMPT_LEN = 20  # longer than every case's sliding window (8)
N_NEW = 16


@pytest.mark.parametrize("case", CASES)
def test_logits_finite_and_spread(oracle_dir, case):
    model, _ = oracle_dir(case)
    assert PROMPT_LEN > model.config.sliding_window
    logits = oracle_logits(model, random_token_ids(PROMPT_LEN, seed=1))
    assert logits.shape == (PROMPT_LEN, model.config.vocab_size)
    assert logits.dtype == np.float32
    assert np.isfinite(logits).all()
    assert logits.std(axis=-1).min() > 0.1
    assert (logits.argmax(-1) >= NUM_SPECIAL).all()  # special rows are small: EOS never wins


@pytest.mark.parametrize("case", CASES)
def test_cached_greedy_matches_full_forwards(oracle_dir, case):
    model, _ = oracle_dir(case)
    prompt = random_token_ids(PROMPT_LEN, seed=2)
    cached = oracle_greedy(model, prompt, N_NEW)
    assert len(cached) == N_NEW
    assert cached == oracle_greedy_nocache(model, prompt, N_NEW)
    assert min(cached) >= NUM_SPECIAL


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_reloads_to_identical_logits(oracle_dir, case):
    model, path = oracle_dir(case)
    ids = random_token_ids(PROMPT_LEN, seed=3)
    reloaded = load_oracle_model(path)
    np.testing.assert_array_equal(oracle_logits(reloaded, ids), oracle_logits(model, ids))

    with safe_open(path / "model.safetensors", "np") as f:
        keys = set(f.keys())
    n = model.config.num_hidden_layers
    assert {f"model.layers.{i}.layer_scalar" for i in range(n)} <= keys  # persistent buffer
    assert "lm_head.weight" not in keys  # tied to embed_tokens
    for i, mode in enumerate(model.config.kv_sharing_modes):
        has_k = f"model.layers.{i}.self_attn.k_proj.weight" in keys
        assert has_k == (mode != "reuse")

    assert json.loads((path / "generation_config.json").read_text())["do_sample"] is False
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() == model.config.vocab_size
    specials = {"<pad>": PAD_ID, "<eos>": EOS_ID, "<bos>": BOS_ID, "<unk>": UNK_ID}
    assert {name: tok.token_to_id(name) for name in specials} == specials
    text = "Gemma 4, héllo ✓"
    assert tok.decode(tok.encode(text).ids) == text


@pytest.mark.parametrize("case", CASES)
def test_one_initialised_tensors_are_rerandomised(oracle_dir, case):
    model, _ = oracle_dir(case)
    with torch.random.fork_rng(devices=[]):
        stock = Gemma4ForCausalLM(oracle_config(case)).state_dict()
    ones = [name for name, t in stock.items() if t.is_floating_point() and bool((t == 1).all())]
    assert any(name.endswith("layer_scalar") for name in ones)
    assert any(name.endswith("input_layernorm.weight") for name in ones)
    if model.config.enable_moe_block:
        assert any(name.endswith("router.per_expert_scale") for name in ones)
    ours = model.state_dict()
    still_one = [name for name in ones if bool((ours[name] == 1).any())]
    assert not still_one
    constant = [name for name, t in ours.items()
                if t.is_floating_point() and t.numel() > 1 and bool((t == t.flatten()[0]).all())]
    assert not constant


def _hf_layers(model: Gemma4ForCausalLM) -> list[tuple]:
    """(kind, head_dim, kv_heads, k_eq_v, kv_source, mlp_width, window, moe) per layer, read off
    the modules transformers instantiated (a KV-shared layer reports its producer's KV layout)."""
    cfg = model.config
    modes = cfg.kv_sharing_modes
    layers = model.model.layers
    out = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        kind = cfg.layer_types[i]
        assert attn.is_sliding == (kind == AttnKind.SLIDING.value)
        assert attn.q_norm.weight.shape[0] == attn.head_dim
        assert attn.q_proj.out_features == cfg.num_attention_heads * attn.head_dim
        if modes[i] == "reuse":
            assert not hasattr(attn, "k_proj")
            [source] = [j for j, m in enumerate(modes)
                        if m == "store" and cfg.layer_types[j] == kind]
        else:
            source = i
        src = layers[source].self_attn
        assert src.head_dim == attn.head_dim
        kv_heads = src.k_proj.out_features // src.head_dim
        assert cfg.num_attention_heads // attn.num_key_value_groups == kv_heads
        mlp = layer.mlp
        assert mlp.gate_proj.out_features == mlp.up_proj.out_features == mlp.intermediate_size
        if layer.enable_moe_block:
            assert tuple(layer.experts.gate_up_proj.shape) == (
                cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size
            )
        out.append((kind, attn.head_dim, kv_heads, src.v_proj is None, source,
                    mlp.intermediate_size, attn.sliding_window, layer.enable_moe_block))
    return out


def _our_layers(cfg: Gemma4Config) -> list[tuple]:
    return [(s.kind.value, s.head_dim, s.num_kv_heads, s.k_eq_v, s.kv_source, s.mlp_width,
             s.window, s.moe) for s in cfg.layers]


@pytest.mark.parametrize("case", CASES)
def test_config_parser_matches_instantiated_layers(oracle_dir, case):
    model, path = oracle_dir(case)
    hf = _hf_layers(model)
    saved = Gemma4Config.from_hf_dict(json.loads((path / "config.json").read_text()))
    assert _our_layers(saved) == hf
    # The Hub form of the same model (global_head_dim / num_global_key_value_heads).
    hub = Gemma4Config.from_hf_dict({**ORACLE_CASES[case], "model_type": "gemma4_text"})
    assert _our_layers(hub) == hf

    rotary = model.model.rotary_emb
    for spec in saved.layers:
        hf_freq = getattr(rotary, f"{spec.kind.value}_inv_freq").numpy()
        np.testing.assert_allclose(spec.rope.inv_freq(spec.head_dim), hf_freq, rtol=1e-6)
    assert saved.vocab_size == model.config.vocab_size
    assert saved.hidden_size_per_layer_input == model.config.hidden_size_per_layer_input
    assert saved.final_logit_softcapping == model.config.final_logit_softcapping
    assert saved.num_experts == (model.config.num_experts or 0)
    assert saved.top_k_experts == (model.config.top_k_experts or 0)
