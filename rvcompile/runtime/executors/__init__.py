"""The executors behind the engine (runtime/executor_api.py): `xla` runs an artifact's exported
programs through jax; `h100` replays its kernel schedule through the CUDA driver (`scheduled`
walks the schedule; `cuda_driver`, `tma` talk to the driver). Each of `xla` and `h100` opens
its own artifacts with `open_executor(art, manifest, LoadOptions)` (runtime.load dispatches on
the header's runtime kind); what they share for that is here."""

from __future__ import annotations

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.runtime.engine import engine_limits
from rvcompile.runtime.executor_api import KvKind, LoadOptions


def check_limits(art: Artifact, kinds: dict[str, KvKind], block_size: int, decode_width: int,
                 max_context: int, opts: LoadOptions) -> None:
    """Refuse (ArtifactError naming `art`) engine limits in `opts` that an executor of this
    shape cannot meet (engine.engine_limits), before anything is uploaded or compiled."""
    try:
        engine_limits(kinds, block_size, decode_width, max_context, opts.max_num_seqs,
                      opts.max_model_len)
    except ValueError as e:
        raise ArtifactError(f"{art.path.name}: {e}") from None
