"""Check an artifact before it is served, on a host with only the runtime installed
(`rvcompile[h100,serve]`, no `rvcompile` CLI): a valid Ed25519 signature by one of the trusted
keys, then everything `rvcompile verify` checks (manifest, every section's sha256, the contents).

    python check_artifact.py NEW.rvp --trusted-key release.pub [--trusted-key other.pub]

Exit 0 and one line when it passes; exit 2 and one `check_artifact: error:` line naming what
failed otherwise. rollout.sh runs it before it swaps the served artifact.
"""

from __future__ import annotations

import argparse
import sys

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.artifacts.signature import load_trusted_key
from rvcompile.artifacts.verify import verify_artifact


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--trusted-key", action="append", required=True, metavar="PUB",
                    help="PEM Ed25519 public key whose signature is required (repeatable)")
    args = ap.parse_args(argv)
    try:
        keys = [load_trusted_key(k) for k in args.trusted_key]
        with Artifact.open(args.artifact, trusted_keys=keys) as art:
            manifest = verify_artifact(art)
    except (ArtifactError, OSError) as e:
        print(f"check_artifact: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.artifact}: OK ({manifest.target}, signed by a trusted key)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
