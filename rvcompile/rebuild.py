"""`rvcompile recipe ART` and `rvcompile rebuild ART`: read the recipe an artifact stores
(manifest "provenance", provenance.py), build it again and say whether the new file is the old
one byte for byte, or where and why it differs.

A build is deterministic: the same recipe, input files and toolchain give the same bytes (no
timestamps, host names or paths beyond what the recipe names; maps written in a fixed order;
work spread over threads is gathered in order). So a difference is explained by what
provenance records: a different toolchain (named: "jax 0.10.0 in ART, 0.11.1 here"), which
accounts for the sections it shapes, or else, with the same toolchain, a bug, reported as such.
The signature page is not rebuilt: a signed original compares equal up to it (signing the
rebuild with the same key gives the same page: Ed25519 signatures are deterministic).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.artifacts.format import decode_header_block
from rvcompile.artifacts.manifest import read_manifest
from rvcompile.provenance import build_recipe, toolchain
from rvcompile.recipe import Recipe, parse_recipe
from rvcompile.sources.model_source import CheckpointError


@dataclass(frozen=True)
class StoredRecipe:
    recipe: Recipe
    toolchain: dict[str, str | None]
    inputs: dict[str, dict[str, str]]  # "model" / "assistant" -> file name -> sha256 hex

    def to_yaml(self, artifact: str) -> str:
        """The recipe as `rvcompile build --config` reads it, the toolchain and input files as
        comments."""
        tools = ", ".join(f"{k} {v}" for k, v in self.toolchain.items() if v is not None)
        lines = [f"rvcompile recipe of {artifact}", f"built with {tools}"]
        for role, files in self.inputs.items():
            lines.append(f"{role} input files (sha256):")
            lines += [f"  {digest}  {name}" for name, digest in sorted(files.items())]
        return self.recipe.to_yaml("\n".join(lines))


def stored_recipe(path: Path) -> StoredRecipe:
    """The recipe `path` stores, checked (ArtifactError, or RecipeError naming the key)."""
    path = Path(path)
    with Artifact.open(path) as art:
        m = read_manifest(art)
        ranges = (art.manifest.get("random_weights") or {}).get("ranges")
    if m.provenance is None:
        raise ArtifactError(f"{path.name}: no recipe stored (built without one: by an "
                            "rvcompile before recipes, or by build_artifact called directly)")
    if ranges is not None:
        raise ArtifactError(f"{path.name}: its random weights were drawn by rule {ranges!r}, "
                            "which a recipe cannot name")
    recipe = parse_recipe(m.provenance.recipe, f"{path.name}: manifest.provenance.recipe")
    return StoredRecipe(recipe, m.provenance.toolchain, m.provenance.inputs)


@dataclass(frozen=True)
class RebuildReport:
    path: Path
    identical: bool  # byte for byte, the signature page aside
    differences: tuple[str, ...]  # one line each, the toolchain's first
    signatures: int  # on the original's signature page, which the rebuild does not have


def rebuild(artifact: Path, out: Path, *, weights: Path | None = None,
            log: Callable[[str], None] = print) -> RebuildReport:
    """Build `artifact`'s stored recipe into `out` and compare. `weights`: the model's
    checkpoint directory, when it is no longer where the recipe says; its name must be the
    recipe's (the model's name in the artifact), its files those the recipe's digest covers."""
    artifact, out = Path(artifact), Path(out)
    stored = stored_recipe(artifact)
    if weights is not None:
        recorded = stored.recipe.model.weights or stored.recipe.model.source
        if Path(weights).name != Path(recorded).name:
            raise CheckpointError(f"--weights {weights}: the recipe's checkpoint directory is "
                                  f"named {Path(recorded).name!r} (the artifact records the "
                                  "name); give a directory of that name")
    if out.resolve() == artifact.resolve():
        raise CheckpointError(f"-o {out}: the rebuild must not overwrite {artifact.name}")
    build_recipe(stored.recipe, out, read_from=weights, recorded_inputs=stored.inputs, log=log)
    differences = compare(artifact, out)
    with Artifact.open(artifact) as a:
        signatures = len(a.signatures)
    return RebuildReport(out, not differences, differences, signatures)


def compare(old: Path, new: Path) -> tuple[str, ...]:
    """() when `new` is `old` byte for byte up to the signature page; else one line per
    difference: the toolchain's, the header's, each section's, the manifest's first."""
    with Artifact.open(old) as a, Artifact.open(new) as b:
        end_a, end_b = (_manifest_end(x) for x in (a, b))  # where the signature page starts
        if end_a == end_b and _same_bytes(a.path, b.path, end_a):
            return ()
        tools_a = (a.manifest.get("provenance") or {}).get("toolchain", {})
        tools_b = (b.manifest.get("provenance") or {}).get("toolchain", toolchain(b.manifest))
        changed = [f"{k} {tools_a.get(k)} in {a.path.name}, {tools_b.get(k)} here"
                   for k in sorted(set(tools_a) | set(tools_b))
                   if tools_a.get(k) != tools_b.get(k)]
        why = ("expected with a different toolchain" if changed
               else "same recipe, inputs and toolchain: the build is not deterministic, a bug")
        out = [f"different toolchain: {'; '.join(changed)}"] if changed else []
        for key in ("compiler_version", "target", "platforms", "requirements"):
            if getattr(a.header, key) != getattr(b.header, key):
                out.append(f"header {key}: {getattr(a.header, key)!r} in {a.path.name}, "
                           f"{getattr(b.header, key)!r} here ({why})")
        for name in sorted(set(a.sections) | set(b.sections)):
            sa, sb = a.sections.get(name), b.sections.get(name)
            if sa is None or sb is None:
                out.append(f"section {name}: only in {(a if sb is None else b).path.name}")
            elif (sa.size, sa.digest) != (sb.size, sb.digest):
                out.append(f"section {name} differs ({sa.size:,} B, {sb.size:,} B rebuilt; "
                           f"{why})")
        for key in sorted(set(a.manifest) | set(b.manifest)):
            where = _first_difference(a.manifest.get(key), b.manifest.get(key), key)
            if where is not None:
                out.append(f"manifest {where} ({why})")
        if not out:  # the same content laid out otherwise: the writer is not deterministic
            out.append(f"the files differ in layout only ({why})")
        return tuple(out)


def _manifest_end(art: Artifact) -> int:
    """Where the manifest ends: an unsigned file ends there, a signed one has zeros (checked
    at open) up to its signature page."""
    blob = decode_header_block(art.signable.header_block, art.path.name).manifest
    return blob.offset + blob.size


def _same_bytes(a: Path, b: Path, size: int, block: int = 16 << 20) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        left = size
        while left > 0:
            n = min(block, left)
            if fa.read(n) != fb.read(n):
                return False
            left -= n
    return True


def _first_difference(x: Any, y: Any, path: str) -> str | None:
    """The JSON path of the first place `x` and `y` differ, with both values, else None."""
    if isinstance(x, dict) and isinstance(y, dict):
        for k in sorted(set(x) | set(y)):
            d = _first_difference(x.get(k), y.get(k), f"{path}.{k}")
            if d is not None:
                return d
        return None
    if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            d = _first_difference(u, v, f"{path}[{i}]")
            if d is not None:
                return d
        return None
    if x == y:
        return None

    def short(v: Any) -> str:
        text = json.dumps(v, sort_keys=True)
        return text if len(text) <= 60 else text[:57] + "..."

    return f"{path}: {short(x)} vs {short(y)} rebuilt"
