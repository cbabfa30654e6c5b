"""Print the real clients one `make test-clients` leg runs, in one line:

    DOLFINx 0.9.0, slepc4py 3.22.2, h5py 3.13.0 (Debian 13; PETSc 3.22.5, HDF5 1.14.5, mpio)

Run with the leg's Python (the host's venv, or the chroot's through
tools/stack-run). Exits 1, naming what is wrong, if a client is missing or
h5py is not its MPI build: every client of the leg is required (the
CGC_REQUIRE_* variables say the same to the tests), so a leg that could not
import one must not print a line that reads as if it ran it.
"""

from __future__ import annotations

import os
import sys


def debian() -> str:
    try:
        with open("/etc/debian_version") as f:
            release = f.read().strip()
    except OSError:
        return "not Debian"
    # "12.12" on a release; "trixie/sid" before one.
    return f"Debian {release.split('.')[0]}"


def main() -> None:
    # Debian's h5py loads its MPI build only in a job of several ranks (it
    # reads OMPI_COMM_WORLD_SIZE or MPI_LOCALNRANKS) or with this variable:
    # the build the legs' 4-rank runs get, asked for without mpiexec.
    os.environ.setdefault("H5PY_ALWAYS_USE_MPI", "1")
    try:
        import dolfinx
        import h5py
        import slepc4py
        from petsc4py import PETSc
    except ImportError as e:
        sys.exit(f"client_versions: {e}: this leg requires DOLFINx, slepc4py and h5py")
    if not h5py.get_config().mpi:
        sys.exit(f"client_versions: h5py {h5py.__version__} is not built with MPI (mpio)")
    petsc = ".".join(str(v) for v in PETSc.Sys.getVersion())
    print(
        f"DOLFINx {dolfinx.__version__}, slepc4py {slepc4py.__version__}, h5py {h5py.__version__}"
        f" ({debian()}; PETSc {petsc}, HDF5 {h5py.version.hdf5_version}, mpio)",
        flush=True,
    )


if __name__ == "__main__":
    main()
