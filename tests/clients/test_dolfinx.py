"""DOLFINx as a real client (issues 22, 41): run by ``make test-clients`` on 4
ranks, with Debian 12's python3-dolfinx (0.5.2) and Debian 13's
python3-dolfinx-real (0.9.0), installed by the Makefile's test-clients-LEG."""

from __future__ import annotations

import gc
import os
import sys
import tempfile

import pytest
from mpi4py import MPI

from conftest import import_client

# make test-clients sets CGC_REQUIRE_DOLFINX=1: there a missing DOLFINx fails the
# run instead of skipping it.
dolfinx = import_client("dolfinx", "CGC_REQUIRE_DOLFINX")
from petsc4py import PETSc  # noqa: E402

import collective_gc as cgc  # noqa: E402
from collective_gc import petsc as cp  # noqa: E402
from collective_gc._comms import derived  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from dolfinx_loop import Step, manage_step, petsc_log_alive  # noqa: E402

WORLD = MPI.COMM_WORLD


@pytest.mark.mpi(min_size=2)
def test_meshes_are_partitioned_without_hanging() -> None:
    """100 meshes in a row on every rank, as the example makes them (issue 22:
    a fresh-clone CI run hung in ``create_unit_square``, every rank inside
    PT-Scotch's ``SCOTCH_dgraphPart`` but in different collectives; 4 ranks on
    2 cores hung in 6 of 14 such runs without the example's
    ``SCOTCH_PTHREAD_NUMBER=1``). A hang here is ended by the job's timeout."""
    assert os.environ.get("SCOTCH_PTHREAD_NUMBER") == "1"
    for _ in range(100):
        mesh = dolfinx.mesh.create_unit_square(WORLD, 8, 8)
        assert mesh.topology.index_map(2).size_global == 128
        del mesh


@pytest.mark.mpi(min_size=2)
def test_each_steps_objects_are_gone_at_the_next_sync_point() -> None:
    """The documented path of docs/guides/fenicsx.rst: after each step's sync
    point nothing of that step is registered or pending on any manager, no
    PETSc garbage is left on COMM_WORLD, and PETSc's own log (creations minus
    destructions of every type, ``-log_view``'s table) shows every PETSc
    object the step created destroyed, on every rank (the XDMF file open: no
    hang). Issue 22, item 4."""
    out_dir = WORLD.bcast(tempfile.mkdtemp(prefix="cgc-dolfinx-") if WORLD.rank == 0 else "")
    gc.collect()
    PETSc.garbage_cleanup()
    PETSc.Log.begin()
    before = petsc_log_alive()
    with cgc.collective_scope(WORLD, timeout=120) as scope:
        base = cgc.manager(WORLD).registered
        base_derived = len(derived(WORLD))
        for i in range(8):
            step = Step(8, out_dir, i, xdmf=True)
            manage_step(step)
            step.solve()
            del step
            gc.collect(0)
            scope.sync()
            left = cgc.manager(WORLD).registered - base
            assert left == 0, f"step {i}: {left} still registered after its sync point"
            # The step's communicators (PETSc's inner duplicates of the mesh's
            # and the IndexMap's) go at the next sync point, once PETSc freed them.
            assert len(derived(WORLD)) <= base_derived + 2, derived(WORLD)
            assert cp.garbage(WORLD) == []
            alive = petsc_log_alive()
            assert alive == before, f"rank {WORLD.rank}, step {i}: PETSc's log: {alive}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["auto", "managed"])
def test_the_problems_destroys_wait_for_the_sync_point(mode: str) -> None:
    """DOLFINx 0.9's ``LinearProblem.__del__`` destroys its KSP, Mat and Vecs
    (0.5.2 has none; issue 41): in a step that dies in the cyclic collector
    that would be wherever each rank's collector fires. With the documented
    registrations (``manage_step``: the problem is kept by the step), the
    collection that finds the step dead destroys nothing of it, on any rank,
    under gc="auto" with the collector fired on the even ranks only (as
    each rank's own collector would, at different moments) and under
    gc="managed" with the young collection of the guide; the next sync point
    destroys them on every rank, and PETSc's log shows none left."""
    out_dir = WORLD.bcast(tempfile.mkdtemp(prefix="cgc-dolfinx-") if WORLD.rank == 0 else "")
    gc.collect()
    PETSc.garbage_cleanup()
    PETSc.Log.begin()
    before = petsc_log_alive()
    with cgc.collective_scope(WORLD, gc=mode, timeout=120) as scope:  # type: ignore[arg-type]
        for i in range(4):
            step = Step(8, out_dir, i, xdmf=True)
            manage_step(step)
            step.solve()
            p = step.problem
            # The test's own references: they keep the Python objects, not
            # PETSc's (destroy() empties the handle whoever holds it).
            petsc = {"KSP": p.solver, "Mat": p.A, "b": p.b, "x": p._x}
            del step, p
            if mode == "managed":
                gc.collect(0)
            elif WORLD.rank % 2 == 0:
                gc.collect()
            early = [k for k, o in petsc.items() if not o.handle]
            assert early == [], f"rank {WORLD.rank}, step {i}: destroyed in the collection: {early}"
            if mode == "auto" and WORLD.rank % 2 == 1:
                gc.collect()  # this rank's collector fires later
            scope.sync()
            left = [k for k, o in petsc.items() if o.handle]
            assert left == [], f"rank {WORLD.rank}, step {i}: left at the sync point: {left}"
    gc.collect()
    assert petsc_log_alive() == before, f"rank {WORLD.rank}: PETSc's log: {petsc_log_alive()}"
