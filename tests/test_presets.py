"""Every preset, shapes only (no weights): the front end builds its IR, the IR's weights are
exactly the checkpoint's expected tensors, the released models have GEMMA4.md's parameter
counts, and the XLA program traces abstractly (jax.eval_shape) over the planned layout."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from rvcompile.ir.frontend import build_model_ir
from rvcompile.ir.graph import check_model
from rvcompile.model.config import AttnKind
from rvcompile.model.presets import PRESETS, get_preset
from rvcompile.sources.model_source import expected_tensors
from rvcompile.targets.xla.export import weight_layout
from rvcompile.targets.xla.program import (
    Program,
    cache_shapes,
    plan_layout,
    sampling_shapes,
    table_shapes,
    weight_shapes,
)

MAX_CONTEXT, MAX_CHUNK = 256, 32

# shared/GEMMA4.md, "Released models": text params (and E2B's per-layer-embedding table).
TEXT_PARAMS = {
    "gemma-4-E2B": 4.63e9,
    "gemma-4-E4B": 7.46e9,
    "gemma-4-12B": 11.9e9,
    "gemma-4-26B-A4B": 25.2e9,
    "gemma-4-31B": 30.7e9,
}
# (hidden, layers, period, query heads, sliding KV heads, full KV heads, K=V, window)
RELEASED = {
    "gemma-4-E2B": (1536, 35, 5, 8, 1, 1, False, 512),
    "gemma-4-E4B": (2560, 42, 6, 8, 2, 2, False, 512),
    "gemma-4-12B": (3840, 48, 6, 16, 8, 1, True, 1024),
    "gemma-4-26B-A4B": (2816, 30, 6, 16, 8, 2, True, 1024),
    "gemma-4-31B": (5376, 60, 6, 32, 16, 4, True, 1024),
}


@pytest.fixture(scope="module", params=list(PRESETS))
def preset(request):
    cfg = get_preset(request.param)
    return request.param, cfg, build_model_ir(cfg, max_context=MAX_CONTEXT, max_chunk=MAX_CHUNK)


def test_ir_weights_are_the_expected_tensors(preset):
    name, cfg, ir = preset
    check_model(ir)
    params = {p.name: tuple(p.shape) for p in ir.params}
    assert len(params) == len(ir.params)  # no weight listed twice
    assert params == expected_tensors(cfg)
    for p in ir.params:
        assert p.dtype == "float32" and p.derive == "copy" and p.source == p.name


def test_parameter_count(preset):
    name, cfg, ir = preset
    total = sum(math.prod(p.shape) for p in ir.params)
    if name not in TEXT_PARAMS:
        assert total < 10e6  # the tiny test presets
        return
    want = TEXT_PARAMS[name]
    assert abs(total - want) / want < 0.01, f"{name}: {total / 1e9:.3f}B, GEMMA4.md {want / 1e9}B"
    if name == "gemma-4-E2B":
        ple = math.prod(expected_tensors(cfg)["embed_tokens_per_layer.weight"])
        assert abs(ple - 2.35e9) / 2.35e9 < 0.01


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_layer_structure(name):
    cfg = get_preset(name)
    hidden, layers, period, heads, kv_s, kv_f, k_eq_v, window = RELEASED[name]
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.vocab_size) == (
        hidden, layers, heads, 262144)
    full = [s.index for s in cfg.layers if s.kind is AttnKind.FULL]
    assert full == [i for i in range(layers) if (i + 1) % period == 0 or i == layers - 1]
    for s in cfg.layers:
        src = cfg.layers[s.kv_source]
        if s.kind is AttnKind.FULL:
            assert (s.head_dim, src.num_kv_heads, s.k_eq_v, s.window) == (512, kv_f, k_eq_v,
                                                                          None)
        else:
            assert (s.head_dim, src.num_kv_heads, s.k_eq_v, s.window) == (256, kv_s, False,
                                                                          window)
        assert src.kind is s.kind and not src.kv_shared


def test_xla_program_traces(preset):
    """The layout covers every weight once and the entry points trace with the right shapes."""
    name, cfg, ir = preset
    plan = plan_layout(ir)
    assert sum(g.period * g.count for g in plan.groups) == cfg.num_layers
    slices = [full for _, _, full in plan.weight_slices(ir)]
    assert set(slices) == {p.name for p in ir.params}
    # A weight lands in more than one slice only where a KV-shared K=V layer reads its
    # producer's k_norm ("kv_source." params): a copy in the sharing layer's stack.
    twice = {n for n in slices if slices.count(n) > 1}
    assert all(n.endswith("self_attn.k_norm.weight") for n in twice)
    assert bool(twice) == any(s.kv_shared and s.k_eq_v for s in cfg.layers)
    sizes = {p.name: 4 * math.prod(p.shape) for p in ir.params}
    arrays, nbytes, slots = weight_layout(ir, plan)
    assert sum(a["nbytes"] for a in arrays) == sum(sizes[n] for n in slices)
    assert nbytes >= sum(a["nbytes"] for a in arrays)
    assert {n: len(v) for n, v in slots.items()} == {n: slices.count(n) for n in sizes}
    prog = Program(ir, plan)
    ws = weight_shapes(ir, plan)
    cs = cache_shapes(ir, plan, {k.name: 2 * k.table_width for k in prog.kinds.values()})

    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    caches, tok = jax.eval_shape(prog.step, ws, cs, i32(2, 1), i32(2), i32(2),
                                 table_shapes(prog.kinds, 2), *sampling_shapes(2))
    assert tok.shape == (2,)
    assert {k: (v.shape, v.dtype) for k, v in caches.items()} == \
        {k: (v.shape, v.dtype) for k, v in cs.items()}
    _, logits = jax.eval_shape(prog.logits, ws, cs, i32(1, MAX_CHUNK), i32(1), i32(1),
                               table_shapes(prog.kinds, 1))
    assert logits.shape == (1, MAX_CHUNK, cfg.vocab_size)
