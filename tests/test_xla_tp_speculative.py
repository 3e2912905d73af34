"""Speculative decoding under tensor parallelism on the XLA target (`--tp N` with
`--num-draft-tokens` and `--assistant`; targets/xla/sharding.py says how the drafter splits).

- Same tokens: on 4 CPU devices (one subprocess, as in tests/test_xla_tp.py), the embedded
  default model and its trained assistant (models/rv-gemma4-tiny*, so drafts are accepted and
  verify's later rows decide tokens) built on xla-f32 at --tp 2 and 4: greedy generation with
  assistant and n-gram speculation gives exactly the tokens of the --tp 1 build without
  speculation. Seeded sampling keeps what tests/test_speculative_xla.py promises at one device,
  at each degree: n-gram speculation gives the tokens sampling without it gives there, the
  assistant the same tokens on every run.
- The --tp 2 artifact runs from `rvrun prepare`'s executables (compile_entries: draft compiled
  without donating the pools it only reads; a set whose draft takes them donated is refused);
  --tp 4 compiles at load. The draft and verify programs gather only logits and all-reduce
  only hidden-state-sized vectors: no weight, KV pool or table moves between devices.
- The released 31B with its assistant's shape exports draft and verify at --tp 4.
- The rules: the drafter's split (q/o and MLP like the target's, a dense head's table by
  vocabulary row, a centroid head's whole, the projections whole); a drafter whose heads or MLP
  do not split is refused in one line naming the field.
- --topology: a TPU slice's executables of draft and verify are built (needs libtpu).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import once_across_workers

from rvcompile.build import BuildOptions

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "rv-gemma4-tiny"
ASSISTANT_DIR = ROOT / "models" / "rv-gemma4-tiny-assistant"
RVCOMPILE = str(Path(sys.executable).parent / "rvcompile")
TPU_AOT = ROOT / ".venv" / "tpu-aot"
K = 3
OPTS = {"max_context": 256, "prefill_buckets": (16,), "max_seqs": 2, "platforms": ("cpu",),
        "decode_loop_steps": 0}
N_GREEDY, N_SAMPLED = 40, 24
SAMPLED = {"temperature": 0.8, "top_k": 40, "seed": 11}


def _collectives(text: str, vocab: int) -> dict:
    """The largest all-gather other than the vocabulary-split logits, and the largest
    all-reduce, in elements, of a compiled program's HLO."""
    sizes = {"all-gather": [], "all-reduce": []}
    for dims, op in re.findall(r"= \w+\[([\d,]*)\]\S* (all-gather|all-reduce)\(", text):
        shape = [int(x) for x in dims.split(",") if x]
        if op == "all-gather" and shape[-1:] == [vocab]:
            continue
        n = 1
        for d in shape:
            n *= d
        sizes[op].append(n)
    return {op: max(v, default=0) for op, v in sizes.items()}


def _child(out: str) -> None:
    """Runs in the 4-device subprocess: build --tp 1 (no speculation), 2 and 4 (the assistant,
    K drafts), run them, and print what the test checks as one JSON line."""
    import copy

    import jax
    from jax import export

    from rvcompile import runtime
    from rvcompile.artifacts import Artifact, ArtifactError
    from rvcompile.build import build_artifact
    from rvcompile.runtime.executors.precompiled import load_set
    from rvcompile.runtime.prepare import prepare, prepared_path

    assert len(jax.devices()) == 4, jax.devices()
    result: dict = {}
    for tp in (1, 2, 4):
        t0 = time.perf_counter()
        path = Path(out) / f"tp{tp}.rvp"
        spec = {"draft_tokens": K} if tp > 1 else {}
        build_artifact(str(MODEL_DIR), path, BuildOptions("xla-f32", tp=tp, **spec, **OPTS),
                       assistant=str(ASSISTANT_DIR) if tp > 1 else None, progress=False,
                       log=lambda s: None)
        if tp == 2:
            prepare(path)
        m = runtime.load(path)
        print(f"tp={tp}: built and loaded at {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        prompt = m.encode((MODEL_DIR / "heldout_sample.txt").read_text()[:400])[:24]
        r: dict = {"load_note": m.executor.load_note}
        kinds = (None, "assistant", "ngram") if tp > 1 else (None,)
        for kind in kinds:
            g = m.generate(prompt, max_tokens=N_GREEDY, ignore_eos=True, speculative=kind)
            r[f"greedy {kind}"] = {"tokens": g.token_ids, "drafted": g.drafted_tokens,
                                   "accepted": g.accepted_tokens}
        runs = (("plain", None), ("ngram", "ngram"), ("assistant", "assistant"),
                ("assistant again", "assistant")) if tp > 1 else (("plain", None),)
        for label, kind in runs:
            r[f"sampled {label}"] = m.generate(prompt, max_tokens=N_SAMPLED, ignore_eos=True,
                                               speculative=kind, **SAMPLED).token_ids
        if tp > 1:
            xla = m.manifest["xla"]
            vocab = m.manifest["model"]["config"]["vocab_size"]
            r["mesh"] = xla["mesh"]["size"]
            r["devices"] = len({d for w in m.executor.weights.values()
                                for d in w.sharding.device_set})
            r["hidden_size"] = m.manifest["model"]["config"]["hidden_size"]
            r["collectives"] = {name: _collectives(m.executor.fns[name].as_text(), vocab)
                                for name in (xla["speculative"]["draft"],
                                             xla["speculative"]["verify"])}
        if tp == 2:  # a prepared draft that donates the pools is refused before it loads
            draft = m.manifest["xla"]["speculative"]["draft"]
            with Artifact.open(prepared_path(path)) as cache, Artifact.open(path) as art:
                rec = copy.deepcopy(cache.manifest["prepared"]["set"])
                r["prepared draft donates"] = any(
                    op["donated"] for op in rec["entries"][draft]["operands"]["inputs"])
                for op in rec["entries"][draft]["operands"]["inputs"]:
                    op["donated"] = True
                rec["entries"] = {draft: rec["entries"][draft]}
                loc = art.manifest["xla"]["programs"][draft]
                blob = art.buffer("programs")
                exp = export.deserialize(bytearray(blob[loc["offset"]:
                                                        loc["offset"] + loc["size"]]))
                try:
                    load_set(rec, cache.buffer("executables"), "cache", art.manifest["xla"],
                             {draft: exp}, jax.local_devices())
                    r["donated draft refused"] = None
                except ArtifactError as e:
                    r["donated draft refused"] = str(e)
        result[tp] = r
        print(f"tp={tp}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(json.dumps(result))


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory) -> dict[int, dict]:
    """The subprocess's results by degree, run once however many pytest-xdist workers take
    this module's tests (conftest.once_across_workers). XLA's backend optimizations are off
    there, as in tests/test_xla_tp.py (the SPMD partitioning under test runs either way)."""

    def run(tmp: Path) -> dict:
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
               "JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
               "RVCOMPILE_CACHE": str(tmp / "cache")}
        p = subprocess.run([sys.executable, __file__, str(tmp)], capture_output=True,
                           text=True, env=env, timeout=600, cwd=Path(__file__).parent)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    runs = once_across_workers(tmp_path_factory, "tp-spec", run)
    return {int(k): v for k, v in runs.items()}


def test_greedy_speculation_at_tp_gives_tp1s_tokens(tp_runs):
    plain = tp_runs[1]["greedy None"]["tokens"]
    assert len(plain) == N_GREEDY
    for tp in (2, 4):
        r = tp_runs[tp]
        assert r["mesh"] == tp and r["devices"] == tp
        for kind in ("None", "assistant", "ngram"):
            assert r[f"greedy {kind}"]["tokens"] == plain, f"tp={tp} {kind}"
        for kind in ("assistant", "ngram"):
            g = r[f"greedy {kind}"]
            # accepted drafts: tokens that verify's later rows decided
            assert g["accepted"] > 0 and g["drafted"] > g["accepted"], (tp, kind, g)
        print(f"\n[measured] tp={tp}: {N_GREEDY} greedy tokens, assistant accepted "
              f"{r['greedy assistant']['accepted']} of {r['greedy assistant']['drafted']}, "
              f"n-gram {r['greedy ngram']['accepted']} of {r['greedy ngram']['drafted']}")


def test_seeded_sampling_at_tp_keeps_its_tokens(tp_runs):
    for tp in (2, 4):
        r = tp_runs[tp]
        assert len(r["sampled plain"]) == N_SAMPLED
        assert r["sampled ngram"] == r["sampled plain"], f"tp={tp}"
        assert r["sampled assistant again"] == r["sampled assistant"], f"tp={tp}"
        print(f"\n[measured] tp={tp}: seeded sampling equals tp=1's: "
              f"{r['sampled plain'] == tp_runs[1]['sampled plain']}")


def test_prepared_draft_reads_the_pools_without_donating_them(tp_runs):
    r = tp_runs[2]
    assert "nothing compiled" in r["load_note"], r["load_note"]  # the prepared executables ran
    assert "compile" in tp_runs[4]["load_note"]
    assert r["prepared draft donates"] is False
    assert r["donated draft refused"] is not None
    assert r["donated draft refused"].startswith("cache/draft_2: operands.inputs: draft only "
                                                 "reads the KV pools but this executable "
                                                 "takes them donated")


def test_draft_and_verify_move_no_weight_or_pool(tp_runs):
    """Only logits are gathered, and only hidden-state-sized vectors all-reduced (the rows'
    partial O/down projections and embedding lookups): a split that left a drafter weight,
    table or KV pool on the wrong devices would move it."""
    for tp in (2, 4):
        r = tp_runs[tp]
        for name, c in r["collectives"].items():
            rows = K + 1 if name.startswith("verify") else 1
            assert c["all-gather"] <= 64, (tp, name, c)
            assert 0 < c["all-reduce"] <= OPTS["max_seqs"] * rows * r["hidden_size"], \
                (tp, name, c)


# ---------------------------------------------------------------------------------------------
# The rules


def _ir(model: str, assistant: str, target: str = "tpu-int8"):
    from rvcompile.build import lower_model
    from rvcompile.sources.checkpoint import load_assistant_source, load_model_source

    source = load_model_source(model, random_weights=True)
    drafter = load_assistant_source(assistant, source.config, random_weights=True)
    return lower_model(source, BuildOptions(target, max_context=128, prefill_buckets=(16,),
                                            draft_tokens=K), log=lambda s: None,
                       assistant=drafter.config)


@pytest.mark.parametrize("model,centroids", [("gemma-4-tiny", True),
                                             ("gemma-4-tiny-dense", False)])
def test_drafter_split_rules(model, centroids):
    from rvcompile.targets.xla.program import plan_layout
    from rvcompile.targets.xla.sharding import plan_tp

    ir = _ir(model, f"{model}-assistant")
    assert ir.assistant.config.use_ordered_embeddings is centroids
    w = plan_tp(ir, plan_layout(ir), 2).weights
    col, row, whole = ("tp", None), (None, "tp"), (None, None)
    layers = {k for k in w if k.startswith("assistant.layers.")}
    assert layers
    for key in layers:
        rel = key.split(".", 3)[3]
        want = {"self_attn.q_proj.weight": col, "self_attn.q_proj.weight.scale": ("tp",),
                "self_attn.o_proj.weight": row, "self_attn.o_proj.weight.scale": (None,),
                "mlp.gate_proj.weight": col, "mlp.up_proj.weight": col,
                "mlp.gate_proj.weight.scale": ("tp",), "mlp.up_proj.weight.scale": ("tp",),
                "mlp.down_proj.weight": row, "mlp.down_proj.weight.scale": (None,)}
        assert w[key] == want.get(rel, (None,) * len(w[key])), key
    assert w["assistant.embed_tokens.weight"] == (whole if centroids else col)
    if not centroids:  # int8 rows and their scales (a centroid head's table stays bf16)
        assert w["assistant.embed_tokens.weight.scale"] == ("tp",)
    for name in ("assistant.pre_projection.weight", "assistant.post_projection.weight"):
        assert w[name] == whole, name
    if centroids:
        assert w["assistant.masked_embedding.centroids.weight"] == whole
        assert w["assistant.masked_embedding.token_ordering"] == (None,)
    assert w["embed_tokens.weight"] == col  # the target's table, the drafter's input too


def test_the_31b_and_its_assistant_export_with_tp4():
    """6 layers of the 31B (one pattern period) and its assistant's published shape, tpu-int8,
    --tp 4: draft and verify export over the mesh, the drafter's 32 query heads 8 a device over
    the 16 sliding / 4 global KV heads the pools split (no devices needed)."""
    from jax import export

    from rvcompile.build import lower_model
    from rvcompile.sources.checkpoint import load_assistant_source, load_model_source
    from rvcompile.targets.xla.export import lower_to_xla

    source = load_model_source("gemma-4-31B", random_weights=True)
    cfg = source.config
    source = dataclasses.replace(source, config=dataclasses.replace(
        cfg, num_layers=6, layer_kinds=cfg.layer_kinds[:6]))
    drafter = load_assistant_source("gemma-4-31B-assistant", source.config, random_weights=True)
    ir = lower_model(source, BuildOptions("tpu-int8", max_context=256, prefill_buckets=(16,),
                                          draft_tokens=K), log=lambda s: None,
                     assistant=drafter.config)
    low = lower_to_xla(ir, max_seqs=2, prefill_buckets=(16,), platforms=("tpu",), tp=4,
                       draft_tokens=K)
    for name in ("draft_2", f"verify_2x{K + 1}"):
        assert export.deserialize(bytearray(low.programs[name])).nr_devices == 4, name
    mesh = low.manifest["mesh"]["weights"]
    assert mesh["assistant.layers.0.self_attn.q_proj.weight"] == ["tp", None]
    assert mesh["assistant.layers.0.mlp.down_proj.weight"] == [None, "tp"]
    assert mesh["assistant.embed_tokens.weight"] == ["tp", None]
    pools = low.manifest["mesh"]["pools"]
    # pools [layers, blocks, 16, K * D]: split over the heads side by side in the last axis
    assert pools and all(s == [None, None, None, "tp"] for s in pools.values())


@pytest.mark.parametrize("field,kw", [("num_attention_heads 2", {"heads": 2, "mlp": 128}),
                                      ("intermediate_size 130", {"heads": 4, "mlp": 130})])
def test_a_drafter_that_does_not_split_is_refused_in_one_line(tmp_path, field, kw):
    from cli_output import without_progress

    from rvcompile.model.presets import _assistant, get_preset

    a = _assistant(get_preset("gemma-4-tiny-dense"), hidden=64, layers=2, **kw)
    adir = tmp_path / "narrow-assistant"
    adir.mkdir()
    (adir / "config.json").write_text(json.dumps(a.to_hf_dict()))
    out = tmp_path / "x.rvp"
    p = subprocess.run([RVCOMPILE, "build", "gemma-4-tiny-dense", "--random-weights",
                        "--target", "xla-f32", "--platforms", "cpu", "--max-context", "64",
                        "--prefill-buckets", "16", "--assistant", str(adir), "--tp", "4",
                        "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert without_progress(p.stderr) == [
        f"rvcompile: error: assistant narrow-assistant: text_config.{field} does not split "
        "over --tp 4 devices"], p.stderr
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# --topology (needs libtpu)

def _libtpu_env() -> dict | None:
    env = dict(os.environ)
    if TPU_AOT.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TPU_AOT), env.get("PYTHONPATH")]))
        return env
    return env if importlib.util.find_spec("libtpu") else None


def test_build_draft_and_verify_for_a_tpu_topology(tmp_path):
    from rvcompile.artifacts import Artifact

    env = _libtpu_env()
    if env is None:
        pytest.skip("libtpu is not installed (scripts/setup.sh puts it in .venv/tpu-aot)")
    out = tmp_path / "v6e.rvp"
    r = subprocess.run([RVCOMPILE, "build", "gemma-4-tiny-dense", "--target", "tpu-int8",
                        "--random-weights", "--assistant", "gemma-4-tiny-dense-assistant",
                        "--max-context", "64", "--prefill-buckets", "16", "--max-seqs", "1",
                        "--decode-loop-steps", "0", "--platforms", "tpu", "--tp", "2",
                        "--topology", "v6e:1x2", "-o", str(out)],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    with Artifact.open(out) as art:
        x = art.manifest["xla"]
    rec = x["precompiled"]["v6e:1x2"]
    assert rec["device_kind"] == "TPU v6 lite" and rec["device_ids"] == [0, 1]
    assert sorted(rec["entries"]) == ["decode_1", "draft_1", "logits_16", "prefill_16",
                                      "verify_1x4"]
    assert (x["speculative"]["draft"], x["speculative"]["verify"]) == ("draft_1", "verify_1x4")
    pools = len(x["kv"]["pools"])
    donated = {name: sum(op["donated"] for op in e["operands"]["inputs"])
               for name, e in rec["entries"].items()}
    assert donated == {**dict.fromkeys(rec["entries"], pools), "draft_1": 0}
    # draft returns tokens, logits, draft_probs and states, whole on both chips; verify the
    # pools, then its tokens and states
    draft_out = rec["entries"]["draft_1"]["operands"]["outputs"]
    assert [o["shape"][:2] for o in draft_out] == [[1, K]] * 4
    assert all(not any(o["spec"]) for o in draft_out)
    verify_out = rec["entries"]["verify_1x4"]["operands"]["outputs"][pools:]
    assert [o["shape"][:2] for o in verify_out] == [[1, K + 1]] * 2


if __name__ == "__main__":
    _child(sys.argv[1])
