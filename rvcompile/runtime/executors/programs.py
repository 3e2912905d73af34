"""The artifact's exported programs (manifest `xla.programs`), deserialized and checked before
anything compiles them.

`jax.export.deserialize` reads a program from flatbuffers (no pickle; pytree nodes only of types
registered in this process). The StableHLO inside is then compiled and run, so what it may call
is checked here: jax.export refuses, when exporting, custom calls outside the targets it keeps
stable (`_CUSTOM_CALL_TARGETS_GUARANTEED_STABLE`: XLA's own kernels, sharding markers, shape
assertions) unless the exporter disables that check, and rvcompile never does. A file can still
hold any custom call, and some run host code with what the file gives them (a host-callback
target with no callback registered crashes the process), so `load_programs` refuses a program
that disables a safety check or calls a target outside that list, naming the program and target.
"""

from __future__ import annotations

from jax import export

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.artifacts.manifest import XlaManifest
from rvcompile.artifacts.xla_programs import xla_programs


def custom_call_targets(exp: export.Exported) -> set[str]:
    """Every custom-call target named in `exp`'s StableHLO."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    targets: set[str] = set()
    with mlir.make_ir_context():
        module = exp.mlir_module(serialized=False)
        stack = [module.operation]
        while stack:
            op = stack.pop()
            if op.name == "stablehlo.custom_call":
                targets.add(ir.StringAttr(op.attributes["call_target_name"]).value)
            stack.extend(inner.operation for region in op.regions for block in region
                         for inner in block)
    return targets


def check_program(where: str, exp: export.Exported) -> None:
    """Refuse a program that disables a jax.export safety check or calls a custom target jax
    does not keep stable."""
    from jax._src.export import _export

    if exp.disabled_safety_checks:
        raise ArtifactError(f"{where}: disables jax.export safety checks "
                            f"({exp.disabled_safety_checks[0]}); rvcompile never does")
    try:
        targets = custom_call_targets(exp)
    except Exception as e:  # MLIR bytecode that does not parse
        raise ArtifactError(f"{where}: its StableHLO does not parse: "
                            f"{str(e).strip().splitlines()[0]}") from None
    unknown = sorted(targets - _export._CUSTOM_CALL_TARGETS_GUARANTEED_STABLE)
    if unknown:
        raise ArtifactError(f"{where}: calls custom target {unknown[0]!r}, which rvrun does not "
                            "run (not one jax.export keeps stable)")


def load_programs(art: Artifact, xla: XlaManifest) -> dict[str, export.Exported]:
    """Entry name -> Exported of every program in the checked manifest part `xla`: each takes
    what the manifest describes (artifacts/xla_programs.py) and calls nothing unsafe."""
    programs = xla_programs(art, xla)
    for name, exp in programs.items():
        check_program(f"{art.path.name}: program {name}", exp)
    return programs
