#!/bin/sh
# Roll out a new artifact to a host running examples/deploy/rvrun.service:
#   1. copy it beside the served one (same filesystem, so the swap below is a rename),
#   2. check it: signature by the release key, every section's sha256 (check_artifact.py),
#   3. point current.rvp at it (an atomic symlink swap; the previous target is kept),
#   4. restart the unit (SIGTERM drains in-flight requests) and wait for /health,
#   5. on failure, point current.rvp back and restart again.
#
#   sudo examples/deploy/rollout.sh /tmp/g31-2026-11-24.rvp
#
# Settings (environment): RVRUN_ARTIFACTS (/srv/rvcompile/artifacts), RVRUN_KEY
# (/etc/rvrun/release.pub), RVRUN_PYTHON (/opt/rvrun/bin/python), RVRUN_UNIT (rvrun),
# RVRUN_HEALTH (http://127.0.0.1:8080/health), RVRUN_START_S (300: the unit's start budget).
set -eu

new=${1:?usage: rollout.sh NEW.rvp}
dir=${RVRUN_ARTIFACTS:-/srv/rvcompile/artifacts}
key=${RVRUN_KEY:-/etc/rvrun/release.pub}
python=${RVRUN_PYTHON:-/opt/rvrun/bin/python}
unit=${RVRUN_UNIT:-rvrun}
health=${RVRUN_HEALTH:-http://127.0.0.1:8080/health}
start_s=${RVRUN_START_S:-300}
here=$(cd "$(dirname "$0")" && pwd)

name=$(basename "$new")
if [ -e "$dir/$name" ]; then
    echo "rollout: $dir/$name exists; give the new artifact a new name" >&2
    exit 2
fi
cp "$new" "$dir/.$name.tmp"
mv "$dir/.$name.tmp" "$dir/$name"

if ! "$python" "$here/check_artifact.py" "$dir/$name" --trusted-key "$key"; then
    rm -f "$dir/$name"
    exit 2
fi

point() {  # point current.rvp at $1, atomically
    ln -sfn "$1" "$dir/.current.rvp.new"
    mv -T "$dir/.current.rvp.new" "$dir/current.rvp"
}

healthy() {  # /health answers 200 within the start budget
    waited=0
    while [ "$waited" -lt "$start_s" ]; do
        if "$python" -c "import urllib.request as u; u.urlopen('$health', timeout=4)" \
                2>/dev/null; then
            return 0
        fi
        sleep 5
        waited=$((waited + 5))
    done
    return 1
}

previous=$(readlink "$dir/current.rvp" || true)
point "$name"
systemctl restart "$unit"
if healthy; then
    echo "rollout: serving $name (was ${previous:-nothing})"
    exit 0
fi
echo "rollout: $name did not become healthy; back to ${previous:-nothing}" >&2
if [ -n "$previous" ]; then
    point "$previous"
    systemctl restart "$unit"
fi
exit 1
