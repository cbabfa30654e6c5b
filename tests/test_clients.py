"""What real libraries make: their own communicators and PETSc's inner
duplicates (issue 22; ``keep``, for collective resources that are not PETSc
objects, is tested in test_keep.py).

DOLFINx (tests/clients/, ``make test-clients``) duplicates the communicator of
each mesh and of each IndexMap, and PETSc keeps every object on its own inner
duplicate of those. These tests make the same shapes with mpi4py and petsc4py
alone, so that ``make test`` checks them without DOLFINx.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mpi4py import MPI

from conftest import import_petsc, mpiexec_cmd, mpiexec_env

PETSc = import_petsc()

import collective_gc as cgc  # noqa: E402
from collective_gc import petsc as cp  # noqa: E402
from collective_gc._comms import derived  # noqa: E402

JOBS = Path(__file__).parent / "jobs"


class Step:
    """One step's wrapper, in a reference cycle as real codes leave them."""

    def __init__(self, lib: MPI.Intracomm) -> None:
        self.me = self
        self.A = PETSc.Mat().createAIJ([8, 8], nnz=1, comm=lib)
        self.A.setUp()
        self.A.assemble()
        self.x = self.A.createVecRight()
        # A second Python reference to the same PETSc Vec, left unmanaged (as
        # DOLFINx's Function.vector is): when it dies, petsc4py hands the Vec
        # to PETSc's garbage of the library's communicator.
        self.alias = PETSc.Vec().createMPI(4, comm=lib)


@pytest.mark.mpi(min_size=2)
def test_manage_takes_objects_on_a_library_duplicate(comm: MPI.Intracomm) -> None:
    """Issue 22: ``cp.manage(step, ..., comm=COMM_WORLD)`` with objects on
    DOLFINx's duplicate of it raised RegistrationError ("not the
    communicator"). Now they are destroyed at the scope's sync point, and the
    garbage their other references leave on the library's communicator is
    cleaned there too (nothing else cleans it: garbage_cleanup(WORLD) never
    reaches it)."""
    with cgc.collective_scope(comm, timeout=60) as scope:
        lib = comm.Dup()  # the library's own duplicate (a mesh's)
        step = Step(lib)
        cp.manage(step, step.A, step.x, comm=comm)
        alias_comm = step.alias.getComm().tompi4py()
        assert MPI.Comm.Compare(alias_comm, comm) == MPI.CONGRUENT
        del step
        gc.collect()  # the cycle dies; the alias goes to PETSc's garbage
        scope.sync()
        assert cp.garbage(lib) == []
        assert cgc.manager(comm).registered == 0
        lib.Free()  # as DOLFINx does when the mesh dies
        scope.sync()
        assert derived(comm) == []  # the adopted manager was let go of


@pytest.mark.mpi(min_size=2)
def test_two_library_communicators_per_step_do_not_accumulate(comm: MPI.Intracomm) -> None:
    """Issue 22: one manager per library communicator, that the scope never
    synced: 401 managers after 200 steps, nothing destroyed until exit. Now
    each step's are reached by the scope's sync point and let go of there."""
    base = len(cgc.managers())
    with cgc.collective_scope(comm, timeout=60) as scope:
        for _ in range(30):
            mesh_comm, map_comm = comm.Dup(), comm.Dup()
            step = Step(mesh_comm)
            step.b = PETSc.Vec().createMPI(4, comm=map_comm)
            cp.manage(step, step.A, step.x, step.b, comm=comm)
            del step
            gc.collect()
            scope.sync()
            mesh_comm.Free()
            map_comm.Free()
            assert len(derived(comm)) <= 4
            # (Beside PETSc's inner communicators of the last steps, which the
            # sync points hold for two more: see cp.held.)
            assert len(cgc.managers()) <= base + 5 + cp.held(comm)
        scope.sync()
        assert derived(comm) == []
    assert cgc.manager(comm).registered == 0


@pytest.mark.mpi(min_size=2)
def test_a_registration_on_a_library_communicator_is_reached(comm: MPI.Intracomm) -> None:
    """A library's communicator registered on directly (``comm=mesh.comm``)
    used to wait for exit, silently; the parent scope's sync point now
    destroys it, in the agreed order."""
    ran: list[int] = []
    with cgc.collective_scope(comm, timeout=60) as scope:
        lib = comm.Split(0)  # congruent, made by "the library"

        class Owner:
            pass

        owners = [Owner() for _ in range(3)]
        for i, o in enumerate(owners):
            cgc.register(o, ran.append, i, comm=lib)
        del o
        owners.clear()
        scope.sync()
        assert ran == [2, 1, 0]
        lib.Free()
        scope.sync()
    assert derived(comm) == []


@pytest.mark.mpi(min_size=4)
def test_a_subset_library_communicator_is_reached(comm: MPI.Intracomm) -> None:
    """A library's ``Split`` of the scope's communicator: each half's
    registrations are destroyed at the parent's sync point; ranks of the
    parent outside a half skip it."""
    ran: list[str] = []
    rank = comm.Get_rank()
    with cgc.collective_scope(comm, timeout=60) as scope:
        half = comm.Split(rank % 2)

        class Owner:
            pass

        o: Any = Owner()
        o.me = o
        cgc.register(o, ran.append, f"half{rank % 2}", comm=half)
        del o
        gc.collect()
        scope.sync()
        assert ran == [f"half{rank % 2}"]
        half.Free()
        scope.sync()
    assert derived(comm) == []


@pytest.mark.launcher
def test_a_manager_no_sync_point_reaches_is_named_then_reached() -> None:
    """Issue 22: one manage per library communicator left managers nothing
    synced, silently, until exit. A manager made before anything containing
    it was in use is now named by view and a warning on every rank, and the
    next sync point of a communicator containing it reaches it."""
    proc = subprocess.run(
        [*mpiexec_cmd(2, 90), sys.executable, "-m", "mpi4py", str(JOBS / "unreached.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=mpiexec_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == 2, proc.stdout + proc.stderr
