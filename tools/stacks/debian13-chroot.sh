#!/usr/bin/env bash
# Build the Debian 13 (trixie) chroot of the `debian13` leg of `make test-stacks`
# in DIR: Debian's own Python 3.13, mpi4py 4.0, petsc4py 3.22 and Open MPI 5.
# Needs root, debootstrap and rsync (installed here with apt-get when missing).
# Idempotent: a finished chroot is marked with DIR/.bootstrapped.
set -euo pipefail
DIR=${1:?usage: debian13-chroot.sh DIR}

# The host's tools for this leg, checked even when the chroot exists: a chroot
# made on another machine (or kept in .stacks/) does not bring them. debootstrap
# builds the chroot; tools/stack-run copies the tree in with rsync.
bash "$(dirname "$0")/../install-system-deps.sh" debootstrap rsync
[ -e "$DIR/.bootstrapped" ] && exit 0

# python3-pytest and python3-setuptools come from Debian too: inside the chroot
# pip cannot verify the registry's certificate, so as little as possible is
# left for pip (see wheels in tools/stack-setup).
PKGS=python3-petsc4py,python3-mpi4py,python3-numpy,openmpi-bin,python3-venv,python3-dev
PKGS=$PKGS,python3-pytest,python3-setuptools,python3-wheel,gcc,make,git,procps

rm -rf "$DIR.partial"
mkdir -p "$(dirname "$DIR")"
echo "collective_gc: debootstrap of Debian 13 into $DIR (about 5 minutes)"
debootstrap --variant=minbase --include="$PKGS" trixie "$DIR.partial" >"$DIR.log" 2>&1 \
    || { tail -20 "$DIR.log" >&2; exit 1; }
rm -rf "$DIR"
mv "$DIR.partial" "$DIR"
touch "$DIR/.bootstrapped"
