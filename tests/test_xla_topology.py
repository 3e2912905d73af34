"""Executables precompiled for named TPU topologies and the cost report (issue 6, parts 2-3).

What runs here: topology parsing and the build's refusals, the cost report's arithmetic, its
reading of a compiled program's per-device arguments, the runtime's choice between precompiled
executables and the StableHLO, and the whole serialize -> artifact -> load-without-compiling path
with executables compiled for this machine's CPU (the same jax serialization a TPU set uses).
A build for a TPU topology runs when libtpu is installed (scripts/setup.sh puts it in
.venv/tpu-aot); loading a TPU set needs a TPU and is not tested here.

Loading never runs code from the file (issue 12): executables are stored as XLA's own bytes with
a JSON description of their operands (no pickle) and loaded only with trust_executables, from a
file a trusted key signed; a crafted entry holding a pickle that would run code is refused or
ignored with one line, and its code never runs.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rvcompile.artifacts import Artifact, ArtifactError, ArtifactWriter
from rvcompile.artifacts.signature import (
    load_signing_key,
    load_trusted_key,
    sign_artifact,
    write_keypair,
)
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.runtime.executors.precompiled import Choice, Machine, choose
from rvcompile.sources.model_source import CheckpointError
from rvcompile.targets.xla import precompile
from rvcompile.targets.xla.cost_report import (
    CHIPS,
    DecodeFootprint,
    GiB,
    ReadModel,
    cost_report,
    decode_footprint,
    estimate,
    query_per_kv,
    read_model,
)

ROOT = Path(__file__).resolve().parents[1]
RVCOMPILE = str(Path(sys.executable).parent / "rvcompile")
TPU_AOT = ROOT / ".venv" / "tpu-aot"  # where scripts/setup.sh installs libtpu, apart from the venv


# ---- topologies and the build's refusals --------------------------------------------------

def test_parse_topology():
    t = precompile.parse_topology("v6e:2x2")
    assert (t.name, t.generation, t.shape, t.chips) == ("v6e:2x2", "v6e", (2, 2), 4)
    assert precompile.parse_topology(" v5e:1x1 ").chips == 1
    for bad, says in [("v6e-4", "expected GENERATION:AxB"), ("v4:2x2", "unknown TPU generation"),
                      ("v6e:4x4", "16 chips; one host has 1 to 8"), ("v6e:2x2x2", "expected")]:
        with pytest.raises(precompile.PrecompileError, match=says):
            precompile.parse_topology(bad)


def test_check_topology_refuses_wrong_device_count_and_missing_libtpu(monkeypatch):
    topo = precompile.parse_topology("v6e:2x2")
    monkeypatch.setattr(precompile, "libtpu_version", lambda: "0.0.42.1")
    with pytest.raises(precompile.PrecompileError, match="has 4 chips but .* --tp 1"):
        precompile.check_topology(topo, 1)
    precompile.check_topology(topo, 4)
    monkeypatch.setattr(precompile, "libtpu_version", lambda: None)
    with pytest.raises(precompile.PrecompileError, match="needs libtpu on the build machine"):
        precompile.check_topology(topo, 4)


def test_build_refuses_topology_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(precompile, "libtpu_version", lambda: None)
    out = tmp_path / "x.rvp"
    opts = BuildOptions(target="xla-f32", max_context=64, prefill_buckets=(16,), max_seqs=1,
                        platforms=("tpu", "cpu"), topologies=("v6e:1x1",))
    with pytest.raises(precompile.PrecompileError, match="needs libtpu"):
        build_artifact("gemma-4-tiny-dense", out, opts, random_weights=True, progress=False)
    with pytest.raises(CheckpointError, match="needs an XLA target exported for tpu"):
        build_artifact("gemma-4-tiny-dense", out, replace(opts, platforms=("cpu",)),
                       random_weights=True, progress=False)
    with pytest.raises(CheckpointError, match="--topology v6e:1x1: target h100-fp8 has no "
                                              "precompiled executables"):
        build_artifact("gemma-4-tiny-dense", out, replace(opts, target="h100-fp8"),
                       random_weights=True, progress=False)
    assert not out.exists()


def test_cli_refuses_a_topology_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from rvcompile.cli import app

    out = tmp_path / "x.rvp"
    r = CliRunner().invoke(app, ["build", "gemma-4-tiny-dense", "--target", "tpu-int8",
                                 "--random-weights", "-o", str(out), "--topology", "v6e:2x2"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [
        "rvcompile: error: --topology v6e:2x2 has 4 chips but the programs are sharded over "
        "--tp 1; give --tp 4 or another topology"]
    assert not out.exists()


# ---- the cost report ----------------------------------------------------------------------

FOOTPRINT = DecodeFootprint(
    max_seqs=4, weight_bytes=9 * GiB, dense_bytes=8 * GiB, expert_bytes=0, dense_elements=8 * GiB,
    expert_elements=0, kv_bytes_per_lane=GiB // 4, kv_elements_per_lane=GiB // 8,
    argument_bytes=9 * GiB, output_bytes=GiB, alias_bytes=GiB, temp_bytes=GiB // 2,
    xla_flops=1.0, xla_bytes_accessed=3 * GiB, once_bytes=GiB)


def test_estimate_is_a_roofline_per_device():
    v6e = CHIPS["v6e"]
    rows = {r["batch"]: r for r in estimate(FOOTPRINT, v6e, query_per_kv=2, batches=(1, 1024))}
    assert sorted(rows) == [1, 4, 1024]  # the built max_seqs is always reported
    b1 = rows[1]
    assert b1["bytes"] == 8 * GiB + GiB // 4
    assert b1["flops"] == 2 * (8 * GiB + 2 * (GiB // 8))
    assert b1["step_ms"] == pytest.approx(b1["bytes"] / 1640e9 * 1e3)
    assert b1["tok_s"] == pytest.approx(1 / (b1["bytes"] / 1640e9))
    assert b1["bound"] == "memory" and b1["fits"]
    assert b1["tok_s_xla"] == pytest.approx(b1["tok_s"] / 3)  # XLA moves 3x the roofline's bytes
    assert b1["hbm_need_bytes"] == 9 * GiB + GiB // 4 + GiB // 2  # all weights are resident
    assert not rows[1024]["fits"]  # 1024 lanes of 1/4 GiB KV: 264 GiB
    short_kv = replace(FOOTPRINT, kv_bytes_per_lane=1024, kv_elements_per_lane=512)
    big = estimate(short_kv, v6e, query_per_kv=2, batches=(1024,))[-1]
    assert big["batch"] == 1024 and big["bound"] == "compute" and big["fits"]
    assert big["step_ms"] == pytest.approx(big["flops"] / 918e12 * 1e3)
    # v5e: half the bandwidth -> about half the tok/s at B=1, and 16 GiB of HBM
    v5e = estimate(FOOTPRINT, CHIPS["v5e"], query_per_kv=2, batches=(1,))[0]
    assert v5e["tok_s"] == pytest.approx(b1["tok_s"] * 819 / 1640)
    assert CHIPS["v5e"].hbm_bytes == 16 * GiB and CHIPS["v6e"].hbm_bytes == 32 * GiB


def test_estimate_reads_the_live_keys_at_a_context():
    """Each lane reads every full layer's C keys and a sliding layer's last `window` (bytes and
    elements per token, summed by window); without those figures, its pools whole."""
    fp = replace(FOOTPRINT, kv_token_reads=((0, 100.0, 50.0), (1024, 10.0, 5.0)))
    assert fp.kv_read(2048) == (100 * 2048 + 10 * 1024, 50 * 2048 + 5 * 1024)
    assert fp.kv_read(512) == (110 * 512, 55 * 512)
    assert fp.kv_read(None) == FOOTPRINT.kv_read(512) == (GiB // 4, GiB // 8)
    b1 = estimate(fp, CHIPS["v6e"], query_per_kv=2, batches=(1,), context=512)[0]
    assert b1["bytes"] == 8 * GiB + 110 * 512
    assert b1["flops"] == 2 * (8 * GiB + 2 * 55 * 512)
    assert b1["hbm_need_bytes"] == 9 * GiB + GiB // 4 + GiB // 2  # the pools stay resident


def test_estimate_reads_only_the_picked_experts():
    moe = replace(FOOTPRINT, expert_bytes=16 * GiB, expert_elements=16 * GiB)
    reads = ReadModel(experts=128, top_k=8)
    assert reads.expert_fraction(1) == pytest.approx(8 / 128)
    assert reads.expert_fraction(2) == pytest.approx(1 - (120 / 128) ** 2)
    b1, b64 = estimate(moe, CHIPS["v6e"], query_per_kv=1, reads=reads, batches=(1, 64))[::2]
    assert b1["bytes"] == round(8 * GiB + 16 * GiB * 8 / 128 + GiB // 4)
    assert b1["flops"] == 2 * (8 * GiB + 16 * GiB * 8 / 128 + GiB // 8)
    assert b64["bytes"] == round(8 * GiB + 16 * GiB * (1 - (120 / 128) ** 64) + 64 * GiB // 4)


def test_read_model_of_the_ir():
    from types import SimpleNamespace

    from rvcompile.build import lower_model
    from rvcompile.model.presets import get_preset

    opts = BuildOptions(target="tpu-int8", max_context=64, prefill_buckets=(16,))
    ir = lower_model(SimpleNamespace(config=get_preset("gemma-4-tiny")), opts, lambda s: None)
    reads = read_model(ir)
    # the per-layer-input table is only gathered; embed_tokens is also the tied head
    assert reads.gathered == {"embed_tokens_per_layer.weight",
                              "embed_tokens_per_layer.weight.scale"}
    cfg = ir.config
    assert (reads.experts, reads.top_k) == (cfg.num_experts, cfg.top_k_experts) != (0, 0)
    assert reads.kind("embed_tokens_per_layer.weight.scale") == "gathered"
    assert reads.kind("g0.1.experts.gate_up_proj.scale") == "expert"
    assert reads.kind("g0.1.router.per_expert_scale") == "dense"
    assert reads.kind("embed_tokens.weight") == "dense"
    assert query_per_kv(ir) == max(ir.config.num_heads // s.num_kv_heads
                                   for s in ir.config.layers)
    # every layer attends once, over its own cache or (KV-shared) its source's, at its window
    from rvcompile.targets.xla.program import plan_layout

    counts = {f"g{gi}.": g.count for gi, g in enumerate(plan_layout(ir).groups)}
    layer_reads = sum(n * counts[key[:key.index(".") + 1]] for key, _, n in reads.kv_reads
                      if not key.endswith(".scale"))
    sources = [ir.cache_of(s.kv_source if s.kv_shared else s.index) for s in cfg.layers]
    assert layer_reads == sum(len(c.names) for c in sources)
    assert any(n > 1 for *_, n in reads.kv_reads)  # tiny shares KV: a pool read by 2 layers
    assert {w for _, w, _ in reads.kv_reads} == {s.window or 0 for s in cfg.layers}


def _toy_decode(weights, pools, x):
    h = x @ weights["w"].astype(jnp.float32) * weights["w.scale"]
    return {k: v + 1 for k, v in pools.items()}, h.sum()


def test_decode_footprint_reads_the_compiled_arguments():
    dev = jax.devices("cpu")[0]
    whole = NamedSharding(Mesh(np.array([dev]), ("tp",)), PartitionSpec())

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=whole)

    max_seqs = 2
    weights = {"w": sds((64, 32), jnp.int8), "w.scale": sds((32,), jnp.float32)}
    pools = {"g0.0.cache_k": sds((3, 2 * max_seqs, 16, 2, 8), jnp.bfloat16)}
    compiled = jax.jit(_toy_decode, donate_argnums=(1,)).lower(
        weights, pools, sds((1, 64), jnp.float32)).compile()
    fp = decode_footprint(compiled, max_seqs, group_counts=(3,))
    assert fp.weight_bytes == fp.dense_bytes == 64 * 32 + 32 * 4
    # XLA counts a scan body once: group 0's pool (3 layers stacked) counts a third
    pool = 3 * 2 * max_seqs * 16 * 2 * 8 * 2
    assert fp.once_bytes == fp.weight_bytes + pool // 3
    assert fp.xla_amplification == fp.xla_bytes_accessed / fp.once_bytes
    assert fp.dense_elements == 64 * 32  # scales are not multiplied
    assert fp.expert_bytes == fp.expert_elements == 0
    gathered = ReadModel(gathered=frozenset({"w"}))
    assert decode_footprint(compiled, max_seqs, gathered).dense_bytes == 0
    assert fp.kv_bytes_per_lane == 3 * 2 * max_seqs * 16 * 2 * 8 * 2 // max_seqs
    assert fp.kv_elements_per_lane == 3 * 2 * max_seqs * 16 * 2 * 8 // max_seqs
    assert fp.argument_bytes >= fp.weight_bytes + fp.kv_bytes_per_lane * max_seqs
    assert fp.xla_flops > 0
    report = cost_report(compiled, max_seqs, CHIPS["v6e"], query_per_kv=2, context=32)
    assert report["label"].startswith("estimate")
    assert json.loads(json.dumps(report)) == report  # it goes into the manifest


# ---- the runtime's choice ----------------------------------------------------------------

RECORD = {"topology": "v6e:2x2", "encoding": "pjrt-1", "platform": "tpu",
          "device_kind": "TPU v6 lite", "device_ids": [0, 1, 2, 3],
          "coords": [[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]],
          "jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": "0.0.42.1",
          "kv_blocks": {"full": 8, "sliding": 12}, "entries": {}}
V6E_4 = Machine("tpu", "TPU v6 lite", ((0, (0, 0, 0)), (1, (1, 0, 0)), (2, (0, 1, 0)),
                                        (3, (1, 1, 0))), "0.10.2", "0.10.2", "0.0.42.1")
BLOCKS = {"full": 8, "sliding": 12}


def test_choose_loads_a_matching_set():
    c = choose({"v6e:2x2": RECORD}, V6E_4, BLOCKS, trusted=True)
    assert c == Choice("v6e:2x2", "precompiled executables for v6e:2x2 (jaxlib 0.10.2, libtpu "
                                  "0.0.42.1); nothing compiled")


@pytest.mark.parametrize("machine, blocks, why", [
    (replace(V6E_4, device_kind="TPU v5 lite"), BLOCKS, "v6e:2x2: it is for TPU v6 lite"),
    (replace(V6E_4, devices=V6E_4.devices[:2]), BLOCKS, "it is for 4 devices"),
    (replace(V6E_4, devices=V6E_4.devices[::-1]), BLOCKS, "it is for 4 devices"),
    (replace(V6E_4, jaxlib="0.11.0"), BLOCKS, "compiled with jaxlib 0.10.2"),
    (replace(V6E_4, libtpu=None), BLOCKS, "compiled with libtpu 0.0.42.1"),
    (V6E_4, {"full": 16, "sliding": 12}, "compiled for KV blocks"),
    (replace(V6E_4, platform="cpu", device_kind="cpu"), BLOCKS, "it is for TPU v6 lite"),
])
def test_choose_says_why_it_compiles(machine, blocks, why):
    c = choose({"v6e:2x2": RECORD}, machine, blocks, trusted=True)
    assert c.topology is None
    assert why in c.note
    assert c.note.startswith(f"no precompiled executable for {machine.device_kind} x4 / jaxlib "
                             f"{machine.jaxlib}")
    assert c.note.endswith("; compiling StableHLO") and "\n" not in c.note


def test_choose_without_sets():
    c = choose({}, V6E_4, BLOCKS, trusted=True)
    assert c.topology is None and "the artifact has none" in c.note


def test_choose_loads_nothing_untrusted_and_no_pickled_set():
    c = choose({"v6e:2x2": RECORD}, V6E_4, BLOCKS, trusted=False)
    assert c == Choice(None, "not loading the precompiled executables (v6e:2x2): XLA runs an "
                             "executable unchecked, so rvrun loads one only when trusted "
                             "(--trust-executables --trusted-key); compiling StableHLO")
    legacy = {k: v for k, v in RECORD.items() if k != "encoding"}  # format v2: jax's pickle
    c = choose({"v6e:2x2": legacy}, V6E_4, BLOCKS, trusted=True)
    assert c.topology is None and "v6e:2x2: it is stored as jax's pickle, which rvrun does " \
        "not load (rebuild the artifact)" in c.note


# ---- serialize -> artifact -> load with no compilation (CPU executables) ------------------

def _tiny_artifact(path: Path) -> Path:
    opts = BuildOptions(target="xla-f32", max_context=64, prefill_buckets=(16,), max_seqs=2,
                        platforms=("cpu",))
    build_artifact("gemma-4-tiny-dense", path, opts, random_weights=True, progress=False)
    return path


def _rewrite(src: Path, dst: Path, manifest: dict, sections: dict[str, bytes]) -> None:
    """A copy of `src` with `manifest` and `sections` (name -> bytes) replacing or adding its
    own: a file as a careless or hostile writer could make it, digests all consistent."""
    with Artifact.open(src) as art, ArtifactWriter(dst, art.header) as w:
        for name in art.sections:
            w.add(name, sections.get(name, art.buffer(name)))
        for name in sections.keys() - art.sections.keys():
            w.add(name, sections[name])
        w.commit(manifest)


def _with_cpu_set(src: Path, dst: Path) -> dict:
    """A copy of `src` carrying executables precompiled for this host's CPU."""
    with Artifact.open(src) as art:
        m = art.manifest
        blob = art.buffer("programs")
        programs = {n: bytes(blob[loc["offset"]:loc["offset"] + loc["size"]])
                    for n, loc in m["xla"]["programs"].items()}
    pre = precompile.precompile_for("cpu:1", programs, m["xla"], jax.devices("cpu"))
    pre.record["cost"] = cost_report(pre.compiled[f"decode_{m['xla']['max_seqs']}"],
                                     m["xla"]["max_seqs"], CHIPS["v6e"], 2,
                                     m["xla"]["max_context"], ReadModel())
    data, records = precompile.executables_section([pre])
    _rewrite(src, dst, {**m, "xla": {**m["xla"], "precompiled": records}},
             {"executables": data})
    return records["cpu:1"]


@pytest.fixture(scope="module")
def key(tmp_path_factory) -> tuple[Path, Path]:
    """(private, public) key files of the signer the tests trust."""
    return write_keypair(tmp_path_factory.mktemp("key") / "release")[:2]


def _signed(path: Path, key: tuple[Path, Path]) -> Path:
    sign_artifact(path, load_signing_key(key[0]), "release")
    return path


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, key):
    d = tmp_path_factory.mktemp("topology")
    plain = _tiny_artifact(d / "plain.rvp")
    record = _with_cpu_set(plain, d / "cpu-set.rvp")
    return plain, _signed(d / "cpu-set.rvp", key), record


def test_precompiled_cpu_set_loads_without_compiling_and_matches(artifacts, key, capsys):
    from rvcompile.runtime import load

    plain, with_set, record = artifacts
    assert record["platform"] == "cpu" and record["libtpu"] == precompile.libtpu_version()
    assert record["encoding"] == "pjrt-1"
    assert sorted(record["entries"]) == ["decode_2", "logits_16", "prefill_16"]
    sig = record["entries"]["decode_2"]["operands"]
    with Artifact.open(with_set) as art:
        pools = art.manifest["xla"]["kv"]["pools"]
        weights = art.manifest["xla"]["weights"]
    # flat inputs: weights (sorted keys), then the pools (donated), then tokens, start, ...
    assert [i["donated"] for i in sig["inputs"]].count(True) == len(pools)
    assert all(i["donated"] for i in sig["inputs"][len(weights):len(weights) + len(pools)])
    # the pools, the sampled token per lane, its log-probability, the top ids and their logprobs
    assert [o["shape"] for o in sig["outputs"]][len(pools):] == [[2], [2], [2, 20], [2, 20]]
    prompt = [2, 17, 5, 99, 3]
    model = load(with_set, trusted_keys=[key[1]], trust_executables=True)
    note = model.executor.load_note
    assert note.startswith("precompiled executables for cpu:1") and "nothing compiled" in note
    assert model.executor.compile_s == 0.0
    fast = model.generate(prompt, max_tokens=6, ignore_eos=True).token_ids
    fast_logits = model.logits(prompt)
    ref_model = load(plain)
    assert ref_model.generate(prompt, max_tokens=6, ignore_eos=True).token_ids == fast
    np.testing.assert_array_equal(ref_model.logits(prompt), fast_logits)
    assert "[rvrun]" not in capsys.readouterr().err


def test_precompiling_never_takes_executables_from_the_persistent_cache(artifacts, tmp_path):
    """rvrun turns jax's persistent compilation cache on in its process; an executable loaded
    from it serializes without its compiled code (half the bytes; "Function ... not found" when
    run). With the cache really in use (jax decides that once per process, hence the reset),
    precompiling gives the same bytes every time as without it."""
    from jax._src import compilation_cache
    from jax._src import config as jax_config

    plain, _, _ = artifacts
    with Artifact.open(plain) as art:
        m = art.manifest
        blob = art.buffer("programs")
        programs = {n: bytes(blob[loc["offset"]:loc["offset"] + loc["size"]])
                    for n, loc in m["xla"]["programs"].items()}

    def logits_16() -> bytes:
        return precompile.precompile_for("cpu:1", programs, m["xla"], jax.devices("cpu"),
                                          ("logits_16",)).executables["logits_16"]

    without_cache = logits_16()
    with jax_config.compilation_cache_dir(str(tmp_path)), \
            jax_config.persistent_cache_min_compile_time_secs(0), \
            jax_config.persistent_cache_min_entry_size_bytes(0):
        compilation_cache.reset_cache()
        try:
            jax.jit(lambda x: x * 3 + 1).lower(np.float32(2)).compile()
            assert any(tmp_path.iterdir()), "the persistent cache is not in use: nothing tested"
            runs = [logits_16(), logits_16()]
            jax.clear_caches()
            runs.append(logits_16())
        finally:
            compilation_cache.reset_cache()
    assert [len(r) for r in runs] == [len(without_cache)] * 3


def test_precompiled_set_untrusted_or_not_matching_says_why(artifacts, key, capsys,
                                                           monkeypatch):
    from rvcompile.runtime import load
    from rvcompile.runtime.executors import precompiled as runtime_precompiled
    from rvcompile.runtime.executors.xla import XlaExecutor

    _, with_set, _ = artifacts
    monkeypatch.setattr(XlaExecutor, "_warm_up", lambda self: 0.0)  # the note, not the compile
    for keys in (None, [key[1]]):  # signed by a trusted key, but executables not trusted
        assert load(with_set, trusted_keys=keys).executor.load_note.startswith("XLA compile")
        err = capsys.readouterr().err
        assert err == ("[rvrun] not loading the precompiled executables (cpu:1): XLA runs an "
                       "executable unchecked, so rvrun loads one only when trusted "
                       "(--trust-executables --trusted-key); compiling StableHLO\n")
    with pytest.raises(ArtifactError, match="^cpu-set.rvp: trust_executables needs trusted_keys: "
                                            "XLA runs an executable unchecked, so only a signer "
                                            "you trust may supply one$"):
        load(with_set, trust_executables=True)
    monkeypatch.setattr(runtime_precompiled, "libtpu_version", lambda: "9.9.9")
    assert load(with_set, trusted_keys=[key[1]], trust_executables=True).executor \
        .load_note.startswith("XLA compile")
    err = capsys.readouterr().err
    assert "[rvrun] no precompiled executable for cpu x1" in err
    assert "cpu:1: it was compiled with libtpu" in err and err.rstrip().endswith(
        "compiling StableHLO")


def test_rvrun_trusts_executables_only_with_a_trusted_key(artifacts, capsys):
    from rvcompile.runtime.cli import main, ppl_main, serve_main

    _, with_set, _ = artifacts
    for run, args in ((main, ["--prompt", "hi"]), (ppl_main, ["--text", __file__]),
                      (serve_main, ["--port", "0"])):
        assert run([str(with_set), *args, "--trust-executables"]) == 2
        assert capsys.readouterr().err == (
            "rvrun: error: --trust-executables needs --trusted-key: XLA runs an executable "
            "unchecked, so only a signer you trust may supply one\n")


def test_corrupt_executable_is_refused(artifacts, tmp_path):
    from rvcompile.runtime.executors import precompiled as runtime_precompiled

    _, with_set, record = artifacts
    bad = tmp_path / "bad.rvp"
    bad.write_bytes(with_set.read_bytes())
    with Artifact.open(bad) as art:
        at = art.sections["executables"].offset + record["entries"]["decode_2"]["offset"] + 100
    with open(bad, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    with Artifact.open(bad) as art, pytest.raises(Exception, match="decode_2 is corrupt"):
        runtime_precompiled.load(art, "cpu:1", {}, jax.devices("cpu"))


class _Touch:
    """Unpickling this creates `path`: what a hostile entry would do with os.system."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def _with_entries(src: Path, dst: Path, data: bytes, *, encoding: bool) -> None:
    """A copy of `src` whose every precompiled cpu:1 entry is `data`, digests consistent; the
    record without `encoding` is as format v2 wrote it (jax's pickle)."""
    with Artifact.open(src) as art:
        m = art.manifest
    rec = m["xla"]["precompiled"]["cpu:1"]
    entries = {n: {**e, "offset": 0, "size": len(data),
                   "sha256": hashlib.sha256(data).hexdigest()} for n, e in rec["entries"].items()}
    rec = {k: v for k, v in rec.items() if encoding or k != "encoding"}
    manifest = {**m, "xla": {**m["xla"], "precompiled": {"cpu:1": {**rec, "entries": entries}}}}
    _rewrite(src, dst, manifest, {"executables": data})


def test_a_pickle_in_an_entry_never_runs(artifacts, key, tmp_path, capsys):
    from rvcompile.runtime import load

    _, with_set, _ = artifacts
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Touch(marker))
    pickle.loads(payload)  # the payload is live: unpickling it runs its code
    assert marker.exists()
    marker.unlink()
    v3, v2 = tmp_path / "v3.rvp", tmp_path / "v2.rvp"
    _with_entries(with_set, v3, payload, encoding=True)
    _with_entries(with_set, v2, payload, encoding=False)
    with pytest.raises(ArtifactError, match="^v3.rvp: not signed"):  # an attacker has no key
        load(v3, trusted_keys=[key[1]], trust_executables=True)
    # signed (a signer's mistake, or a stolen key): verify checks integrity, and it is whole
    for path in (v3, v2):
        _signed(path, key)
        with Artifact.open(path, trusted_keys=[load_trusted_key(key[1])]) as art:
            art.verify()
    # trusted, an entry in the new encoding goes to XLA's parser on its first call, which
    # refuses it: that call fails (and every later one), one line, and nothing is compiled
    model = load(v3, trusted_keys=[key[1]], trust_executables=True)
    assert model.executor.fns.pending == ("decode_2", "logits_16", "prefill_16")
    for _ in range(2):
        with pytest.raises(ArtifactError) as e:
            model.executor.fns["decode_2"]
        assert str(e.value).startswith("v3.rvp: precompiled cpu:1/decode_2: XLA cannot load "
                                       "it: ")
        assert "\n" not in str(e.value)
    with pytest.raises(RuntimeError, match="generation failed: .*ArtifactError: v3.rvp: "
                                           "precompiled cpu:1/prefill_16: XLA cannot load it"):
        model.generate([2, 17, 5], max_tokens=3, ignore_eos=True)
    assert model.executor.compile_s == 0.0 and model.executor.fns.loaded_s == {}
    # a server loads them before it listens (executor_api.load_pending): the start fails
    from rvcompile.runtime.executor_api import load_pending
    with pytest.raises(ArtifactError, match="precompiled cpu:1/decode_2: XLA cannot load it"):
        load_pending(model.executor)
    capsys.readouterr()
    # so `rvrun serve` does not start on it: one line, a non-zero exit, nothing served
    from rvcompile.runtime import cli as rvrun
    assert rvrun.main(["serve", str(v3), "--trusted-key", str(key[1]), "--trust-executables",
                       "--port", "0"]) != 0
    err = capsys.readouterr().err
    assert "precompiled cpu:1/decode_2: XLA cannot load it" in err.strip().splitlines()[-1]
    assert "Traceback" not in err and "serving" not in err
    # a v2 set (jax's pickle) is never loaded, nor is any set untrusted: the StableHLO runs
    for path, trust, why in ((v2, True, "cpu:1: it is stored as jax's pickle"),
                             (v3, False, "loads one only when trusted")):
        model = load(path, trusted_keys=[key[1]], trust_executables=trust)
        assert model.executor.load_note.startswith("XLA compile")
        assert why in capsys.readouterr().err
        assert len(model.generate([2, 17, 5], max_tokens=3, ignore_eos=True).token_ids) == 3
    assert not marker.exists()


def _tampered(src: Path, dst: Path, edit) -> None:
    """A copy of `src` with `edit(record)` applied to its cpu:1 record."""
    with Artifact.open(src) as art:
        m = copy.deepcopy(art.manifest)
    edit(m["xla"]["precompiled"]["cpu:1"])
    _rewrite(src, dst, m, {})


@pytest.mark.parametrize("edit, says", [
    (lambda r: r["entries"]["decode_2"]["operands"]["inputs"][0].update(shape=[7, 128]),
     "decode_2: input 0 is float32[7, 128] P(), its program's is float32[1024, 128] P()"),
    (lambda r: r["entries"]["decode_2"]["operands"]["inputs"][0].update(dtype="bfloat16"),
     "decode_2: input 0 is bfloat16"),
    (lambda r: r["entries"]["decode_2"]["operands"]["outputs"].pop(),
     "decode_2: 8 outputs, its program has 9"),
    (lambda r: r["entries"]["decode_2"]["operands"]["outputs"][0].update(donated=True),
     "decode_2: operands.outputs: an output cannot be donated"),
    (lambda r: r["entries"]["decode_2"]["operands"]["inputs"][1].update(spec=["tp", 3]),
     "decode_2: operands.inputs[1].spec: expected a PartitionSpec"),
    (lambda r: r["entries"]["decode_2"]["operands"]["inputs"][1].update(dtype="float99"),
     "decode_2: operands.inputs[1].dtype: unknown dtype 'float99'"),
    # decode_2's operands over prefill_16's executable: XLA loads it (on decode_2's first
    # call), the shapes disagree
    (lambda r: r["entries"]["decode_2"].update(
        {k: r["entries"]["prefill_16"][k] for k in ("offset", "size", "sha256")}),
     "decode_2: the executable's input"),
], ids=["shape", "dtype", "outputs", "donated", "spec", "unknown-dtype", "other-executable"])
def test_operands_that_disagree_are_refused(artifacts, key, tmp_path, edit, says):
    """As a signer's own mistake would make it (a signed file): refused in one line, at load
    (the record against the program), or what only XLA can tell at the entry's first call."""
    from rvcompile.runtime import load

    _, with_set, _ = artifacts
    bad = tmp_path / "bad.rvp"
    _tampered(with_set, bad, edit)
    _signed(bad, key)
    with pytest.raises(ArtifactError, match=re.escape(says)) as e:
        model = load(bad, trusted_keys=[key[1]], trust_executables=True)
        assert "the executable's" in says  # loaded: only the executable's own check is left
        model.executor.fns["decode_2"]
    assert str(e.value).startswith("bad.rvp: precompiled cpu:1/") and "\n" not in str(e.value)


def test_the_load_path_unpickles_nothing():
    """No module that reads an artifact imports a deserializer that runs code (pickle and
    friends, jax's pickling serialize_executable), evaluates text, or lets numpy unpickle."""
    banned_modules = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve",
                      "yaml", "serialize_executable", "jax.experimental.serialize_executable"}
    pkg = ROOT / "rvcompile"
    files = [*sorted((pkg / "runtime").rglob("*.py")), *sorted((pkg / "artifacts").glob("*.py")),
             pkg / "dtypes.py", pkg / "chat_template.py"]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                names = {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {node.module or "", *(a.name for a in node.names)}
            else:
                names = set()
            assert not names & banned_modules, where
            if isinstance(node, ast.Call):
                func = node.func
                assert not (isinstance(func, ast.Name) and func.id in ("eval", "exec")), where
                assert all(k.arg != "allow_pickle" for k in node.keywords), where


def test_inspect_lists_sets_and_cost_estimate(artifacts):
    from typer.testing import CliRunner

    from rvcompile.cli import app

    plain, with_set, _ = artifacts
    r = CliRunner().invoke(app, ["inspect", str(with_set)])
    assert r.exit_code == 0, r.output
    assert "precompiled:" in r.stdout and "cpu:1: cpu x1, jax" in r.stdout
    assert "cpu:1: cost estimate" in r.stdout and "tok/s" in r.stdout and "B=1 " in r.stdout
    r = CliRunner().invoke(app, ["inspect", str(with_set), "--json"])
    info = json.loads(r.stdout)
    cost = info["precompiled"]["cpu:1"]["cost"]
    assert cost["label"].startswith("estimate") and cost["decode"][0]["batch"] == 1
    assert "traffic:" not in r.stdout
    r = CliRunner().invoke(app, ["inspect", str(with_set), "--cost"])
    assert r.exit_code == 0, r.output
    assert "cpu:1: traffic, bytes per decode step" in r.stdout
    assert all(f"    {c:12}" in r.stdout for c in ("weights", "embeddings", "kv", "temps"))
    r = CliRunner().invoke(app, ["inspect", str(plain), "--cost"])
    assert "traffic:          none (no precompiled topology" in r.stdout


def test_traffic_table_of_the_decode_program(artifacts):
    """The decode program's own traffic: every weight byte read at least once a step (the
    layers' stacks through the scan, each iteration a layer), the layer scan's trips equal to
    the manifest's layer group, KV read and written, and the table's total over the roofline's
    bytes as the report's amplification."""
    _, with_set, record = artifacts
    with Artifact.open(with_set) as art:
        groups = art.manifest["xla"]["layer_groups"]
    cost = record["cost"]
    t, dev = cost["traffic"], cost["per_device"]
    assert not t["unknown_trips"]
    # the layer scans, and attention's span loops counted at the built context (64 tokens: one
    # span of the 4-block tables)
    scans = {n: k for n, k in t["trips"].items() if n not in t["span_loops"]}
    assert sorted(scans.values()) == sorted(g["count"] for g in groups)
    assert t["span_loops"] and all(t["trips"][n] == 1 for n in t["span_loops"])
    read = {c: v["read"] for c, v in t["classes"].items()}
    assert read["weights"] + read["embeddings"] >= dev["weight_bytes"]
    assert read["kv"] > 0 and t["classes"]["kv"]["written"] > 0
    built = next(r for r in cost["decode"] if r["batch"] == dev["max_seqs"])
    assert t["amplification"] == pytest.approx(t["total_bytes"] / built["bytes"])
    assert t["total_bytes"] >= t["once_bytes"]
    assert sum(r["step_bytes"] for r in t["top"]) <= t["total_bytes"]


# ---- a real TPU topology build (needs libtpu) ---------------------------------------------

def _libtpu_env() -> dict | None:
    env = dict(os.environ)
    if TPU_AOT.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TPU_AOT), env.get("PYTHONPATH")]))
        return env
    return env if importlib.util.find_spec("libtpu") else None


def run_with_libtpu(script, *args: str, timeout: int = 300) -> dict:
    """`python script args` with libtpu importable (the calling test skips where it is not
    installed): the JSON object its last line of output holds."""
    env = _libtpu_env()
    if env is None:
        pytest.skip("libtpu is not installed (scripts/setup.sh puts it in .venv/tpu-aot)")
    p = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                       env=env, timeout=timeout, cwd=Path(script).parent)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_build_for_a_tpu_topology(tmp_path):
    env = _libtpu_env()
    if env is None:
        pytest.skip("libtpu is not installed (scripts/setup.sh puts it in .venv/tpu-aot)")
    out = tmp_path / "v6e.rvp"
    cmd = [RVCOMPILE, "build", "gemma-4-tiny-dense", "--target",
           "tpu-int8", "--random-weights", "--max-context", "64", "--prefill-buckets", "16",
           "--max-seqs", "1", "--decode-loop-steps", "0", "--platforms", "tpu", "--topology",
           "v6e:1x1", "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    with Artifact.open(out) as art:
        rec = art.manifest["xla"]["precompiled"]["v6e:1x1"]
        assert art.sections["executables"].size == sum(e["size"] for e in rec["entries"].values())
    assert rec["platform"] == "tpu" and rec["device_kind"] == "TPU v6 lite"
    assert rec["libtpu"] and rec["jaxlib"] == jax.__version__
    assert sorted(rec["entries"]) == ["decode_1", "logits_16", "prefill_16"]
    assert rec["cost"]["chip"]["generation"] == "v6e" and rec["cost"]["fits_at_max_seqs"]
    # the traffic table reads the TPU program: its layer scan's trips, every weight byte a step
    traffic, dev = rec["cost"]["traffic"], rec["cost"]["per_device"]
    assert traffic["trips"] and not traffic["unknown_trips"]
    read = {c: v["read"] for c, v in traffic["classes"].items()}
    assert read["weights"] + read["embeddings"] >= dev["weight_bytes"] and read["kv"] > 0
    # issue 19: the TPU decode program materializes no whole weight matrix or table
    # (hlo_traffic.Traffic.whole_copies; tests/test_xla_decode_reads.py shows the check failing
    # on the lowerings it replaced)
    assert traffic["whole_copies"] == [], traffic["whole_copies"]
    r = subprocess.run([RVCOMPILE, "inspect", str(out), "--cost"], capture_output=True,
                       text=True, cwd=ROOT, env=env)
    assert r.returncode == 0 and "v6e:1x1: traffic, bytes per decode step" in r.stdout
    assert "whole weight copies: none" in r.stdout
