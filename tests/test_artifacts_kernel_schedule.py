"""KernelSchedule.from_json checks a well-formed launch directly on the JSON values (the fast
path: a 31B schedule has thousands of launches) and anything else through At, which names the
field. The two must agree: the same schedule from both, and every damaged launch refused, with
At's message, whichever path saw it first."""

from __future__ import annotations

import copy
import json

import pytest

from rvcompile.artifacts import kernel_schedule as ks
from rvcompile.artifacts.kernel_schedule import KernelSchedule
from rvcompile.artifacts.schema import SchemaError
from rvcompile.build import BuildOptions, lower_model
from rvcompile.model.presets import get_preset
from rvcompile.sources.model_source import ModelSource


@pytest.fixture(scope="module")
def schedule_json() -> dict:
    """gemma-4-tiny's h100-fp8 schedule (shape only; its GEMM launches take parameter
    blocks), with a placeholder cubin entry per module."""
    from rvcompile.targets.h100.lower import lower_to_h100

    cfg = get_preset("gemma-4-tiny")
    opts = BuildOptions("h100-fp8", max_seqs=4, prefill_buckets=(16, 64), max_context=2048)
    ir = lower_model(ModelSource(cfg, (), "", {}, None, "t"), opts, log=lambda s: None)
    low = lower_to_h100(ir, max_seqs=opts.max_seqs, prefill_buckets=opts.prefill_buckets)
    d = json.loads(json.dumps(low.schedule.to_json()))  # as a reader sees it: lists
    d["cubins"] = {m: {"offset": 0, "size": 1, "sha256": "0" * 64} for m in low.modules}
    return d


def _slow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ks, "_plain_launch", lambda *a: None)
    monkeypatch.setattr(ks, "_plain_block", lambda *a: None)


def _params_launch(d: dict) -> tuple[str, int, int]:
    """(entry, launch, argument) of the first "params" argument."""
    for name, e in d["entries"].items():
        for i, x in enumerate(e["launches"]):
            for j, a in enumerate(x["args"]):
                if a["kind"] == "params":
                    return name, i, j
    raise AssertionError("the schedule has no parameter block")


def test_fast_and_at_paths_read_the_same_schedule(schedule_json, monkeypatch):
    fast = KernelSchedule.from_json(schedule_json)
    assert any(a.kind == "params" for e in fast.entries.values() for x in e.launches
               for a in x.args)
    _slow(monkeypatch)
    assert KernelSchedule.from_json(schedule_json) == fast


def _damage(d: dict, what: str) -> None:
    entry, i, j = _params_launch(d)
    x = d["entries"][entry]["launches"][i]
    block = x["args"][j]["value"]
    role = next(iter(block["roles"]))
    edits = {
        "grid true": lambda: x.__setitem__("grid", [True, 1, 1]),
        "grid float": lambda: x.__setitem__("grid", [1.0, 1, 1]),
        "block z past 64": lambda: x.__setitem__("block", [1, 1, 65]),
        "smem true": lambda: x.__setitem__("smem", True),
        "kernel too long": lambda: x.__setitem__("kernel", "k" * 5000),
        "kernel a number": lambda: x.__setitem__("kernel", 7),
        "module not a string": lambda: x.__setitem__("module", ["head.cu"]),
        "launch not an object": lambda: d["entries"][entry]["launches"].__setitem__(i, [1]),
        "template unknown": lambda: block.__setitem__("template", "nope"),
        "template a number": lambda: block.__setitem__("template", 1),
        "role missing": lambda: block["roles"].pop(role),
        "role added": lambda: block["roles"].__setitem__("extra", 0),
        "role past the arena": lambda: block["roles"].__setitem__(role, d["arena_bytes"]),
        "role negative": lambda: block["roles"].__setitem__(role, -1),
        "role true": lambda: block["roles"].__setitem__(role, True),
        "block with an unknown key": lambda: block.__setitem__("x", 1),
        "block not an object": lambda: x["args"][j].__setitem__("value", 5),
    }
    edits[what]()


DAMAGE = ("grid true", "grid float", "block z past 64", "smem true", "kernel too long",
          "kernel a number", "module not a string", "launch not an object", "template unknown",
          "template a number", "role missing", "role added", "role past the arena",
          "role negative", "role true", "block with an unknown key", "block not an object")


@pytest.mark.parametrize("what", DAMAGE)
def test_damaged_launch_refused_alike_on_both_paths(schedule_json, monkeypatch, what):
    d = copy.deepcopy(schedule_json)
    _damage(d, what)
    with pytest.raises(SchemaError) as fast:
        KernelSchedule.from_json(d)
    _slow(monkeypatch)
    with pytest.raises(SchemaError) as slow:
        KernelSchedule.from_json(d)
    assert str(fast.value) == str(slow.value)
    assert "launches[" in str(fast.value)


def test_a_long_kernel_name_does_not_pass_as_an_argument_name(schedule_json):
    """Kernel names (any length) and argument names (at most 64 characters) are remembered
    apart: a kernel name seen once does not let an argument of that name skip its check."""
    d = copy.deepcopy(schedule_json)
    launches = next(iter(d["entries"].values()))["launches"]
    long = "k" * 80
    launches[0]["kernel"] = long  # well formed, so remembered (the cubin check refuses it)
    launches[1]["args"][0]["name"] = long
    with pytest.raises(SchemaError, match=r"launches\[1\]\.args\[0\]\.name"):
        KernelSchedule.from_json(d)
