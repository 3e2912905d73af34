"""Tensor parallelism on the XLA target (`--tp N`, targets/xla/sharding.py).

- Same tokens: on 4 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4, in a
  subprocess, since the flag must be set before jax starts and the other tests keep one device),
  xla-f32 builds of every oracle case at TP=1, 2 and 4 (and the "all" case with 8 query heads at
  TP=1 and 8, on 8 devices) give the same greedy tokens, and logits
  within float32 reduction-order rounding of the TP=1 build (the row-parallel O/down projections
  sum their partial products in another order; measured figures at TP_LOGIT_BOUND). The
  compiled programs all-gather no weight, KV pool or activation matrix.
- The rules: which arrays split on which axis, KV heads fewer than devices stay whole, counts
  that do not divide are refused naming the field; h100-fp8 refuses --tp.
- The artifact: manifest xla.mesh, header min_devices, `rvcompile inspect`; a host with too few
  devices is refused in one line before any weight is read. Built for TPU alone, its pools are
  fixed at build (manifest xla.kv.fixed_blocks, the programs' block counts): the runtime's
  resolver takes those counts only, refusing another in one line; other artifacts' pools stay
  symbolic and sized at load.
- The released 31B and 26B-A4B at a few layers export with --tp 4 (tpu-int8, no devices needed).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from cli_output import without_progress

from rvcompile.build import BuildOptions

TPS = (1, 2, 4)
CASES = ("dense", "k_eq_v", "kv_shared", "ple", "moe")
OPTS = {"max_context": 128, "prefill_buckets": (32,), "max_seqs": 2, "platforms": ("cpu",)}
SEQ, PROMPT, N_NEW = 40, 12, 16
# Measured max abs logit difference vs TP=1 over 40 positions (logits std ~1.2), TP=2 / TP=4
# (with each KV head stored tp / K times where K < tp, program.kv_copies): dense 9.8e-6 /
# 6.7e-6, k_eq_v 1.0e-5 / 7.9e-6, kv_shared 9.3e-6 / 8.9e-6, ple 8.3e-6 / 7.5e-6, moe 7.3e-6 /
# 6.4e-6; TP=8, the "all" case with 8 query heads: 2.0e-5. A wrong split (a head or expert
# lost, a double-counted all-reduce) moves logits by O(1).
TP_LOGIT_BOUND = 5e-5
# With int8 KV the same logits differ more: the projections' float32 rounding at another degree
# moves a K or V value across an int8 rounding boundary now and then, one step of its row's
# scale. The oracle's dense case, TP = 2 vs 1: 5.76e-3, on main at 4baa4d2 (scale blocks at
# every degree) as with row scale pools at TP = 1 (h/scales); its 4-KV-head variant 1.19e-2,
# the same with row pools at both degrees and with blocks at both (main at b530587). A head's
# scales read from another head's lanes moves logits by O(1).
TP_INT8_KV_LOGIT_BOUND = 2e-2
MAX_GATHER = 64  # elements of the largest all-gather (other than logits) a program may hold


def _child(ckpt: str, out: str, ids: list[int], prompt: list[int], tps: list[int],
           kv_cache: str) -> None:
    """Runs in the subprocess with max(tps) devices: build and run each TP degree of `tps`
    (KV cache `kv_cache`, BuildOptions.kv_cache); write logits and tokens."""
    import jax

    from rvcompile import runtime
    from rvcompile.build import build_artifact

    assert len(jax.devices()) == max(tps), jax.devices()
    result = {}
    for tp in tps:
        path = Path(out) / f"tp{tp}.rvp"
        build_artifact(ckpt, path, BuildOptions("xla-f32", tp=tp, kv_cache=kv_cache, **OPTS),
                       progress=False, log=lambda s: None)
        m = runtime.load(path)
        np.save(Path(out) / f"logits{tp}.npy", m.logits(ids))
        res = m.generate(prompt, max_tokens=N_NEW, ignore_eos=True)
        mesh = m.manifest["xla"].get("mesh")
        vocab = m.manifest["model"]["config"]["vocab_size"]
        gathers = [int(np.prod(shape)) for fn in m.executor.fns.values()
                   for dims in re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", fn.as_text())
                   if (shape := [int(x) for x in dims.split(",") if x])[-1:] != [vocab]]
        result[tp] = {"tokens": res.token_ids, "mesh": mesh["size"] if mesh else None,
                      "devices": len({d for w in m.executor.weights.values()
                                      for d in w.sharding.device_set}),
                      "largest_all_gather": max(gathers, default=0),
                      "pools_split": bool(mesh) and all("tp" in spec for spec in
                                                        mesh["pools"].values())}
    print(json.dumps(result))


def _four_devices(*args: str, devices: int = 4) -> subprocess.CompletedProcess:
    """Run `_child` with 4 (or `devices`) CPU devices. XLA's backend optimizations are off
    there: compiling 12 programs per case is this test's whole cost (~40 -> ~25 CPU-s a case),
    the SPMD partitioning under test runs either way, and TP=1 is compiled the same way. (With
    them on, the same assertions held, same figures; test_oracle covers the optimized TP=1
    programs.)"""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    return subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          env=env, timeout=600, cwd=Path(__file__).parent)


def _same_tokens(ckpt: Path, tmp_path: Path, case: str, tps: tuple[int, ...],
                 kv_cache: str = "auto", bound: float = TP_LOGIT_BOUND) -> dict:
    """Build and run `ckpt` at each TP degree of `tps` (1 first) on max(tps) CPU devices: the
    same tokens as TP=1, logits within TP_LOGIT_BOUND, no large all-gather; returns what each
    degree's child reported."""
    from oracle import random_token_ids

    ids = random_token_ids(SEQ, seed=21).tolist()
    prompt = random_token_ids(PROMPT, seed=22).tolist()
    env_cache = tmp_path / "cache"
    p = _four_devices(str(ckpt), str(tmp_path), json.dumps(ids), json.dumps(prompt),
                      str(env_cache), json.dumps(tps), kv_cache, devices=max(tps))
    assert p.returncode == 0, p.stderr[-3000:]
    result = {int(k): v for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}
    ref = np.load(tmp_path / "logits1.npy")
    assert result[1]["mesh"] is None and result[1]["devices"] == 1
    for tp in tps[1:]:
        assert result[tp]["mesh"] == tp and result[tp]["devices"] == tp
        assert result[tp]["tokens"] == result[1]["tokens"], f"tp={tp}"
        # Besides the vocab-split logits (gathered for sampling), only small vectors are
        # gathered (the MoE's [E] int32 group sizes, sampling's [B, k] candidates): no
        # weight, KV pool or hidden state moves (an unhinted scan once gathered whole pools).
        assert result[tp]["largest_all_gather"] <= MAX_GATHER, result[tp]
        diff = np.abs(np.load(tmp_path / f"logits{tp}.npy") - ref).max()
        print(f"\n[measured] {case} tp={tp} vs tp=1: max abs logit difference {diff:.2e}")
        assert diff <= bound, f"{case} tp={tp}: {diff:.3g}"
    return result


@pytest.mark.parametrize("case", CASES)
def test_tp_gives_the_same_tokens(oracle_dir, tmp_path, case):
    _, ckpt = oracle_dir(case)
    _same_tokens(ckpt, tmp_path, case, TPS)


def test_tp_gives_the_same_tokens_int8_kv(oracle_dir, tmp_path):
    """The same with int8 KV pools (logits within TP_INT8_KV_LOGIT_BOUND): at TP = 1 the
    scales are row pools (2 heads a device, lower.scale_block_shape), at TP = 2 and 4 blocks
    [16, 1] (one head or copy a device), so TP = 1's tokens and logits check the row pools'
    writes and reads against the blocks' too."""
    _, ckpt = oracle_dir("dense")
    _same_tokens(ckpt, tmp_path, "dense_int8_kv", TPS, "int8", TP_INT8_KV_LOGIT_BOUND)


def test_tp_int8_kv_row_pools_split_over_devices(oracle_dir, tmp_path):
    """int8 KV with 4 KV heads (8 query heads): at TP = 2 each device holds 2 heads, so its
    scales are row pools split by head over the devices (lower.scale_block_shape), against TP =
    1's rows of all 4: the same tokens, logits within TP_INT8_KV_LOGIT_BOUND."""
    from unittest import mock

    from oracle import ORACLE_CASES

    four = {**ORACLE_CASES["dense"], "num_attention_heads": 8, "num_key_value_heads": 4}
    with mock.patch.dict(ORACLE_CASES, {"dense_4_kv_heads": four}):
        _, ckpt = oracle_dir("dense_4_kv_heads")
    _same_tokens(ckpt, tmp_path, "dense_4_kv_heads_int8_kv", (1, 2), "int8",
                 TP_INT8_KV_LOGIT_BOUND)


# The oracle's "all" case (K=V, KV sharing + double-wide MLP, PLE, MoE) with 8 query heads, so
# that it splits over 8 devices: its 2 sliding and 1 global KV heads are stored 4 and 8 times
# each (program.kv_copies), its MoE's 32 intermediate rows 4 a device.
TP8_CASE = {"num_attention_heads": 8}


def test_tp8_gives_the_same_tokens(oracle_dir, tmp_path):
    """TP=8 on 8 forced CPU devices gives TP=1's tokens, logits within TP_LOGIT_BOUND."""
    from unittest import mock

    from oracle import ORACLE_CASES

    with mock.patch.dict(ORACLE_CASES, {"all_8_heads": {**ORACLE_CASES["all"], **TP8_CASE}}):
        _, ckpt = oracle_dir("all_8_heads")
    result = _same_tokens(ckpt, tmp_path, "all_8_heads", (1, 8))
    assert result[8]["pools_split"], "every pool holds one head (copy) a device"


# ---------------------------------------------------------------------------------------------
# The rules


def _ir(case_or_preset: str, target: str = "xla-f32", layers: int | None = None):
    from rvcompile.build import lower_model
    from rvcompile.sources.checkpoint import load_model_source

    source = load_model_source(case_or_preset, random_weights=True)
    if layers:
        cfg = source.config
        source = replace(source, config=replace(cfg, num_layers=layers,
                                                layer_kinds=cfg.layer_kinds[:layers]))
    return lower_model(source, BuildOptions(target, max_context=256, prefill_buckets=(16, 64)),
                       log=lambda s: None)


@pytest.fixture(scope="module")
def tiny_ir():
    return _ir("gemma-4-tiny", "tpu-int8")


def test_split_rules(tiny_ir):
    from rvcompile.targets.xla.program import cache_pools, plan_layout, pool_heads
    from rvcompile.targets.xla.sharding import plan_tp

    plan = plan_layout(tiny_ir)
    two, four = plan_tp(tiny_ir, plan, 2), plan_tp(tiny_ir, plan, 4)
    by_rel = {}
    for sp in plan.stacked:
        by_rel.setdefault(sp.rel, []).append(sp.key)

    def spec(layout, rel):
        return {tuple(layout.weights[k]) for k in by_rel[rel]}

    col, row, whole = (None, "tp", None), (None, None, "tp"), (None, None, None)
    assert spec(two, "self_attn.q_proj.weight") == {col}
    assert spec(two, "self_attn.q_proj.weight.scale") == {(None, "tp")}
    assert spec(two, "self_attn.o_proj.weight") == {row}
    assert spec(two, "self_attn.o_proj.weight.scale") == {(None, None)}
    assert spec(two, "mlp.gate_proj.weight") == spec(two, "mlp.up_proj.weight") == {col}
    assert spec(two, "mlp.down_proj.weight") == {row}
    # experts: each one's intermediate dimension I, in the layout's [E, 2, I, H] view of
    # gate/up; down_proj [E, H, I] on its columns, its per-output-row scale whole
    assert spec(two, "experts.gate_up_proj") == {(None, None, None, "tp", None)}
    assert spec(two, "experts.gate_up_proj.scale") == {(None, None, None, "tp")}
    assert spec(two, "experts.down_proj") == {(None, None, None, "tp")}
    assert spec(two, "experts.down_proj.scale") == {(None, None, None)}
    assert spec(two, "router.proj.weight") == {whole}
    assert spec(two, "per_layer_input_gate.weight") == {whole}
    # embedding tables (the token table is the tied head) split by vocabulary row
    assert two.weights["embed_tokens.weight"] == ("tp", None)
    assert two.weights["embed_tokens.weight.scale"] == ("tp",)
    assert two.weights["embed_tokens_per_layer.weight"] == ("tp", None)
    assert two.weights["norm.weight"] == (None,)
    # KV heads: split where a layer has at least tp of them, whole (and computed on every
    # device) where it has fewer.
    kv = {tiny_ir.config.layers[plan.groups[sp.group].layer(0, sp.j)].num_kv_heads
          for sp in plan.stacked if sp.rel == "self_attn.k_proj.weight"}
    assert kv == {1, 2}, "the tiny preset should have layers with 1 and 2 KV heads"
    for sp in plan.stacked:
        if sp.rel != "self_attn.k_proj.weight":
            continue
        heads = tiny_ir.config.layers[plan.groups[sp.group].layer(0, sp.j)].num_kv_heads
        assert tuple(two.weights[sp.key]) == (col if heads >= 2 else whole)
        assert tuple(four.weights[sp.key]) == whole
    heads = pool_heads(tiny_ir, plan)
    for tp, layout in ((2, two), (4, four)):
        pools = cache_pools(tiny_ir, plan, tp)
        for key, (_, _, block, _) in cache_pools(tiny_ir, plan).items():
            # [layers, blocks, 16, K * D] (a scale pool: K), split into whole heads' columns;
            # fewer heads than devices: each head stored tp / K times, one copy a device
            assert len(block) == 2 and block[-1] % heads[key] == 0
            copies = max(1, tp // heads[key])
            assert pools[key][2] == (block[0], block[1] * copies), (key, tp)
            assert pool_heads(tiny_ir, plan, tp)[key] == heads[key] * copies
            assert tuple(layout.pools[key]) == (None, None, None, "tp")


@pytest.mark.parametrize("tp,field", [(3, "num_attention_heads"), (8, "num_attention_heads")])
def test_uneven_split_refused(tiny_ir, tp, field):
    from rvcompile.model.config import ConfigError
    from rvcompile.targets.xla.sharding import check_tp

    with pytest.raises(ConfigError, match=f"{field} 4 does not split over --tp {tp}"):
        check_tp(tiny_ir.config, tp)


def test_uneven_kv_heads_refused():
    from rvcompile.model.config import ConfigError
    from rvcompile.model.presets import get_preset
    from rvcompile.targets.xla.sharding import check_tp

    cfg = replace(get_preset("gemma-4-26B-A4B"), num_kv_heads=6, num_heads=12)
    with pytest.raises(ConfigError, match="num_key_value_heads 6 does not split over --tp 4"):
        check_tp(cfg, 4)
    cfg = get_preset("gemma-4-26B-A4B")
    with pytest.raises(ConfigError, match="num_global_key_value_heads 6 does not split"):
        check_tp(replace(cfg, num_heads=24, num_global_kv_heads=6), 4)
    check_tp(cfg, 4)  # 2 global KV heads < 4 devices: replicated, not refused


# ---------------------------------------------------------------------------------------------
# The artifact and the runtime


def _rvcompile(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "rvcompile"), *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})


@pytest.fixture(scope="module")
def tp2_artifact(tmp_path_factory) -> Path:
    from rvcompile.build import build_artifact

    out = tmp_path_factory.mktemp("tp") / "tiny-tp2.rvp"
    build_artifact("gemma-4-tiny", out, BuildOptions("tpu-int8", tp=2, **OPTS),
                   random_weights=True, progress=False, log=lambda s: None)
    return out


def test_manifest_records_the_mesh(tp2_artifact):
    from rvcompile.artifacts import Artifact

    with Artifact.open(tp2_artifact) as art:
        mesh = art.manifest["xla"]["mesh"]
        keys = {a["key"] for a in art.manifest["xla"]["weights"]}
        pools = {p["key"] for p in art.manifest["xla"]["kv"]["pools"]}
        assert art.header.requirements["min_devices"] == 2
    assert (mesh["axis"], mesh["size"]) == ("tp", 2)
    assert set(mesh["weights"]) == keys and set(mesh["pools"]) == pools
    assert mesh["weights"]["embed_tokens.weight"] == ["tp", None]
    assert mesh["weights"]["norm.weight"] == [None]
    assert any(spec == [None, "tp", None] for spec in mesh["weights"].values())
    p = _rvcompile("inspect", str(tp2_artifact))
    assert p.returncode == 0, p.stderr
    line = next(s for s in p.stdout.splitlines() if s.startswith("mesh"))
    assert "tp=2" in line
    assert "self_attn.q_proj.weight" in p.stdout and "P(None, 'tp', None)" in p.stdout


def test_too_few_devices_refused(tp2_artifact, tmp_path):
    """This process has jax's default CPU device count (1, unless XLA_FLAGS says more)."""
    import jax

    from rvcompile import runtime
    from rvcompile.artifacts import ArtifactError
    from rvcompile.build import build_artifact

    have = len(jax.local_devices())
    path = tp2_artifact
    if have >= 2:
        path = tmp_path / "big.rvp"
        build_artifact("gemma-4-tiny", path, BuildOptions("tpu-int8", tp=2 * have, **OPTS),
                       random_weights=True, progress=False, log=lambda s: None)
    need = 2 if have < 2 else 2 * have
    with pytest.raises(ArtifactError, match=rf"^{path.name} needs {need} cpu devices "
                                            rf"\(tp={need}\); this host has {have}$"):
        runtime.load(path)


def test_tpu_only_tp_artifact_has_fixed_pools(tp2_artifact, tmp_path):
    """`--platforms tpu --tp 2`: the manifest says the pools are fixed at a whole sequence per
    decode slot, the programs take exactly those counts (checked against the manifest as at
    load), `inspect` says so, and the runtime's resolver (executors/xla.kv_kinds, which load
    runs before anything is read; no TPU here to load it on) refuses any other count in one
    line. The same build for several platforms keeps symbolic pools, sized at load."""
    from rvcompile.artifacts import Artifact, ArtifactError
    from rvcompile.artifacts.manifest import read_manifest
    from rvcompile.artifacts.xla_programs import xla_programs
    from rvcompile.build import build_artifact
    from rvcompile.runtime.executors.xla import kv_kinds

    path = tmp_path / "tiny-tp2-tpu.rvp"
    build_artifact("gemma-4-tiny", path, BuildOptions("tpu-int8", tp=2,
                                                      **{**OPTS, "platforms": ("tpu",)}),
                   random_weights=True, progress=False, log=lambda s: None)
    with Artifact.open(path) as art:
        assert art.manifest["xla"]["kv"]["fixed_blocks"] is True
        xla = read_manifest(art).xla
        programs = xla_programs(art, xla)
    assert xla.fixed_blocks
    fixed = {k.name: k.default_blocks for k in xla.kinds.values()}
    assert fixed == {k.name: 2 * k.table_width for k in xla.kinds.values()}  # max_seqs 2
    pools = _pool_shapes(programs["decode_2"])
    assert {key: shape[1] for key, shape in pools.items()} == {
        p.key: fixed[p.kind] for p in xla.pools}
    assert {k.name: k.num_blocks for k in kv_kinds(xla, None, path.name).values()} == fixed
    assert kv_kinds(xla, {"sliding": fixed["sliding"]}, path.name)["sliding"].num_blocks == \
        fixed["sliding"]
    want = (rf"^{path.name}: kv_blocks \{{'sliding': {fixed['sliding'] + 1}\}} differ from its "
            rf"KV pools, fixed at build \(manifest xla.kv.fixed_blocks\) at "
            rf"\{{'full': {fixed['full']}, 'sliding': {fixed['sliding']}\}}; load it without "
            rf"kv_blocks$")
    with pytest.raises(ArtifactError, match=want):
        kv_kinds(xla, {"sliding": fixed["sliding"] + 1}, path.name)
    p = _rvcompile("inspect", str(path))
    assert p.returncode == 0, p.stderr
    assert (f"kv_blocks         fixed at build: {fixed['full']} full, {fixed['sliding']} "
            "sliding (rvrun takes no other)") in p.stdout.splitlines()

    # for several platforms (here the CPU): symbolic pools, any count at load, as before
    with Artifact.open(tp2_artifact) as art:
        assert "fixed_blocks" not in art.manifest["xla"]["kv"]
        sym = read_manifest(art).xla
        sym_programs = xla_programs(art, sym)
        assert not sym.fixed_blocks
        assert kv_kinds(sym, {"sliding": 5}, "x")["sliding"].num_blocks == 5
        # a manifest claiming fixed pools for programs with symbolic ones is refused
        with pytest.raises(ArtifactError, match=r"takes pool .* the manifest says"):
            xla_programs(art, replace(sym, fixed_blocks=True))
    assert all(not isinstance(shape[1], int) for shape in _pool_shapes(sym_programs["decode_2"])
               .values())


def _pool_shapes(exp) -> dict[str, tuple]:
    """A program's KV pool arguments' shapes, by key."""
    import jax

    return {key: aval.shape for key, aval in
            jax.tree.unflatten(exp.in_tree, exp.in_avals)[0][1].items()}


def test_cli_refuses_tp_it_cannot_do(tmp_path):
    out = tmp_path / "x.rvp"
    for target, tp, needle in [("h100-fp8", 3, "--tp 3: target h100-fp8 splits over 2, 4, 8"),
                               ("xla-f32", 3, "num_attention_heads 4 does not split over --tp 3")]:
        p = _rvcompile("build", "gemma-4-tiny", "--target", target, "--random-weights",
                       "--tp", str(tp), "-o", str(out), "--max-context", "128",
                       "--prefill-buckets", "32")
        assert p.returncode == 2
        lines = without_progress(p.stderr)
        assert len(lines) == 1 and needle in lines[0], p.stderr
        assert not out.exists()


@pytest.mark.parametrize("preset", ["gemma-4-31B", "gemma-4-26B-A4B"])
def test_released_models_export_with_tp4(preset):
    """6 layers (one pattern period), tpu-int8, TP=4: every entry point exports with the mesh's
    shardings; every KV pool splits: the 31B's 16 sliding / 4 global KV heads, and the
    26B-A4B's 2 global KV heads stored twice each (program.kv_copies), one head a device; the
    26B-A4B splits each of its 128 experts' 704 intermediate rows, 176 per device."""
    from jax import export

    from rvcompile.targets.xla.export import lower_to_xla

    ir = _ir(preset, "tpu-int8", layers=6)
    low = lower_to_xla(ir, max_seqs=2, prefill_buckets=(16, 64), platforms=("tpu",), tp=4)
    mesh = low.manifest["mesh"]
    for name in ("decode_2", "prefill_64"):
        exp = export.deserialize(bytearray(low.programs[name]))
        assert exp.nr_devices == 4
    global_pool = next(p for p in low.manifest["kv"]["pools"] if p["kind"] == "full")
    assert mesh["pools"][global_pool["key"]] == [None, None, None, "tp"]
    # 26B-A4B's 2 global KV heads (of 512) are stored twice each, one copy a device
    assert global_pool["block_shape"] == [16, 4 * 512]
    assert all(s == [None, None, None, "tp"] for k, s in mesh["pools"].items()
               if next(p for p in low.manifest["kv"]["pools"] if p["key"] == k)["kind"]
               == "sliding")
    if preset == "gemma-4-26B-A4B":
        experts = [s for k, s in mesh["weights"].items() if k.endswith("experts.gate_up_proj")]
        assert experts and all(s == [None, None, None, "tp", None] for s in experts)
        shapes = {w["key"]: w["shape"] for w in low.manifest["weights"]}
        assert {tuple(shapes[k]) for k in mesh["weights"] if k.endswith("gate_up_proj")} == {
            (1, 128, 2, 704, 2816)}  # the layout's view of [E, 2 * 704, H]; one period


def _span_dots_child() -> None:
    """Blockwise attention over pools split by KV head on a mesh of 2 and of 4 CPU devices
    against no mesh: {case: max abs difference / max abs value}, and whether the program ran
    the per-head dots in shard_map."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rvcompile.ir import ops
    from rvcompile.targets.xla import lower

    rng = np.random.default_rng(5)
    width, d, group = 8, 64, 2
    cache_len = jnp.asarray([100, 37, 0], jnp.int32)
    out = {}
    for kh, tp, window in ((4, 2, None), (4, 2, 40), (8, 4, 40), (2, 4, None)):
        pool = jnp.asarray(rng.standard_normal((2, 3 * width, 16, kh * d)).astype(np.float32))
        table = jnp.asarray(rng.permutation(3 * width).reshape(3, width).astype(np.int32))
        q = jnp.asarray(rng.standard_normal((3, 1, kh * group, d)).astype(np.float32))
        mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
        ring = window is not None

        def attend(q, pool, mesh, table=table, ring=ring, kh=kh, window=window):
            cache = lower.PagedSlice(pool, 1, table, ring, kh)
            k_pos = lower.cache_positions(ops.CachePositionsAttrs(width * 16, ring), cache_len)
            return lower.attention_blockwise(ops.AttentionAttrs(window=window, scale=1.0), q,
                                             cache, cache, (cache_len - 1)[:, None], k_pos,
                                             mesh=mesh)

        ref = np.asarray(jax.jit(lambda q, p: attend(q, p, None))(q, pool))
        split = (jax.device_put(q, NamedSharding(mesh, PartitionSpec(None, None, "tp"))),
                 jax.device_put(pool, NamedSharding(mesh, PartitionSpec(None, None, None,
                                                                        "tp" if kh >= tp
                                                                        else None))))
        fn = jax.jit(lambda q, p, mesh=mesh: attend(q, p, mesh))
        got = np.asarray(fn(*split))
        out[f"kh{kh}_tp{tp}_w{window}"] = {
            "err": float(np.abs(got - ref).max() / np.abs(ref).max()),
            "shard_map": "shard_map" in str(jax.make_jaxpr(fn)(*split)),
            "idle_lane_zero": not got[2].any()}
    print(json.dumps(out))


def test_span_dots_per_head_under_tp():
    """lower.span_dots under tensor parallelism: with 2 KV heads a device (kh 4 on 2 devices, 8
    on 4) the per-head dots run in shard_map over each device's heads, one head a device or
    fewer heads than devices keep the batched dot; every form equals the attention without a
    mesh within float32 rounding (the oracle's TP cases have 2 KV heads: 1 a device or whole)."""
    p = _four_devices("span_dots")
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"\n[measured] span dots under TP vs no mesh: { {k: v['err'] for k, v in got.items()} }")
    for case, v in got.items():
        assert v["err"] <= 2e-6 and v["idle_lane_zero"], (case, v)
        assert v["shard_map"] == (not case.startswith("kh2")), (case, v)


def _sampler_rows_child() -> None:
    """The tiny model's decode_8 and decode_2 (and decode_loop_8, of Program.step) exported at
    TP = 4 for the CPU and compiled for 4 CPU devices: per program the row counts of its
    sampler's sorts and top-ks (CPU: TopK custom calls; the sampler's are in its
    conditionals' BRANCHES scopes, the MoE router's top-k is not), its all-to-alls, and the
    largest all-gather of the logits."""
    import jax

    from rvcompile.artifacts.xla_executables import compile_entries
    from rvcompile.targets.xla.export import lower_to_xla

    ir = _ir("gemma-4-tiny")
    vocab = ir.config.vocab_size
    out = {}
    for b, name in ((8, "decode_8"), (2, "decode_2"), (8, "decode_loop_8")):
        low = lower_to_xla(ir, max_seqs=b, prefill_buckets=(16, 64), platforms=("cpu",), tp=4,
                           decode_loop_steps=4 if name.startswith("decode_loop") else 0)
        hlo = compile_entries(low.programs, low.manifest, jax.devices(),
                              names=(name,))[name].as_text()
        lines = hlo.splitlines()
        out[name] = {
            "rows_sorted": sorted({int(m) for line in lines
                                   if (" sort(" in line or 'custom_call_target="TopK"' in line)
                                   and "rvbranch_" in line
                                   for m in re.findall(r"= \(?\w+\[(\d+),", line)}),
            "all_to_all": sum(" all-to-all(" in line for line in lines),
            "logits_gathered": max((int(m) for line in lines if " all-gather(" in line
                                    for m in re.findall(rf"= \w+\[(\d+),{vocab}\]", line)),
                                   default=0)}
    print(json.dumps(out))


def test_tp_decode_samples_each_devices_rows():
    """The decode program at TP = 4 with 8 lanes samples 2 lanes a device (program
    step_sampled, sampler.split_by_rows): every sort and top-k of the compiled program (4 CPU
    devices) holds 2 rows, the logits reach the sampler by an all-to-all from the head's split
    by vocabulary and are never gathered whole; so in the decode loop's steps (decode_loop_8);
    with 2 lanes (not a multiple of 4) every device samples both, from the logits gathered
    whole, as before."""
    p = _four_devices("sampler_rows")
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for name in ("decode_8", "decode_loop_8"):
        assert got[name]["rows_sorted"] == [2] and got[name]["all_to_all"] >= 1, got
        assert got[name]["logits_gathered"] == 0, got
    assert got["decode_2"]["rows_sorted"] == [2], got
    assert got["decode_2"]["logits_gathered"] == 2, got


if __name__ == "__main__":
    if sys.argv[1:] == ["span_dots"]:
        _span_dots_child()
        sys.exit()
    if sys.argv[1:] == ["sampler_rows"]:
        _sampler_rows_child()
        sys.exit()
    os.environ["RVCOMPILE_CACHE"] = sys.argv[5]
    _child(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]),
           json.loads(sys.argv[6]), sys.argv[7])
