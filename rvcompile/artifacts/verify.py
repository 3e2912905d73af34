"""`verify_artifact`: everything a reader can check of a model artifact without running it (what
`rvcompile verify` does): the manifest, every section's sha256, the small sections' contents,
and an XLA artifact's programs (jax is imported only for those)."""

from __future__ import annotations

from rvcompile.artifacts.container import Artifact
from rvcompile.artifacts.contents import read_contents
from rvcompile.artifacts.manifest import Manifest, read_manifest


def verify_artifact(art: Artifact) -> Manifest:
    """Every check short of running: the manifest, every section's sha256, the contents, and
    an XLA artifact's programs."""
    manifest = read_manifest(art)
    art.verify()
    read_contents(art, manifest)
    if manifest.xla:
        from rvcompile.artifacts.xla_programs import xla_programs

        xla_programs(art, manifest.xla)
    return manifest
