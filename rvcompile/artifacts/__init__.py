"""The .rvp artifact container: one file, a checked header, a JSON manifest, mmap-able sections.

Layout and every header field: `format.py`. Writer and reader: `container.py`.
"""

from rvcompile.artifacts.container import Artifact, ArtifactWriter, check_platform
from rvcompile.artifacts.format import (
    FORMAT_VERSION,
    ArtifactError,
    ArtifactHeader,
    SectionInfo,
)

__all__ = [
    "FORMAT_VERSION",
    "Artifact",
    "ArtifactError",
    "ArtifactHeader",
    "ArtifactWriter",
    "SectionInfo",
    "check_platform",
]
