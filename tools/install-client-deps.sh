#!/usr/bin/env bash
# The real clients `make test-clients` runs: Debian 12's DOLFINx 0.5.2
# (python3-dolfinx, ~118 packages, petsc-dev among them). Kept apart from
# tools/install-system-deps.sh so that `make test` does not need DOLFINx.
set -euo pipefail
PKGS="python3-dolfinx"
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "collective_gc: installing the client packages:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # shellcheck disable=SC2086
    apt-get install -y -qq $missing >/dev/null
    exit 0
fi
echo "make test-clients needs:$missing (Debian/Ubuntu, as root: apt-get install$missing)" >&2
exit 1
