#!/usr/bin/env bash
# Build the Debian 13 (trixie) chroot of the `debian13` leg of `make test-stacks`
# in DIR: Debian's own Python 3.13, mpi4py 4.0, petsc4py 3.22 and Open MPI 5.
# debian13-chroot.sh DIR PKG...: the same, with Debian 13's packages PKG also
# installed in it (`make test-clients-debian13` names DOLFINx 0.9, slepc4py
# 3.22 and h5py 3.13 so: `make test-stacks` does not need their ~210 packages).
# Needs root, debootstrap and rsync (installed here with apt-get when missing).
# Idempotent: a finished chroot is marked with DIR/.bootstrapped; packages
# added to APT_PKGS since are installed into it.
set -euo pipefail
DIR=${1:?usage: debian13-chroot.sh DIR [PKG...]}
shift

# The host's tools for this leg, checked even when the chroot exists: a chroot
# made on another machine (or kept in .stacks/) does not bring them. debootstrap
# builds the chroot; tools/stack-run copies the tree in with rsync.
bash "$(dirname "$0")/../install-system-deps.sh" debootstrap rsync

# python3-pytest and python3-setuptools come from Debian too: inside the chroot
# pip cannot verify the registry's certificate, so as little as possible is
# left for pip (see wheels in tools/stack-setup).
PKGS=python3-petsc4py,python3-mpi4py,python3-numpy,openmpi-bin,python3-venv,python3-dev
PKGS=$PKGS,python3-pytest,python3-setuptools,python3-wheel,gcc,make,git,procps
# mpicc and mpi.h: the C extension's sync-point steady state is built with
# them (the leg requires it, tools/stack-run). Installed with apt-get once the
# chroot is there: debootstrap's resolver does not follow virtual packages
# (libltdl-dev, which libopenmpi-dev pulls in, needs automake-1.17, which
# automake provides); and so a chroot bootstrapped before gets it too.
APT_PKGS="libopenmpi-dev $*"

if [ ! -e "$DIR/.bootstrapped" ]; then
    rm -rf "$DIR.partial"
    mkdir -p "$(dirname "$DIR")"
    echo "collective_gc: debootstrap of Debian 13 into $DIR (about 5 minutes)"
    debootstrap --variant=minbase --include="$PKGS" trixie "$DIR.partial" >"$DIR.log" 2>&1 \
        || { tail -20 "$DIR.log" >&2; exit 1; }
    rm -rf "$DIR"
    mv "$DIR.partial" "$DIR"
    touch "$DIR/.bootstrapped"
fi

missing=""
for p in $APT_PKGS; do
    chroot "$DIR" dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
        || missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "collective_gc: apt-get install in $DIR:$missing"
    chroot "$DIR" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
        sh -c "apt-get update -qq && apt-get install -y -qq --no-install-recommends$missing" \
        >>"$DIR.log" 2>&1 || { tail -20 "$DIR.log" >&2; exit 1; }
fi
