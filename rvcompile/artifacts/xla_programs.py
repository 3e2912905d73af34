"""An XLA artifact's programs (section "programs"), deserialized and checked against its manifest:
each entry point is a jax.export program taking the weight arrays, KV pools, block tables and
token rows the manifest describes. The one artifacts module that needs jax: the xla runtime
(runtime/executors/programs.py) and `rvcompile verify` import it, an h100 host never does.
"""

from __future__ import annotations

import jax
from jax import export

from rvcompile.artifacts.container import Artifact
from rvcompile.artifacts.contents import first_line
from rvcompile.artifacts.format import ArtifactError
from rvcompile.artifacts.manifest import XlaManifest, entry_rows


def xla_programs(art: Artifact, xla: XlaManifest) -> dict:
    """Entry point name -> its jax.export.Exported, each checked to take what the manifest
    describes: the weight arrays and KV pools (names, shapes, dtypes; with kv.fixed_blocks,
    each pool's block count its kind's default_blocks), one block table per KV kind and the
    entry's token rows."""
    blob = art.buffer("programs")
    out = {}
    for name, loc in xla.programs.items():
        where = f"{art.path.name}: program {name}"
        try:  # bytes from the file: any failure of the deserializer is the file's
            exp = export.deserialize(bytearray(blob[loc.offset:loc.offset + loc.size]))
            args = _unflatten(exp)
        except Exception as e:
            raise ArtifactError(f"{where} is not a jax.export program ({first_line(e)})"
                                ) from None
        _check_signature(where, name, args, xla)
        out[name] = exp
    return out


def _unflatten(exp):
    return jax.tree.unflatten(exp.in_tree, exp.in_avals)[0]


def _check_signature(where: str, name: str, args, xla: XlaManifest) -> None:
    """args: the program's positional avals (weights dict, pools dict, tokens, start, n_new,
    tables dict, ...)."""
    if not (isinstance(args, tuple) and len(args) >= 6
            and all(isinstance(args[i], dict) for i in (0, 1, 5))):
        raise ArtifactError(f"{where} does not take (weights, pools, tokens, start, n_new, "
                            "tables, ...)")
    batch, rows = entry_rows(name)
    # a pool's block count: fixed at build, or whatever the program's (symbolic) dimension
    blocks = {k.name: k.default_blocks if xla.fixed_blocks else None
              for k in xla.kinds.values()}
    want = {
        ("weight", w.key): (w.shape, w.dtype) for w in xla.weights} | {
        ("pool", p.key): ((p.layers, blocks[p.kind], *p.block_shape), p.dtype)
        for p in xla.pools} | {
        ("table", k.name): ((batch, k.table_width), "int32") for k in xla.kinds.values()} | {
        ("tokens", ""): ((batch, rows), "int32")}
    got = {(group, key): aval for group, d in (("weight", args[0]), ("pool", args[1]),
                                              ("table", args[5]), ("tokens", {"": args[2]}))
           for key, aval in d.items()}
    if set(got) != set(want):
        diff = sorted(set(got) ^ set(want))[0]
        raise ArtifactError(f"{where}: the manifest and the program disagree on {diff[0]} "
                            f"{diff[1]!r}")
    spec = xla.speculative
    if spec and spec.draft and name == spec.verify:  # the ratio rule's inputs come last (v6)
        if len(args) != 13 or any(isinstance(a, dict) for a in args[-2:]):
            raise ArtifactError(f"{where} does not take (..., sampling, draft_probs, "
                                "draft_lane)")
        want |= {("draft_probs", ""): ((batch, spec.draft_tokens, None), "float32"),
                 ("draft_lane", ""): ((batch,), "int32")}
        got |= {("draft_probs", ""): args[-2], ("draft_lane", ""): args[-1]}
    for (group, key), (shape, dtype) in want.items():
        aval = got[(group, key)]
        dims = tuple(d if isinstance(d, int) else None for d in getattr(aval, "shape", ()))
        fixed = tuple(None if w is None else g for w, g in zip(shape, dims, strict=False))
        if len(dims) != len(shape) or fixed != shape or str(aval.dtype) != dtype:
            raise ArtifactError(f"{where} takes {group} {key!r} as {aval.dtype}"
                                f"{list(aval.shape)}; the manifest says {dtype}{list(shape)}")
