#!/usr/bin/env bash
# tools/install-system-deps.sh [PKG...]: make sure Debian's packages are present,
# by default the MPI/PETSc stack `make test` needs (OpenMPI, mpi4py, petsc4py,
# numpy); `make test-clients` names DOLFINx, h5py's MPI build and slepc4py,
# the debian13 leg its host tools.
# Root on Debian/Ubuntu: installs what is missing with apt-get. Elsewhere: says
# what to install and exits non-zero.
set -euo pipefail
# python3-dev, gcc and libopenmpi-dev (mpicc, with mpi4py's headers) build the optional C
# extension (collective_gc._speedups) with its sync-point steady state; setuptools and
# wheel build it without build isolation, which would hide mpi4py from the build.
# procps: pgrep, with which a launcher test checks that no rank outlived SIGTERM.
DEFAULT_PKGS="procps openmpi-bin libopenmpi-dev python3-mpi4py python3-petsc4py python3-numpy python3-venv python3-dev python3-setuptools python3-wheel gcc python3-matplotlib"
PKGS=${*:-$DEFAULT_PKGS}
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -z "$missing" ]; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "collective_gc: installing Debian packages:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # shellcheck disable=SC2086
    apt-get install -y -qq $missing >/dev/null
    exit 0
fi
if [ $# -gt 0 ]; then
    echo "collective_gc: missing Debian packages:$missing (as root: apt-get install$missing)" >&2
    exit 1
fi
cat >&2 <<MSG
collective_gc needs an MPI implementation with mpi4py, petsc4py and numpy. Missing:$missing
  Debian/Ubuntu (as root):  apt-get install$missing
  conda-forge:              conda install -c conda-forge openmpi mpi4py petsc4py numpy
  pip (with an MPI and PETSc already built): pip install mpi4py petsc4py numpy
Then run make again (set PYTHON to the interpreter that sees them).
MSG
exit 1
