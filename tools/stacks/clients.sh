#!/usr/bin/env bash
# tools/stacks/clients.sh LEG: one leg of `make test-clients` (issues 22, 33,
# 41): the real clients' tests (tests/clients) and the examples' --check loops
# on NP ranks (default 4), 200 steps each, with every client required.
#
#   debian12  this machine's Debian 12 and the project's venv (PY, default
#             .venv/bin/python): DOLFINx 0.5.2, slepc4py 3.18, h5py 3.7
#   debian13  the Debian 13 chroot of `make test-stack-debian13`, through
#             tools/stack-run: DOLFINx 0.9.0, slepc4py 3.22, h5py 3.13
#
# The Makefile installs the clients first (its test-clients-LEG targets). The
# first line says which versions the leg runs, the last that it passed and its
# wall time; the first failure ends the leg.
set -euo pipefail
cd "$(dirname "$0")/../.."
LEG=${1:?usage: tools/stacks/clients.sh LEG  (debian12, debian13)}
NP=${NP:-4}
read -r -a pytest_flags <<<"${PYTEST_FLAGS:--q -x --color=no}"
case $LEG in
debian12) run=() py=${PY:-.venv/bin/python} ;;
debian13) run=(tools/stack-run debian13) py=python ;;
*)
    echo "tools/stacks/clients.sh: unknown leg $LEG (debian12, debian13)" >&2
    exit 2
    ;;
esac

start=$SECONDS
# A missing client fails here, before anything runs (client_versions.py), and
# in the tests (conftest.import_client fails instead of skipping: tools/
# stack-run passes CGC_* into the chroot).
versions=$("${run[@]}" "$py" tools/stacks/client_versions.py)
echo "test-clients $LEG: $versions"
export CGC_REQUIRE_DOLFINX=1 CGC_REQUIRE_H5PY=1 CGC_REQUIRE_SLEPC=1

step() {
    echo "test-clients $LEG: $*"
    "${run[@]}" tools/mpirun "$NP" 900 "$py" -m mpi4py "$@"
}
step -m pytest "${pytest_flags[@]}" --with-mpi tests/clients
step examples/dolfinx_loop.py --steps 200 --check
step examples/slepc_loop.py --steps 200 --check
step examples/h5py_loop.py --steps 200 --check
echo "test-clients $LEG: $versions: tests/clients and 3 loops passed, $((SECONDS - start)) s"
