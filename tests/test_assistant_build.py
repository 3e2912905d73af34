"""The assistant drafter as a user meets it: its config.json (the released E2B drafter's as
published), the presets' shapes, what does not fit a target refused in one line, the loader's
checks, and `rvcompile build --assistant` / `inspect` / `verify` as subprocesses, on tpu-int8 with
an int8 KV cache (quantized like the target, reading int8 pools blockwise; its drafts against the
IR's numpy references).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import make_oracle_assistant, save_oracle_assistant
from safetensors.numpy import load_file, save_file
from test_artifact_cli import RVCOMPILE, one_error_line, run

from rvcompile import runtime
from rvcompile.build import BuildOptions, build_artifact, lower_model
from rvcompile.ir.draft_frontend import add_assistant
from rvcompile.ir.frontend import build_model_ir
from rvcompile.ir.graph import check_model
from rvcompile.ir.interpret import ReferenceModel
from rvcompile.ir.ops import OPS, CentroidHeadAttrs, Op
from rvcompile.model.assistant import AssistantConfig
from rvcompile.model.config import AttnKind, ConfigError
from rvcompile.model.presets import ASSISTANT_PRESETS, get_assistant_preset, get_preset
from rvcompile.passes.weight_math import encode
from rvcompile.runtime.executor_api import (
    DraftLane,
    Sampling,
    SeqChunk,
    has_drafter,
    max_draft_tokens,
)
from rvcompile.sources.checkpoint import load_assistant_source, load_model_source
from rvcompile.sources.model_source import CheckpointError, expected_assistant_tensors
from rvcompile.targets.xla.program import (
    Program,
    cache_shapes,
    draft_shapes,
    plan_layout,
    sampling_shapes,
    table_shapes,
    weight_shapes,
)

# google/gemma-4-E2B-it-assistant's config.json, as a public log quotes it whole (bookkeeping
# keys such as id2label dropped).
E2B_ASSISTANT = {
    "architectures": ["Gemma4AssistantForCausalLM"], "backbone_hidden_size": 1536,
    "centroid_intermediate_top_k": 32, "dtype": "bfloat16", "model_type": "gemma4_assistant",
    "num_centroids": 2048, "tie_word_embeddings": True, "use_ordered_embeddings": True,
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "attention_k_eq_v": False,
        "bos_token_id": 2, "dtype": "bfloat16", "enable_moe_block": False, "eos_token_id": 1,
        "final_logit_softcapping": None, "global_head_dim": 512, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 256,
        "hidden_size_per_layer_input": 0, "initializer_range": 0.02,
        "intermediate_size": 2048,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "max_position_embeddings": 131072, "model_type": "gemma4_text",
        "moe_intermediate_size": None, "num_attention_heads": 4, "num_experts": None,
        "num_global_key_value_heads": None, "num_hidden_layers": 4, "num_key_value_heads": 1,
        "num_kv_shared_layers": 4, "pad_token_id": 0, "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                               "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
        "sliding_window": 512, "tie_word_embeddings": True, "top_k_experts": None,
        "use_bidirectional_attention": None, "use_cache": True, "use_double_wide_mlp": False,
        "vocab_size": 262144, "vocab_size_per_layer_input": 0,
    },
}


def with_changes(d: dict, **changes) -> dict:
    """A deep copy of config `d` with "text_config.key" or top-level keys replaced."""
    out = json.loads(json.dumps(d))
    for key, value in changes.items():
        where, _, name = key.rpartition("__")
        (out[where] if where else out)[name] = value
    return out


# ---------------------------------------------------------------------------------------------
# Config and presets


def test_released_e2b_config_is_the_preset():
    cfg = AssistantConfig.from_hf_dict(E2B_ASSISTANT, name="gemma-4-E2B-assistant")
    preset = get_assistant_preset("gemma-4-E2B-assistant")
    assert cfg.text.layers == preset.text.layers
    for field in ("model_type", "backbone_hidden_size", "use_ordered_embeddings",
                  "num_centroids", "centroid_intermediate_top_k"):
        assert getattr(cfg, field) == getattr(preset, field), field
    assert (cfg.hidden_size, cfg.text.num_heads, cfg.text.intermediate_size) == (256, 4, 2048)
    # Every drafter layer reads the E2B's last non-shared layer of its kind (20 of 35 shared).
    assert cfg.target_layers(get_preset("gemma-4-E2B")) == (13, 13, 13, 14)
    assert AssistantConfig.from_hf_dict(cfg.to_hf_dict(), name=cfg.name) == cfg


def test_e4b_preset_has_the_released_parameter_count():
    # 78.518M parameters: a load of google/gemma-4-E4B-it-assistant as a public probe reports.
    t = expected_assistant_tensors(get_assistant_preset("gemma-4-E4B-assistant"))
    total = sum(math.prod(s) for name, s in t.items() if not name.endswith("token_ordering"))
    assert abs(total - 78.518e6) < 1e3


@pytest.mark.parametrize("bad,needle", [
    ({"model_type": "gemma4_text"}, "model_type 'gemma4_text' is not a Gemma 4 assistant"),
    ({"backbone_hidden_size": None}, "'backbone_hidden_size' is missing"),
    ({"backbone_hidden_size": 0}, "backbone_hidden_size is 0"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings is false"),
    ({"num_centroids": 3000}, "num_centroids 3000 does not divide vocab_size 262144"),
    ({"centroid_intermediate_top_k": 4096}, "centroid_intermediate_top_k is 4096"),
    ({"text_config__hidden_size_per_layer_input": 256},
     "text_config.hidden_size_per_layer_input is 256"),
    ({"text_config__enable_moe_block": True}, "text_config.enable_moe_block is true"),
    ({"text_config__num_kv_shared_layers": 2}, "text_config.num_kv_shared_layers is 2"),
    ({"text_config__model_type": "llama"}, "text_config.model_type 'llama'"),
    ({"text_config__num_key_value_heads": 3},
     "text_config: layer 0: num_attention_heads 4 is not a multiple of its 3 KV heads"),
    ({"text_config__hidden_activation": "gelu"}, "text_config: hidden_activation \"gelu\""),
])
def test_config_refusals_name_the_key(bad, needle):
    with pytest.raises(ConfigError) as e:
        AssistantConfig.from_hf_dict(with_changes(E2B_ASSISTANT, **bad), source="c.json")
    assert str(e.value).startswith("c.json: ") and "\n" not in str(e.value)
    assert needle in str(e.value), str(e.value)


def test_num_kv_shared_layers_zero_means_all():
    cfg = AssistantConfig.from_hf_dict(with_changes(E2B_ASSISTANT,
                                                    text_config__num_kv_shared_layers=0))
    assert cfg.target_layers(get_preset("gemma-4-E2B")) == (13, 13, 13, 14)


def test_what_does_not_fit_the_target_is_refused():
    e2b, tiny = get_preset("gemma-4-E2B"), get_preset("gemma-4-tiny")
    drafter = get_assistant_preset("gemma-4-E2B-assistant")
    cases = [
        (get_preset("gemma-4-E4B"), "backbone_hidden_size 1536 is not the target's hidden_size "
                                    "2560"),
        (dataclasses.replace(e2b, vocab_size=1024, pad_token_id=0, bos_token_id=2,
                             eos_token_ids=(1,)),
         "text_config.vocab_size 262144 is not the target's vocab_size 1024"),
        (dataclasses.replace(e2b, num_kv_heads=2),
         "reads target layer 13's cache, which is (256, 2, False)"),
        (dataclasses.replace(e2b, sliding_window=256),
         "text_config.sliding_window 512 is longer than the target's 256"),
        (dataclasses.replace(e2b, layer_kinds=(AttnKind.FULL,) * 35),
         "text_config.layer_types[0] is sliding_attention, which the target has no layer of"),
    ]
    for target, needle in cases:
        with pytest.raises(ConfigError, match="does not fit") as e:
            drafter.target_layers(target)
        assert needle in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="backbone_hidden_size 1536"):
        drafter.target_layers(tiny)


@pytest.mark.parametrize("name", list(ASSISTANT_PRESETS))
def test_assistant_presets_shapes(name):
    """Shapes only: the drafter joins its target's IR, reads the target's last non-shared
    layer of each kind, and its weights are the expected assistant tensors."""
    a = get_assistant_preset(name)
    target = get_preset(name.removesuffix("-assistant"))
    ir = add_assistant(build_model_ir(target, max_context=256, max_chunk=32), a)
    check_model(ir)
    d = ir.assistant
    assert len(d.reads) == a.text.num_layers
    assert all(not target.layers[r].kv_shared for r in d.reads)
    ours = {p.name: tuple(p.shape) for p in ir.params if p.name.startswith("assistant.")}
    assert ours == expected_assistant_tensors(a)
    heads = [n.op for n in d.draft_out.nodes if n.op in (Op.CENTROID_HEAD, Op.LINEAR)]
    assert (Op.CENTROID_HEAD in heads) == a.use_ordered_embeddings
    # The XLA draft traces over the planned layout, the drafter's weights unstacked.
    plan = plan_layout(ir)
    assert set(expected_assistant_tensors(a)) <= set(plan.globals_)
    assert {full for _, _, full in plan.weight_slices(ir)} == {p.name for p in ir.params}
    prog = Program(ir, plan)
    b, k = 2, 3
    cs = cache_shapes(ir, plan, {kind.name: b * kind.table_width for kind in prog.kinds.values()})
    i32 = jax.ShapeDtypeStruct((b,), jnp.int32)
    toks, logits, probs, states = jax.eval_shape(
        functools.partial(prog.draft, max_steps=k), weight_shapes(ir, plan), cs,
        jax.ShapeDtypeStruct((b, 1), jnp.int32), i32, i32, table_shapes(prog.kinds, b),
        *draft_shapes(ir, b), *sampling_shapes(b), jax.ShapeDtypeStruct((), jnp.int32))
    assert (toks.shape, logits.shape, probs.shape, states.shape) == (
        (b, k), (b, k, target.vocab_size), (b, k, target.vocab_size), (b, k, target.hidden_size))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_centroid_head_lowering_is_its_reference(dtype):
    """CENTROID_HEAD in JAX = its numpy reference, a bf16 table and tied centroid logits (the
    lower cluster wins) included; CONCAT likewise."""
    import jax.numpy as jnp
    import ml_dtypes

    from rvcompile.targets.xla.lower import LOWERINGS

    rng = np.random.default_rng(4)
    a = CentroidHeadAttrs(top_k=3, clusters=8)
    h = rng.standard_normal((2, 3, 16)).astype(np.float32)
    cl = rng.standard_normal((2, 3, 8)).astype(np.float32)
    cl[0, 0, [1, 5]] = cl[0, 0].max() + 1  # a tie at the top
    cl[0, 1] = [0.1, 5, 3, 0.2, 4, 0.3, 3, 0]  # a tie at the cut: cluster 2 is scored, 6 not
    ordering = rng.permutation(64).astype(np.int32)
    table = rng.standard_normal((64, 16)).astype(np.float32)
    if dtype == "bfloat16":
        table = table.astype(ml_dtypes.bfloat16)
    ref = OPS[Op.CENTROID_HEAD].reference(a, h, cl, ordering, table)
    ours = np.asarray(LOWERINGS[Op.CENTROID_HEAD](a, jnp.asarray(h), jnp.asarray(cl),
                                                   jnp.asarray(ordering), jnp.asarray(table)))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5)
    scored = ref > ref.min(-1, keepdims=True)
    assert (scored.sum(-1) == 3 * 8).all()
    assert scored[0, 1][ordering.reshape(8, 8)[2]].all()
    assert not scored[0, 1][ordering.reshape(8, 8)[6]].any()
    x, y = h, rng.standard_normal((2, 3, 5)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(LOWERINGS[Op.CONCAT](None, x, y)),
                                  OPS[Op.CONCAT].reference(None, x, y))


# ---------------------------------------------------------------------------------------------
# The loader


@pytest.fixture
def adir(oracle_dir, tmp_path) -> Path:
    """A saved centroid-head drafter for the "kv_shared" oracle target, to damage."""
    return save_oracle_assistant(make_oracle_assistant("kv_shared", 3, ordered=True),
                                 tmp_path / "assistant")


def rewrite(adir: Path, fn) -> None:
    path = adir / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


def loads(adir: Path, oracle_dir):
    _, ckpt = oracle_dir("kv_shared")
    return load_assistant_source(str(adir), load_model_source(str(ckpt)).config)


def test_loader_reads_the_saved_drafter(adir, oracle_dir):
    src = loads(adir, oracle_dir)
    assert {t.name for t in src.tensors} == set(expected_assistant_tensors(src.config))
    ordering = next(t for t in src.tensors if t.name.endswith("token_ordering")).load()
    assert ordering.dtype == np.int32 and sorted(ordering) == list(range(1024))


@pytest.mark.parametrize("damage,needle", [
    (lambda t: t.update({"masked_embedding.token_ordering":
                         np.zeros(1024, np.int64)}), "token 0 appears 1024 times"),
    (lambda t: t.update({"masked_embedding.token_ordering":
                         np.arange(1024, dtype=np.int64) + 1}), "is 1024, not a token id"),
    (lambda t: t.update({"masked_embedding.token_ordering":
                         np.arange(1024, dtype=np.float32)}), "token ids are read from I64"),
    (lambda t: t.pop("post_projection.weight"), "missing tensor post_projection.weight"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight":
                         np.zeros((32, 32), np.float32)}), "unexpected tensor"),
    (lambda t: t.update({"pre_projection.weight": np.zeros((32, 64), np.float32)}),
     "has shape [32, 64], expected [32, 128]"),
])
def test_loader_refusals(adir, oracle_dir, damage, needle):
    rewrite(adir, damage)
    with pytest.raises(CheckpointError) as e:
        src = loads(adir, oracle_dir)
        for t in src.tensors:
            t.load()
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------
# The CLI: build, inspect, verify; a tpu-int8 drafter against the IR references

SMALL = ["--max-context", "64", "--prefill-buckets", "16", "--max-seqs", "1",
         "--platforms", "cpu", "--decode-loop-steps", "0"]
TINY = ["gemma-4-tiny", "--random-weights", "--seed", "3"]
OPTS = BuildOptions("tpu-int8", max_context=64, prefill_buckets=(16,), max_seqs=1,
                    platforms=("cpu",), draft_tokens=3, kv_cache="int8")


@pytest.fixture(scope="module")
def int8_artifact(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("spec-cli") / "tiny.rvp"
    p = run(RVCOMPILE, "build", *TINY, "--target", "tpu-int8", "--kv-cache", "int8", *SMALL,
            "--assistant", "gemma-4-tiny-assistant", "-o", str(out))
    assert p.returncode == 0, p.stderr
    return out


def test_inspect_and_verify_show_the_drafter(int8_artifact):
    p = run(RVCOMPILE, "inspect", str(int8_artifact), "--json")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert "draft_1" in info["entry_points"] and "verify_1x4" in info["entry_points"]
    a = info["assistant"]
    assert (a["name"], a["hidden_size"], a["reads"], a["draft_tokens"]) == (
        "gemma-4-tiny-assistant", 64, [2, 3], 3)
    assert a["head"] == "centroids 16, top 4"
    text = run(RVCOMPILE, "inspect", str(int8_artifact)).stdout
    assert "assistant         gemma-4-tiny-assistant (gemma4_assistant" in text
    assert "speculative       up to 3 drafts: verify_1x4, draft_1" in text
    p = run(RVCOMPILE, "verify", str(int8_artifact))
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr


def test_int8_drafter_against_the_ir(int8_artifact):
    """The drafter is quantized like the target (its linears int8, its centroid scores and
    centroid-head table not), reads the int8 KV pools, and the XLA drafts follow the same IR's
    numpy references."""
    source = load_model_source("gemma-4-tiny", random_weights=True, seed=3)
    asrc = load_assistant_source("gemma-4-tiny-assistant", source.config, random_weights=True,
                                 seed=3)
    ir = lower_model(source, OPTS, lambda s: None, asrc.config)
    assert {c.dtype for c in ir.caches} == {"int8"}
    dtypes = {p.name: p.dtype for p in ir.params}
    assert dtypes["assistant.pre_projection.weight"] == "int8"
    assert dtypes["assistant.layers.0.mlp.down_proj.weight"] == "int8"
    assert dtypes["assistant.masked_embedding.centroids.weight"] == "bfloat16"
    assert dtypes["assistant.embed_tokens.weight"] == "bfloat16"  # read by CENTROID_HEAD only
    assert dtypes["assistant.masked_embedding.token_ordering"] == "int32"
    tensors = {t.name: t.load() for t in (*source.tensors, *asrc.tensors)}
    ref = ReferenceModel(ir, {p.name: encode(p.derive, tensors[p.source]) for p in ir.params})

    ex = runtime.load(int8_artifact).executor
    assert max_draft_tokens(ex) == 3 and has_drafter(ex)
    tables = {k.name: list(range(k.table_width)) for k in ex.kinds.values()}
    prompt = list(np.random.default_rng(5).integers(4, 1024, 14))
    x = ex.prefill(SeqChunk(prompt, 0, tables))
    verified = ex.verify([SeqChunk([x], 14, tables, step=1)])[0]
    state = verified.states[0]
    drafted = ex.draft([DraftLane(SeqChunk([verified.tokens[0]], 15, tables, step=2), state)],
                       3)[0]
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, :15] = [*prompt, x]
    ref.step(tokens, np.array([0]), np.array([15]))
    hidden = np.asarray(state.rows[state.lane, state.row])[None]
    t = np.array([verified.tokens[0]])
    errs, agree = [], []
    for i in range(3):
        logits, hidden = ref.draft(t, hidden, np.array([15]))
        ours = np.asarray(drafted.logits[i])
        errs.append(float(np.abs(ours - logits[0]).max()))
        agree.append(int(ours.argmax()) == int(logits[0].argmax()))
        t = np.array([drafted.tokens[i]])
    print(f"\n[measured] int8 drafter XLA vs IR: max abs per step {errs}, top-1 {agree}")
    # The same int8 / bf16 arithmetic on both sides. Measured: 1.2e-7 at most; over longer runs
    # float32 summation order can move a value across a bf16 rounding boundary (test_passes),
    # which these few steps of a fresh sequence have not done.
    assert max(errs) <= 1e-4 and all(agree)


@pytest.mark.parametrize("extra,needles", [
    (["--assistant", "gemma-4-31B-assistant", "--target", "xla-f32"],
     ("gemma-4-31B-assistant does not fit gemma-4-tiny", "backbone_hidden_size 5376")),
    (["--assistant", "gemma-4-nonesuch", "--target", "xla-f32"],
     ("--assistant gemma-4-nonesuch: not an assistant directory",)),
    (["--assistant", "gemma-4-tiny-assistant", "--target", "h100-fp8", "--platforms", "cuda",
      "--tp", "2"],
     ("--assistant with --tp 2: target h100-fp8 drafts on one GPU only",)),
    (["--assistant", "gemma-4-tiny-assistant", "--target", "xla-f32",
      "--num-draft-tokens", "15"], ("--num-draft-tokens 15: with --assistant, expected 1 to 14",)),
])
def test_cli_refusals(tmp_path, extra, needles):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    p = run(RVCOMPILE, "build", *TINY, *SMALL, *extra, "-o", str(out_dir / "x.rvp"))
    one_error_line(p, "rvcompile", *needles)
    assert list(out_dir.iterdir()) == []


def test_assistant_preset_needs_random_weights(oracle_dir, tmp_path):
    _, ckpt = oracle_dir("kv_shared")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    p = run(RVCOMPILE, "build", str(ckpt), "--target", "xla-f32", *SMALL, "--assistant",
            "gemma-4-tiny-assistant", "-o", str(out_dir / "x.rvp"))
    one_error_line(p, "rvcompile", "an assistant preset has no weights of its own")
    assert list(out_dir.iterdir()) == []


def test_cli_refuses_a_damaged_assistant_directory(adir, oracle_dir, tmp_path):
    _, ckpt = oracle_dir("kv_shared")
    bad = Path(shutil.copytree(adir, tmp_path / "bad"))
    config = json.loads((bad / "config.json").read_text())
    config["backbone_hidden_size"] = 32
    (bad / "config.json").write_text(json.dumps(config))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    p = run(RVCOMPILE, "build", str(ckpt), "--target", "xla-f32", *SMALL, "--assistant",
            str(bad), "-o", str(out_dir / "x.rvp"))
    one_error_line(p, "rvcompile", "does not fit", "backbone_hidden_size 32")
    assert list(out_dir.iterdir()) == []


def test_verify_without_an_assistant_keeps_the_targets_tokens(tmp_path):
    """--num-draft-tokens without --assistant: verify alone (drafts from elsewhere, e.g. n-gram
    lookup). With drafts whose first c are right, exact-match acceptance gives the tokens plain
    decoding gives, greedy and seeded sampling alike (row i samples at RNG step step + i)."""
    out = tmp_path / "verify.rvp"
    opts = BuildOptions("xla-f32", max_context=64, prefill_buckets=(8,), max_seqs=1,
                        platforms=("cpu",), draft_tokens=2)
    build_artifact("gemma-4-tiny-dense", out, opts, random_weights=True, seed=1, progress=False,
                   log=lambda s: None)
    ex = runtime.load(out).executor
    assert max_draft_tokens(ex) == 2 and not has_drafter(ex)
    tables = {k.name: list(range(k.table_width)) for k in ex.kinds.values()}
    prompt = list(np.random.default_rng(9).integers(4, 1024, 8))
    n_new = 16
    for sampling in (Sampling(), Sampling(temperature=0.8, top_k=20, seed=7)):
        plain = [ex.prefill(SeqChunk(prompt, 0, tables, sampling=sampling))]
        while len(plain) < n_new:
            lane = SeqChunk([plain[-1]], 7 + len(plain), tables, sampling=sampling,
                            step=len(plain))
            plain += ex.decode([lane])
        spec = [ex.prefill(SeqChunk(prompt, 0, tables, sampling=sampling))]
        rounds = 0
        while len(spec) < n_new:
            c = rounds % 3
            right = plain[len(spec):len(spec) + 2]
            drafts = [*right[:c], *[(t + 1) % 1024 for t in right[c:]]]
            v = ex.verify([SeqChunk([spec[-1], *drafts], 7 + len(spec), tables,
                                    sampling=sampling, step=len(spec))])[0]
            assert v.states == () and len(v.tokens) == 1 + len(drafts)
            m = 0
            while m < len(drafts) and drafts[m] == v.tokens[m]:
                m += 1
            assert m == len(right[:c])
            spec += [*drafts[:m], v.tokens[m]]
            rounds += 1
        assert spec[:n_new] == plain, sampling
