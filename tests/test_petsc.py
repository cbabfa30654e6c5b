"""collective_gc.petsc with real petsc4py objects, serially and on 4 ranks.

"Destroyed exactly once" is checked with PETSc's own state, not our counters:
a serial tracker Vec is composed onto every object under test, so PETSc's
reference count of the tracker falls by one each time PETSc really destroys
one of them; Mats of Python type record the moment PETSc calls their
destroy; petsc4py nulls a handle when it destroys it; and PETSc's garbage maps
are read directly.

Where petsc4py is missing the module is skipped, with the reason, unless the
stack declares PETSc required (CGC_REQUIRE_PETSC=1: then it fails).

What PETSc does differs between releases, and the tests assert what each one
really does: PETSc < 3.20 hands serial objects (size-1 communicators) that
Python drops to COMM_SELF's garbage; 3.20 and later destroy them at once.
"""

from __future__ import annotations

import gc
import os
import random
import re
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mpi4py import MPI

from conftest import import_petsc

PETSc = import_petsc()

import collective_gc as cgc  # noqa: E402
from collective_gc import petsc as cp  # noqa: E402
from collective_gc._destroy import set_batch  # noqa: E402
from collective_gc.petsc import _destroyers, _internals  # noqa: E402

from _util import GcDisabled, attempt, same_on_all  # noqa: E402

PETSC_RELEASE = tuple(PETSc.Sys.getVersion()[:2])
#: Whether a serial object Python drops waits in COMM_SELF's garbage.
SERIAL_DELAYED = PETSC_RELEASE < (3, 20)


class Tracker:
    """A serial Vec composed onto each watched object (PETSc refcounts it)."""

    def __init__(self) -> None:
        self.vec = PETSc.Vec().createSeq(1, comm=PETSc.COMM_SELF)

    def watch(self, *objs: Any) -> None:
        for obj in objs:
            obj.compose("cgc-test-tracker", self.vec)

    def alive(self) -> int:
        """How many watched objects PETSc has not destroyed yet."""
        return int(self.vec.getRefCount()) - 1

    def close(self) -> None:
        self.vec.destroy()


class Probe:
    """Context of a Python-type Mat: PETSc calls destroy() when it destroys the Mat."""

    def __init__(self, tag: Any, log: list[Any], fail: bool | type = False) -> None:
        self.tag, self.log, self.fail = tag, log, fail

    def destroy(self, mat: PETSc.Mat) -> None:
        self.log.append(self.tag)
        if self.fail:
            cls = self.fail if isinstance(self.fail, type) else RuntimeError
            raise cls(f"probe {self.tag} refuses to be destroyed")

    def mult(self, mat: PETSc.Mat, x: PETSc.Vec, y: PETSc.Vec) -> None:
        x.copy(y)


def probe_mat(comm: MPI.Comm, tag: Any, log: list[Any], fail: bool | type = False) -> PETSc.Mat:
    n = 2 * comm.Get_size()
    mat = PETSc.Mat().createPython([n, n], Probe(tag, log, fail), comm=comm)
    mat.setUp()
    return mat


def laplacian(comm: MPI.Comm, n: int) -> PETSc.Mat:
    A = PETSc.Mat().createAIJ([n, n], nnz=(3, 2), comm=comm)
    lo, hi = A.getOwnershipRange()
    for i in range(lo, hi):
        A.setValue(i, i, 2.0)
        if i > 0:
            A.setValue(i, i - 1, -1.0)
        if i < n - 1:
            A.setValue(i, i + 1, -1.0)
    A.assemble()
    return A


class Solver:
    """A wrapper as a finite-element library writes one: a KSP, its operator
    and work vectors, optionally in a reference cycle with itself."""

    def __init__(self, comm: MPI.Comm, tracker: Tracker, tag: Any, cycle: bool = True) -> None:
        self.A = laplacian(comm, 4 * comm.Get_size())
        self.ksp = PETSc.KSP().create(comm)
        self.ksp.setOperators(self.A)
        self.ksp.setType("cg")
        self.ksp.getPC().setType("jacobi")
        self.x, self.b = self.A.createVecs()
        self.b.set(1.0)
        tracker.watch(self.A, self.ksp, self.x, self.b)
        if cycle:
            self.me = self
        self.reg = cp.manage(self, self.A, self.ksp, self.x, self.b, comm=comm, name=f"solver{tag}")

    def handles(self) -> list[int]:
        return [o.handle for o in (self.A, self.ksp, self.x, self.b)]

    @cgc.sync_point
    def solve(self) -> int:
        self.ksp.solve(self.b, self.x)
        return int(self.ksp.getIterationNumber())


class Holder:
    """A plain wrapper object."""

    mat: Any
    vec: Any
    peer: Any


def no_garbage(comm: MPI.Comm) -> bool:
    return cp.garbage(comm) == [] and cp.garbage(MPI.COMM_SELF) == []


def parse_garbage_view(text: str) -> list[list[tuple[int, str]]]:
    """Each rank's (key, type) rows, from the text PETSc.garbage_view prints."""
    ranks: list[list[tuple[int, str]]] = []
    for line in text.splitlines():
        if re.match(r"Rank \d+:: Total entries", line):
            ranks.append([])
        row = re.match(r"\|\s*(\d+)\s*\|\s*(\S+)\s*\|", line)
        if row:
            ranks[-1].append((int(row.group(1)), row.group(2)))
    return [sorted(rows) for rows in ranks]


class SelfKept:
    """An owner that one of its own managed objects refers back to."""

    def __init__(self, comm: MPI.Comm, how: str) -> None:
        self.how = how
        if how == "appctx":
            self.obj = PETSc.KSP().create(comm)
        elif how == "function":
            self.obj = PETSc.SNES().create(comm)
        else:
            self.obj = PETSc.Vec().createMPI(2, comm=comm)
        # Managed first: manage() refuses an object that already refers back.
        self.reg = cp.manage(self, self.obj, comm=comm, name=how)
        if how == "appctx":
            self.obj.setAppCtx(self)
        elif how == "function":
            self.obj.setFunction(self.F, None)
        else:
            self.obj.setAttr("o", self)

    def F(self, snes: Any, x: Any, f: Any) -> None:
        x.copy(f)

    def release(self) -> None:
        if self.how == "appctx":
            self.obj.setAppCtx(None)
        elif self.how == "function":
            self.obj.setAttr("__function__", None)  # where petsc4py keeps it
        else:
            self.obj.setAttr("o", None)


class PetscTests:
    COMM: MPI.Intracomm

    def test_destroyed_at_sync_exactly_once(self, comm: MPI.Intracomm) -> None:
        tracker = Tracker()
        with GcDisabled():
            solvers = [Solver(comm, tracker, i) for i in range(5)]
            objs = [(s.A, s.ksp, s.x, s.b) for s in solvers]  # petsc4py objects, to inspect
            del solvers
            assert tracker.alive() == 20  # dropped, in cycles, not collected yet
            gc.collect()  # the cyclic collector only queues
            assert tracker.alive() == 20
            assert all(o.handle for group in objs for o in group)
            stats = cgc.collect(comm)
        assert stats.destroyed == 5 and stats.cyclic == 5
        assert tracker.alive() == 0  # PETSc destroyed each one, once
        assert all(o.handle == 0 for group in objs for o in group)
        # A later sync point destroys nothing more (petsc4py would crash on a
        # second destroy of the same handle).
        assert cgc.collect(comm).destroyed == 0
        assert no_garbage(comm)
        tracker.close()

    def test_explicit_destroy_first_is_not_repeated(self, comm: MPI.Intracomm) -> None:
        tracker = Tracker()
        s = Solver(comm, tracker, 0, cycle=False)
        ksp = s.ksp
        ksp.destroy()  # the user destroys one object early, on every rank
        assert tracker.alive() == 3
        s.reg.destroy()  # and then the whole registration, collectively
        assert tracker.alive() == 0
        del s
        assert cgc.collect(comm).destroyed == 0 and tracker.alive() == 0
        tracker.close()

    def test_dropped_raw_objects_are_cleaned_at_sync(self, comm: MPI.Intracomm) -> None:
        # Objects Python drops without a wrapper go to PETSc's own garbage
        # (delayed destroy); a sync point on comm cleans it, and COMM_SELF's too.
        tracker = Tracker()
        cp.install(comm)
        raw = [PETSc.Vec().createMPI(3, comm=comm) for _ in range(4)]
        serial = PETSc.Vec().createSeq(2, comm=PETSc.COMM_SELF)
        tracker.watch(*raw, serial)
        del raw, serial
        delayed = SERIAL_DELAYED or comm.Get_size() > 1
        assert [cls for _, cls in cp.garbage(comm)] == ["Vec"] * 4 * delayed
        assert ("Vec" in [cls for _, cls in cp.garbage(MPI.COMM_SELF)]) == SERIAL_DELAYED
        # Delayed: PETSc has not destroyed them yet.
        assert tracker.alive() == 4 * delayed + SERIAL_DELAYED
        cgc.collect(comm)
        assert no_garbage(comm) and tracker.alive() == 0
        tracker.close()

    def test_serial_objects_on_a_parallel_manager(self, comm: MPI.Intracomm) -> None:
        # Every rank owns a serial Vec of its own, in a wrapper registered on comm.
        tracker = Tracker()
        holders = []
        for i in range(3):
            holder = Holder()
            holder.vec = PETSc.Vec().createSeq(2 + comm.Get_rank(), comm=PETSc.COMM_SELF)
            tracker.watch(holder.vec)
            cp.manage(holder, holder.vec, comm=comm, name=f"local{i}")
            holders.append(holder)
        del holder
        holders.clear()
        assert cgc.collect(comm).destroyed == 3
        assert tracker.alive() == 0 and no_garbage(comm)
        tracker.close()

    def test_scope_leaves_no_garbage(self, comm: MPI.Intracomm) -> None:
        tracker = Tracker()
        iterations = []
        with cgc.collective_scope(comm) as scope:
            cp.install(comm)
            for step in range(15):
                s = Solver(comm, tracker, step)
                iterations.append(s.solve())  # a sync point after each solve
                tmp = s.x.duplicate()  # a raw temporary, dropped: PETSc garbage
                tmp.axpy(1.0, s.x)
                pc = s.ksp.getPC()  # a second Python handle on the PC
                del s, tmp, pc
        assert scope.syncs == 16
        assert cgc.pending(comm) == [] and cgc.manager(comm).alive() == []
        assert tracker.alive() == 0
        assert no_garbage(comm)
        assert same_on_all(comm, iterations)
        tracker.close()

    def test_solve_is_a_sync_point(self, comm: MPI.Intracomm) -> None:
        # One tracker per solver: PETSc copies composed objects onto the work
        # vectors a solve duplicates, so counts are per solver.
        t_old, t_new, t_old2 = Tracker(), Tracker(), Tracker()
        with cgc.collective_scope(comm):
            old = Solver(comm, t_old, "old", cycle=False)
            del old  # queued, not destroyed
            assert t_old.alive() == 4
            s = Solver(comm, t_new, "new", cycle=False)
            its = cp.solve(s.ksp, s.b, s.x)  # the function form
            assert its is None and t_old.alive() == 0 and t_new.alive() > 0
            old = Solver(comm, t_old2, "old2", cycle=False)
            del old
            assert s.solve() > 0  # the decorated method
            assert t_old2.alive() == 0 and t_new.alive() > 0
            del s
        assert t_new.alive() == 0
        # Without a scope, comm= says where the sync point is.
        s = Solver(comm, t_old, "noscope", cycle=False)
        ksp, b, x = s.ksp, s.b, s.x
        del s
        cp.solve(ksp, b, x, comm=comm)
        assert t_old.alive() == 0 and ksp.handle == 0
        for t in (t_old, t_new, t_old2):
            t.close()

    def test_view_lists_petsc_garbage(self, comm: MPI.Intracomm) -> None:
        cp.install(comm)
        v = PETSc.Vec().createMPI(2, comm=comm)
        w = PETSc.Vec().createSeq(2, comm=PETSc.COMM_SELF)
        del v, w
        text = cgc.view(comm, file=None)
        delayed = SERIAL_DELAYED or comm.Get_size() > 1
        assert ("PETSc garbage #" in text and "Vec" in text) == delayed
        assert ("(COMM_SELF)" in text) == SERIAL_DELAYED
        cgc.collect(comm)
        assert "PETSc garbage" not in cgc.view(comm, file=None)

    def test_garbage_read_matches_garbage_view(
        self, comm: MPI.Intracomm, capfd: pytest.CaptureFixture[str]
    ) -> None:
        # What cp.garbage reads from PETSc's map through ctypes is what PETSc's
        # own garbage_view prints (rank 0 prints every rank's table).
        cp.install(comm)
        dropped = [PETSc.Vec().createMPI(3, comm=comm) for _ in range(3)]
        dropped.append(PETSc.IS().createStride(4, comm=comm))
        dropped.append(PETSc.KSP().create(comm))
        del dropped
        everyone = comm.allgather(cp.garbage(comm))
        if SERIAL_DELAYED or comm.Get_size() > 1:
            assert everyone == [everyone[0]] * comm.Get_size()
            assert sorted(cls for _, cls in everyone[0]) == ["IS", "KSP", "Vec", "Vec", "Vec"]
        else:
            assert everyone == [[]] * comm.Get_size()  # destroyed at once
        capfd.readouterr()
        PETSc.garbage_view(comm)
        out = capfd.readouterr().out
        if comm.Get_rank() == 0:
            assert parse_garbage_view(out) == everyone, out
        cgc.collect(comm)
        assert cp.garbage(comm) == []

    def test_the_votes_read_of_petsc_garbage_is_what_the_map_holds(
        self, comm: MPI.Intracomm
    ) -> None:
        """The read every sync point's PETSc vote makes (``_destroyers.garbage``:
        the C one where the extension is in use, else the Python reader's)
        gives the number of entries the Python reader lists, -1 where PETSc
        has no inner communicator, and the same for the inner communicator
        itself."""
        from collective_gc import _registration

        reader = _internals.READER
        assert reader is not None
        read = _destroyers.garbage
        assert read is not None
        if _registration.SPEEDUPS is not None:
            assert type(read.__self__) is _registration.SPEEDUPS.Petsc  # type: ignore[attr-defined]
        handle = MPI._handleof(comm)

        def both(h: int) -> int:
            fast, slow = read(h), reader.garbage(h)
            assert fast == slow
            return fast

        assert reader.inner(comm) is None and both(handle) == -1
        held = PETSc.Vec().createMPI(2, comm=comm)
        inner = reader.inner(comm)
        assert inner is not None
        assert both(handle) == both(inner) == len(reader.entries(inner)) == 0
        dropped = [PETSc.Vec().createMPI(2, comm=comm) for _ in range(3)]
        del dropped
        delayed = SERIAL_DELAYED or comm.Get_size() > 1
        assert both(handle) == both(inner) == len(reader.entries(inner)) == (3 if delayed else 0)
        self_handle = MPI._handleof(MPI.COMM_SELF)
        self_inner = reader.inner(MPI.COMM_SELF)
        expected = -1 if self_inner is None else len(reader.entries(self_inner))
        assert both(self_handle) == expected
        held.destroy()
        PETSc.garbage_cleanup(comm)
        assert both(handle) in (-1, 0)

    def test_unknown_release_is_never_read(
        self, comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # A PETSc or petsc4py outside the releases whose layouts were read:
        # no ctypes reading, no C destroys; the view has no PETSc rows and
        # sync points clean PETSc's garbage unconditionally.
        real = _internals.READER
        assert real is not None
        monkeypatch.setattr(_internals, "PETSC_RELEASE", (3, 99))
        monkeypatch.setattr(_internals, "PETSC4PY_RELEASE", (3, 99))
        assert _internals.load() is None
        assert _destroyers.fast_types() == ()
        monkeypatch.setattr(_internals, "READER", None)
        cp.install(comm)
        v = PETSc.Vec().createMPI(2, comm=comm)
        w = PETSc.Vec().createSeq(2, comm=PETSc.COMM_SELF)
        del v, w
        assert "PETSc garbage" not in cgc.view(comm, file=None)
        with pytest.raises(RuntimeError, match="cannot read PETSc's garbage maps"):
            cp.garbage(comm)
        cgc.collect(comm)
        for c in (comm, MPI.COMM_SELF):
            inner = real.inner(c)
            assert inner is None or real.entries(inner) == []

    def test_owner_kept_alive_by_its_own_objects_is_reported(self, comm: MPI.Intracomm) -> None:
        # Issue 11, defect 16: the registration holds the objects, and each of
        # these objects holds its owner, so the owner never dies. Say so, with
        # the path, locally (cp.immortal) and in the view.
        owners = [SelfKept(comm, how) for how in ("appctx", "function", "attr")]
        refs = [weakref.ref(o) for o in owners]
        regs = [o.reg for o in owners]
        del owners
        gc.collect()
        assert cgc.collect(comm).destroyed == 0
        assert all(r() is not None for r in refs)  # what the issue saw: immortal
        lines = cp.immortal(comm)
        assert lines == [
            f"SelfKept {n!r} (key {r.key}) is kept alive by its own destroy call, so it "
            f"never dies and its destroy never runs: {path}"
            for n, r, path in zip(
                ("appctx", "function", "attr"),
                regs,
                (
                    "destroy args[0] -> KSP.<PETSc attributes> -> dict['__appctx__'] -> SelfKept",
                    "destroy args[0] -> SNES.<PETSc attributes> -> dict['__function__'] "
                    "-> tuple[0] -> method.__self__ -> SelfKept",
                    "destroy args[0] -> Vec.<PETSc attributes> -> dict['o'] -> SelfKept",
                ),
            )
        ]
        text = cgc.view(comm, file=None)
        assert all(line in text for line in lines), text
        # What the pytest plugin's leak check adds to its report.
        assert cgc.manager(comm).leak_reasons() == lines
        # Breaking the path lets the owner die and its destroy run.
        for r in refs:
            owner = r()
            assert owner is not None
            owner.release()
        del owner
        assert all(r() is None for r in refs)
        assert cgc.collect(comm).destroyed == 3
        assert cp.immortal(comm) == []

    def test_an_immortal_owner_is_named_among_many_live_derived_communicators(
        self, comm: MPI.Intracomm
    ) -> None:
        """The walk from a destroy call to its owner stops at the library's
        own state. A derived communicator's registration (``cgc.dup``,
        ``cgc.split``) holds its family; walked into, it led to the family's
        registry, every live registration on it and on the communicators
        congruent with it, so with 48 live duplicates and 100 owners on
        each the walks' budget ran out before the last owner was looked at,
        and an immortal owner went unnamed (found by profiling ``make
        demo``, whose reports call ``cp.immortal``: most of its profiled time)."""
        subs = [cgc.dup(comm) for _ in range(48)]
        # Live owners on each derived communicator: a large registry there.
        held = [Holder() for _ in range(100 * len(subs))]
        for i, h in enumerate(held):
            cgc.register(h, _noop_destroy, comm=subs[i % len(subs)])
        owner = SelfKept(comm, "appctx")
        ref, reg = weakref.ref(owner), owner.reg
        del owner
        lines = cp.immortal(comm)
        assert lines == [
            f"SelfKept 'appctx' (key {reg.key}) is kept alive by its own destroy call, so "
            "it never dies and its destroy never runs: "
            "destroy args[0] -> KSP.<PETSc attributes> -> dict['__appctx__'] -> SelfKept"
        ], lines
        kept = ref()
        assert kept is not None
        kept.release()
        del kept, subs, held
        assert ref() is None
        cgc.collect(comm)
        assert cp.immortal(comm) == []

    def test_refusals(self, comm: MPI.Intracomm) -> None:
        owner = Holder()
        with pytest.raises(cgc.RegistrationError, match="at least one"):
            cp.manage(owner, comm=comm)
        with pytest.raises(cgc.RegistrationError, match="petsc4py objects"):
            cp.manage(owner, object(), comm=comm)
        v = PETSc.Vec().createMPI(2, comm=comm)
        v.destroy()
        with pytest.raises(cgc.RegistrationError, match="destroyed"):
            cp.manage(owner, v, comm=comm)
        v = PETSc.Vec().createMPI(2, comm=comm)
        with pytest.raises(cgc.RegistrationError, match="itself"):
            cp.manage(v, v, comm=comm)  # the object cannot own itself
        v.destroy()
        # An object that already refers back to its owner would keep it alive
        # for ever (issue 11, defect 16): refused, with the path.
        ksp = PETSc.KSP().create(comm)
        ksp.setAppCtx(owner)
        with pytest.raises(cgc.RegistrationError) as info:
            cp.manage(owner, ksp, comm=comm)
        assert "(KSP.<PETSc attributes> -> dict['__appctx__'] -> Holder)" in str(info.value)
        ksp.setAppCtx(None)
        ksp.destroy()
        assert cgc.manager(comm).next_key == 0  # refusals consumed no key


class TestPetscSelf(PetscTests):
    COMM = MPI.COMM_SELF


@pytest.mark.mpi(min_size=2)
class TestPetscWorld(PetscTests):
    COMM = MPI.COMM_WORLD


@pytest.mark.mpi(min_size=2)
def test_dropped_in_different_orders_and_cycles(comm: MPI.Intracomm) -> None:
    rank = comm.Get_rank()
    rng = random.Random(rank)
    old = gc.get_threshold()
    gc.set_threshold(30 + 200 * rank, 2 + rank, 4)  # per-rank automatic-GC timing
    log: list[Any] = []
    tracker = Tracker()
    n = 40
    try:
        owners: list[Any] = []
        for i in range(n):
            owner = Holder()
            owner.mat = probe_mat(comm, i, log)
            owner.vec = owner.mat.createVecLeft()
            tracker.watch(owner.mat, owner.vec)
            cp.manage(owner, owner.mat, owner.vec, comm=comm, name=f"cached{i}")
            owners.append(owner)
        # Pairs in reference cycles: every owner dies in the cyclic collector,
        # whenever each rank's own allocation history triggers it.
        for a, b in zip(owners[::2], owners[1::2]):
            a.peer, b.peer = b, a
        order = list(range(n))
        rng.shuffle(order)
        noise: list[object] = []
        for j, i in enumerate(order):
            owners[i] = None
            noise.extend([{}] * rng.randrange(0, 300))
            if len(noise) > 2000:
                noise.clear()
            if j % 10 == 9:
                cgc.collect(comm, generation=None)  # agree only: no forced collection
        del owner, a, b, noise
        stats = cgc.collect(comm)
    finally:
        gc.set_threshold(*old)
    assert stats.pending == 0
    assert sorted(log) == list(range(n))  # PETSc destroyed each Mat once
    assert same_on_all(comm, log)  # in the same order on every rank
    assert tracker.alive() == 0 and no_garbage(comm)
    tracker.close()


@pytest.mark.mpi(min_size=2)
def test_objects_on_a_split_subcommunicator(comm: MPI.Intracomm) -> None:
    rank = comm.Get_rank()
    tracker = Tracker()
    sub = cgc.split(comm, rank % 2)
    cp.install(sub)
    with GcDisabled():
        solvers = [Solver(sub, tracker, i) for i in range(3)]
        raw = PETSc.Vec().createMPI(2, comm=sub)
        tracker.watch(raw)
        del solvers, raw
        assert cp.garbage(sub) != []
        # The parent's sync point visits the sub-communicator's manager.
        cgc.collect(comm)
    assert tracker.alive() == 0
    assert cp.garbage(sub) == [] and no_garbage(comm)
    assert cgc.pending(sub) == []
    del sub
    cgc.collect(comm)  # frees the sub-communicator
    tracker.close()


@pytest.mark.mpi(min_size=2)
def test_failed_petsc_destroy_makes_the_communicator_unusable(comm: MPI.Intracomm) -> None:
    # Issue 11, defect 14 (and issue 12: the error names the exception that
    # made PETSc fail, once, on every PETSc release).
    rank, bad = comm.Get_rank(), comm.Get_size() - 1
    log: list[Any] = []
    tracker = Tracker()
    owner = Holder()
    owner.vec = PETSc.Vec().createMPI(2, comm=comm)
    owner.mat = probe_mat(comm, "m", log, fail=rank == bad)
    objs = (owner.vec, owner.mat)
    tracker.watch(*objs)
    reg = cp.manage(owner, owner.vec, owner.mat, comm=comm, name="faulty")
    del owner
    cgc.collect(comm)  # the destroys run; the next agreement reports the failure
    with pytest.raises(cgc.DestroyError) as info:
        cgc.collect(comm)
    assert info.value.failures == [
        (bad, reg.key, "faulty", "RuntimeError: probe m refuses to be destroyed")
    ]
    if rank == bad:
        assert [type(e) for e in info.value.local] == [RuntimeError]
    text = str(info.value)
    assert f"rank {bad}, key {reg.key} ('faulty')" in text
    # Every rank is told what the failure means for the communicator.
    assert "differ between ranks" in text and "may hang" in text, text
    assert log == ["m"]  # PETSc called the Mat's destroy on every rank
    assert objs[0].handle == 0  # the Vec was still destroyed, after the Mat failed
    assert objs[1].handle == 0  # the failed Mat is forgotten, never destroyed again
    del info, objs
    # The bad rank leaked its half-destroyed Mat (and its tracker reference).
    assert tracker.alive() == (1 if rank == bad else 0)
    # Every later sync point refuses, on every rank, saying why (PETSc's own
    # cleanup, or any collective PETSc call, could now hang).
    for _ in range(2):
        with pytest.raises(cgc.CollectiveGCError, match="differ between ranks"):
            cgc.collect(comm)
    tracker.close()


@pytest.mark.mpi(min_size=2)
def test_split_petsc_state_is_never_cleaned(comm: MPI.Intracomm) -> None:
    # A destroy the user calls (not a managed one) fails on one rank: the
    # wreck keeps PETSc's inner communicator alive there only, and PETSc's
    # own cleanup would now duplicate the communicator on the other ranks
    # only, and hang. Give the bad rank some garbage there (a Random's
    # creation makes no collective call): the hook must see the split state,
    # skip the cleanup and say so on every rank.
    rank, bad = comm.Get_rank(), comm.Get_size() - 1
    log: list[Any] = []
    cp.install(comm)
    mat = probe_mat(comm, "u", log, fail=rank == bad)
    if rank == bad:
        with pytest.raises(RuntimeError, match="probe u refuses"):
            cp.destroy_all(mat)
    else:
        cp.destroy_all(mat)
    assert log == ["u"] and mat.handle == 0
    if rank == bad:
        PETSc.Random().create(comm)
    with pytest.warns(RuntimeWarning, match="differs between ranks"):
        cgc.collect(comm)


@pytest.mark.mpi(min_size=2)
def test_a_user_destroy_failing_on_one_rank_inside_a_sync_point_is_never_cleaned(
    comm: MPI.Intracomm,
) -> None:
    """As above, but the split happens inside the sync point, between its
    vote and PETSc's cleanup: a destroy the user registered (not
    ``cp.manage``, so PETSc's inner communicator is not held for it) fails
    on one rank, which keeps the inner communicator there while the other
    ranks free theirs with their last object. At the vote every rank still
    had it and the bad rank held garbage, so a cleanup decided from the vote
    alone would duplicate the communicator on the other ranks only, and hang.
    The cleanup must look again after the destroys, skip, and say so (the
    word after the destroys, collective_gc/petsc/_cleanup.py's _clean)."""
    rank, bad = comm.Get_rank(), comm.Get_size() - 1
    log: list[Any] = []
    cp.install(comm)
    cgc.collect(comm, timeout=30)
    mat = probe_mat(comm, "r", log, fail=rank == bad)
    owner = Holder()
    reg = cgc.register(owner, cp.destroy_all, mat, comm=comm, name="user-destroy")
    del mat
    if rank == bad:
        PETSc.Random().create(comm)  # garbage on the bad rank only, made with no collective
    assert bool(cp.garbage(comm)) == (rank == bad)
    del owner
    with pytest.warns(RuntimeWarning, match="differs between ranks"):
        assert cgc.collect(comm, timeout=30).destroyed == 1
    assert log == ["r"]
    with pytest.raises(cgc.DestroyError) as info:
        cgc.collect(comm, timeout=30)
    assert [f[:3] for f in info.value.failures] == [(bad, reg.key, "user-destroy")]
    del info


@pytest.mark.mpi(min_size=2)
def test_failed_serial_destroy_on_one_rank_leaves_the_communicator_usable(
    comm: MPI.Intracomm,
) -> None:
    # A serial object's wreck on one rank changes nothing collective: the
    # error is raised on every rank, and later sync points still run.
    rank, bad = comm.Get_rank(), comm.Get_size() - 1
    log: list[Any] = []
    owner = Holder()
    owner.mat = probe_mat(MPI.COMM_SELF, "s", log, fail=rank == bad)
    reg = cp.manage(owner, owner.mat, comm=comm, name="serial-on-parallel")
    del owner
    cgc.collect(comm)
    with pytest.raises(cgc.DestroyError) as info:
        cgc.collect(comm)
    assert info.value.failures == [
        (bad, reg.key, "serial-on-parallel", "RuntimeError: probe s refuses to be destroyed")
    ]
    assert "differ between ranks" not in str(info.value)
    del info
    owner = Holder()
    owner.vec = PETSc.Vec().createMPI(2, comm=comm)
    cp.manage(owner, owner.vec, comm=comm)
    del owner
    assert cgc.collect(comm).destroyed == 1


@pytest.mark.mpi(min_size=2)
def test_self_garbage_on_one_rank_is_cleaned_by_an_agreed_vote(comm: MPI.Intracomm) -> None:
    # A sync point cleans COMM_SELF's garbage only when the agreed vote says
    # some rank holds some, so that every rank knows a cleanup (whose
    # destroys may raise on that rank alone) ran and checks it afterwards.
    # Here one rank alone holds such garbage: it must still be cleaned.
    rank, holder = comm.Get_rank(), comm.Get_size() - 1
    cp.install(comm)
    cgc.collect(comm, timeout=30)
    assert cp.garbage(MPI.COMM_SELF) == []
    log: list[Any] = []
    if rank == holder:
        mat = PETSc.Mat().createPython([2, 2], Probe("raw", log), comm=MPI.COMM_SELF)
        mat.setUp()
        del mat  # a raw object: before 3.20, parked in COMM_SELF's garbage
    parked = [c for _, c in cp.garbage(MPI.COMM_SELF)]
    expected = ["Mat"] if rank == holder and SERIAL_DELAYED else []
    assert parked == expected, parked
    assert cgc.collect(comm, timeout=30).destroyed == 0
    assert log == (["raw"] if rank == holder else [])
    assert cp.garbage(MPI.COMM_SELF) == []
    assert cgc.manager(comm).broken is None


def test_failed_serial_destroy_is_never_repeated() -> None:
    # A serial wreck must never be destroyed again (that segfaulted, on
    # PETSc 3.18, when the wreck had landed in COMM_SELF's garbage and was
    # cleaned, before the wreck was forgotten). It leaves nothing that
    # differs between ranks, so later sync points run.
    log: list[Any] = []
    comm = MPI.COMM_SELF
    owner = Holder()
    owner.mat = probe_mat(comm, "s", log, fail=True)
    mat = owner.mat
    reg = cp.manage(owner, owner.mat, comm=comm, name="serial-faulty")
    del owner
    cgc.collect(comm)  # the destroy fails: the next agreement reports it
    with pytest.raises(cgc.DestroyError, match="serial-faulty") as info:
        cgc.collect(comm)
    assert info.value.failures == [
        (0, reg.key, "serial-faulty", "RuntimeError: probe s refuses to be destroyed")
    ]
    assert [type(e) for e in info.value.local] == [RuntimeError]
    assert log == ["s"] and mat.handle == 0
    del info
    cgc.collect(comm)  # cleans COMM_SELF's garbage: the wreck is only dropped
    assert log == ["s"]
    assert cp.garbage(comm) == []


def test_interrupt_in_a_wrapper_destroy_still_destroys_the_rest() -> None:
    # A KeyboardInterrupt raised inside one object's destroy (PETSc calling a
    # Python context) does not skip the wrapper's other objects; it is what
    # the sync point raises, after them, and the interrupted object is
    # forgotten, never destroyed again.
    log: list[Any] = []
    tracker = Tracker()
    comm = MPI.COMM_SELF
    owner = Holder()
    owner.vec = PETSc.Vec().createSeq(2, comm=comm)
    owner.mat = probe_mat(comm, "k", log, fail=KeyboardInterrupt)
    objs = (owner.vec, owner.mat)
    tracker.watch(*objs)
    cp.manage(owner, owner.vec, owner.mat, comm=comm, name="interrupted")
    del owner
    with pytest.raises(KeyboardInterrupt, match="probe k refuses"):
        cgc.collect(comm)
    assert log == ["k"] and objs[0].handle == 0 and objs[1].handle == 0
    assert tracker.alive() == 1  # the interrupted Mat is leaked, on purpose
    del objs
    with pytest.raises(cgc.DestroyError, match="probe k refuses"):
        cgc.collect(comm)  # the next agreement reports it, as any failed destroy
    assert cgc.collect(comm).destroyed == 0 and log == ["k"]
    tracker.close()


@pytest.mark.mpi(min_size=2)
def test_install_on_a_split_without_registrations(comm: MPI.Intracomm) -> None:
    # Issue 11, defect 15: cp.install(sub) alone makes the parent's sync
    # points clean PETSc's garbage on sub (nothing registered on sub).
    tracker = Tracker()
    sub = cgc.split(comm, comm.Get_rank() % 2)
    cp.install(sub)
    raw = [PETSc.Vec().createMPI(2, comm=sub) for _ in range(3)]
    tracker.watch(*raw)
    del raw
    assert [cls for _, cls in cp.garbage(sub)] == ["Vec"] * 3
    cgc.collect(comm)
    assert cp.garbage(sub) == [] and tracker.alive() == 0
    del sub
    cgc.collect(comm)  # frees the sub-communicator
    tracker.close()


SELF_KEPT_SCRIPT = """
import gc
from mpi4py import MPI
from petsc4py import PETSc
from collective_gc import petsc as cp

class Owner:
    pass

owner = Owner()
owner.ksp = PETSc.KSP().create(MPI.COMM_WORLD)
cp.manage(owner, owner.ksp, comm=MPI.COMM_WORLD, name="stuck")
owner.ksp.setAppCtx(owner)
del owner
gc.collect()
"""


@pytest.mark.launcher
def test_owner_kept_alive_is_reported_at_exit() -> None:
    # Issue 11, defect 16, at exit: a warning names the owner and the path.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PMI_"))}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
    proc = subprocess.run(
        [sys.executable, "-c", SELF_KEPT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ExitLeakWarning" in proc.stderr, proc.stderr
    assert (
        "Owner 'stuck' (key 0) is kept alive by its own destroy call, so it never dies and "
        "its destroy never runs: destroy args[0] -> KSP.<PETSc attributes> -> "
        "dict['__appctx__'] -> Owner"
    ) in proc.stderr, proc.stderr


SELF_KEPT_TEST = """
from mpi4py import MPI
from petsc4py import PETSc
from collective_gc import petsc as cp

class Owner:
    pass

def test_self_kept():
    owner = Owner()
    owner.ksp = PETSc.KSP().create(MPI.COMM_WORLD)
    cp.manage(owner, owner.ksp, comm=MPI.COMM_WORLD, name="stuck")
    owner.ksp.setAppCtx(owner)
"""


@pytest.mark.launcher
def test_owner_kept_alive_is_named_by_the_leak_check(tmp_path: Path) -> None:
    # Issue 11, defect 16, in the pytest plugin's leak check: not only "alive",
    # but why, with the path.
    (tmp_path / "test_self_kept.py").write_text(SELF_KEPT_TEST)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PMI_"))}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--cgc-leak-check"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode != 0, proc.stdout
    assert (
        "Owner 'stuck' (key 0) is kept alive by its own destroy call, so it never dies and "
        "its destroy never runs: destroy args[0] -> KSP.<PETSc attributes> -> "
        "dict['__appctx__'] -> Owner"
    ) in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.mpi(min_size=2)
def test_wrong_communicator_refused(comm: MPI.Intracomm) -> None:
    """An object on a communicator with processes outside the one it is
    managed on (here: on the whole of comm, managed on half of it) is
    refused, naming both sizes, how they compare, the object and what to pass.
    (A congruent duplicate or a subset is accepted: tests/test_clients.py.)"""
    half = comm.Split(comm.Get_rank() % 2)
    try:
        v = PETSc.Vec().createMPI(2, comm=comm)
        v.setName("field")
        owner = Holder()
        with pytest.raises(cgc.RegistrationError) as info:
            cp.manage(owner, v, comm=half)
        text = str(info.value)
        assert f"Vec 'field' lives on a communicator of size {comm.Get_size()}" in text, text
        assert f"size {half.Get_size()} it is being registered on" in text, text
        assert "MPI_Comm_compare: unequal" in text and "COMM_WORLD" in text, text
        v.destroy()
        assert cgc.manager(half).next_key == 0
    finally:
        half.Free()


# -- sync points destroy runs of single-object wrappers in C (collective_gc._speedups)


def test_a_dead_weak_proxy_in_a_managed_objects_attributes_is_skipped(
    comm: MPI.Intracomm,
) -> None:
    # The docs advise a weakref.proxy of the owner to break a cycle; once its
    # referent died, isinstance() on it raises ReferenceError. The walks of
    # manage, immortal and view skip it (view raising on one rank only left
    # the others waiting in its gather).
    class Owner:
        pass

    class Monitor:
        pass

    monitor = Monitor()
    vec = PETSc.Vec().createMPI(8, comm=comm)
    if comm.Get_rank() == 0:
        vec.setAttr("monitor", [weakref.proxy(monitor)])
    del monitor
    owner = Owner()
    cp.manage(owner, vec, comm=comm)  # walks the Vec's attributes back to the owner
    assert cp.immortal(comm) == []
    assert "queued" in cgc.view(comm, file=None, timeout=30)
    del owner, vec
    assert cgc.collect(comm, generation=None, timeout=30).destroyed == 1


def test_collect_on_a_destroyed_petsc_object_is_a_clear_error(comm: MPI.Intracomm) -> None:
    # petsc4py 3.18 crashes reading .comm of a destroyed object: collect
    # must not try, and says what to pass instead.
    cp.install(comm)
    vec = PETSc.Vec().createMPI(8, comm=comm)
    vec.destroy()
    with pytest.raises(TypeError, match="is destroyed: it has no communicator"):
        cgc.collect(vec, generation=None, timeout=30)
    assert cgc.collect(comm, generation=None, timeout=30).sync == 0


def test_the_c_batch_destroy_is_built_here(speedups_c: Any) -> None:
    # The extension is optional for users (no compiler, no extension: the
    # Python path does the same), but this machine builds it, and the tests
    # below must exercise it: a missing build fails here rather than going
    # unnoticed.
    assert _destroyers.NATIVE is not None and cp.batch_destroys()
    assert PETSc.Vec in _destroyers.fast_types() and PETSc.DMDA in _destroyers.fast_types()


def test_batch_destroys_can_be_switched_off_and_on(comm: MPI.Intracomm) -> None:
    # The public switch the PETSc benchmark uses: off, sync points call
    # destroy() from Python; the outcome is the same either way.
    class Owner:
        pass

    # Where COLLECTIVE_GC_PURE_PYTHON=1 blocks the extension, it stays off.
    c = _destroyers.NATIVE is not None
    try:
        for enabled in (False, True):
            assert cp.batch_destroys(enabled) is (enabled and c)
            owner, vec = Owner(), PETSc.Vec().createMPI(8, comm=comm)
            cp.manage(owner, vec, comm=comm)
            del owner
            assert cgc.collect(comm, generation=None).destroyed == 1
            assert vec.handle == 0
        with pytest.raises(TypeError, match="enabled must be True, False or None"):
            cp.batch_destroys(1)  # type: ignore[arg-type]
        assert cp.batch_destroys() is c  # a bad value changes nothing
    finally:
        cp.batch_destroys(True)


class MyVec(PETSc.Vec):  # type: ignore[misc]
    """A user's subclass that overrides destroy(): never taken for the fast path."""

    log: list[Any] = []

    def destroy(self) -> MyVec:
        MyVec.log.append(self.getName())
        super().destroy()
        return self


class BatchPath:
    """Which way sync points destroy single-object wrappers in a test, and the
    sizes of the batches the C way was handed (so a test sees it ran)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.chunks: list[int] = []

    def batch(self, argss: list[tuple[Any, ...]]) -> list[tuple[int, BaseException]]:
        self.chunks.append(len(argss))
        assert _destroyers.NATIVE is not None
        # Returned, never bound: a frame on the failures' tracebacks (f_back)
        # must not hold them (see collective_gc._destroy.Failure).
        return _destroyers.NATIVE.runner(False)(argss)  # type: ignore[no-any-return]


@pytest.fixture(params=["c", "python"])
def batch_path(request: pytest.FixtureRequest) -> Iterator[BatchPath]:
    """Run the test with PETSc destroys in C, then from Python (what
    batch_destroys(False) does). The sync point's bookkeeping is C or Python
    as the process decided: make test runs this file with the extension
    blocked too (COLLECTIVE_GC_PURE_PYTHON=1), where the C way skips."""
    path = BatchPath(request.param)
    if path.name == "c" and _destroyers.NATIVE is None:
        pytest.skip("COLLECTIVE_GC_PURE_PYTHON=1 blocks the C batch destroy in this process")
    set_batch(_destroyers.destroy_one, None if path.name == "python" else path.batch)
    try:
        yield path
    finally:
        cp.batch_destroys(True)


class FailingVec(PETSc.Vec):  # type: ignore[misc]
    """A user's subclass whose destroy() destroys it, then raises."""

    def destroy(self) -> FailingVec:
        super().destroy()
        raise RuntimeError("this Vec's destroy fails after destroying it")


def test_a_failed_batched_destroy_leaves_no_cycle(
    comm: MPI.Intracomm, batch_path: BatchPath
) -> None:
    # The batch's runner catches what destroy() raised, in C or in Python.
    # Once the DestroyError is dropped, with the collector off (as our users
    # run), the failed Vec's Python object is freed by reference counting
    # alone and no garbage cycle is left (tests/test_error_cycles.py: why).
    class Owner:
        pass

    def fail_one() -> tuple[str, weakref.ref[Any]]:
        owner, vec = Owner(), FailingVec().createMPI(8, comm=comm)
        ref = weakref.ref(vec)
        cp.manage(owner, vec, comm=comm)
        del owner, vec
        cgc.collect(comm, generation=None)  # it fails: the next agreement reports it
        try:
            cgc.collect(comm, generation=None)
        except cgc.DestroyError:
            return "DestroyError", ref
        return "nothing raised", ref

    cgc.collect(comm, generation=None)  # the manager and its agreement exist before
    with GcDisabled():
        gc.collect()
        outcome, ref = fail_one()
        alive = ref() is not None
        found = gc.collect()
    verdict = f"{outcome}; Vec alive: {alive}; {found} objects in garbage cycles"
    assert (
        comm.allgather(verdict)
        == ["DestroyError; Vec alive: False; 0 objects in garbage cycles"] * comm.Get_size()
    )
    assert batch_path.name == "python" or batch_path.chunks == [1]


@pytest.mark.mpi(min_size=2)
def test_batched_destroys_keep_the_agreed_order(comm: MPI.Intracomm, batch_path: BatchPath) -> None:
    # Single-object wrappers (batched: PETSc's destroy from C for petsc4py's
    # own classes, destroy() for a subclass), multi-object ones (destroy_all)
    # and a plain registration, interleaved: one newest-first order on every
    # rank, each PETSc object destroyed once, whichever path runs the batch.
    log: list[Any] = []
    tracker = Tracker()
    MyVec.log = log
    expected: list[Any] = []
    with GcDisabled():
        owners: list[Any] = []
        for i in range(12):
            owner = Holder()
            if i % 4 == 0:
                owner.mat = probe_mat(comm, i, log)
                tracker.watch(owner.mat)
                cp.manage(owner, owner.mat, comm=comm)
            elif i % 4 == 1:
                owner.mat = probe_mat(comm, i, log)
                owner.vec = owner.mat.createVecLeft()
                tracker.watch(owner.mat, owner.vec)
                cp.manage(owner, owner.mat, owner.vec, comm=comm)
            elif i % 4 == 2:
                cgc.register(owner, log.append, f"plain{i}", comm=comm)
            else:
                owner.vec = MyVec().createMPI(2, comm=comm)
                owner.vec.setName(f"myvec{i}")
                tracker.watch(owner.vec)
                cp.manage(owner, owner.vec, comm=comm)
            owners.append(owner)
            expected.insert(0, {2: f"plain{i}", 3: f"myvec{i}"}.get(i % 4, i))
        # Two more, last: an exact Vec and a DMDA, on the fast path.
        for obj in (PETSc.Vec().createMPI(2, comm=comm), PETSc.DMDA().create([8], comm=comm)):
            owner = Holder()
            owner.vec = obj
            tracker.watch(obj)
            cp.manage(owner, obj, comm=comm)
            owners.append(owner)
        petsc_objs = [o.vec for o in owners if hasattr(o, "vec")]
        petsc_objs += [o.mat for o in owners if hasattr(o, "mat")]
        rng = random.Random(comm.Get_rank())
        rng.shuffle(owners)
        del owners, owner, obj
        stats = cgc.collect(comm)
    assert stats.destroyed == 14
    assert log == expected  # newest first, on every rank
    assert same_on_all(comm, log)
    assert all(o.handle == 0 for o in petsc_objs)
    assert tracker.alive() == 0 and no_garbage(comm)
    if batch_path.name != "python":
        # Newest first: DMDA+Vec+myvec11 | plain10 | multi9 | 8+myvec7 | ... | 0.
        assert batch_path.chunks == [3, 2, 2, 1]
    tracker.close()


def test_a_long_batch_with_failures_in_several_chunks(batch_path: BatchPath) -> None:
    # The C batch works through a long run in chunks: every object destroyed
    # once, in order, and each failure attributed to its own key.
    comm = MPI.COMM_SELF
    log: list[Any] = []
    tracker = Tracker()
    failing = {5, 700, 1400}
    with GcDisabled():
        owners = []
        for i in range(1500):
            owner = Holder()
            if i in failing or i % 300 == 0:
                owner.mat = probe_mat(comm, i, log, fail=i in failing)
                tracker.watch(owner.mat)
                cp.manage(owner, owner.mat, comm=comm, name=f"m{i}")
            else:
                owner.vec = PETSc.Vec().createSeq(1, comm=comm)
                tracker.watch(owner.vec)
                cp.manage(owner, owner.vec, comm=comm, name=f"v{i}")
            owners.append(owner)
        objs = [getattr(o, "mat", None) or o.vec for o in owners]
        keys = [r.key for r in cgc.manager(comm).alive()]
        del owners, owner
        cgc.collect(comm)  # the next agreement reports what failed
        with pytest.raises(cgc.DestroyError) as info:
            cgc.collect(comm)
    assert info.value.failures == [
        (0, keys[i], f"m{i}", f"RuntimeError: probe {i} refuses to be destroyed")
        for i in sorted(failing, reverse=True)
    ]
    assert log == sorted(failing | set(range(0, 1500, 300)), reverse=True)
    assert all(o.handle == 0 for o in objs)
    assert tracker.alive() == len(failing)  # the wrecks, leaked on purpose
    if batch_path.name != "python":
        assert batch_path.chunks == [1500]
    del info, objs
    assert cgc.collect(comm).destroyed == 0


@pytest.mark.mpi(min_size=2)
def test_batched_destroy_failing_on_one_rank(comm: MPI.Intracomm, batch_path: BatchPath) -> None:
    # Single-object wrappers whose PETSc destroy raises on one rank, in two
    # batches split by a plain registration: the error (the Python context's
    # own) on every rank, attributed to the right key, the rest still
    # destroyed in order, the wrecks forgotten.
    rank, bad = comm.Get_rank(), comm.Get_size() - 1
    log: list[Any] = []
    with GcDisabled():
        owners = []
        for i in range(7):
            owner = Holder()
            if i == 3:
                cgc.register(owner, log.append, "plain", comm=comm, name="plain")
            else:
                owner.mat = probe_mat(comm, i, log, fail=i in (1, 5) and rank == bad)
                cp.manage(owner, owner.mat, comm=comm, name=f"m{i}")
            owners.append(owner)
        mats = [o.mat for o in owners if hasattr(o, "mat")]
        keys = [r.key for r in cgc.manager(comm).alive()]
        del owners, owner
        cgc.collect(comm)  # the next agreement reports what failed
        with pytest.raises(cgc.DestroyError) as info:
            cgc.collect(comm)
    assert info.value.failures == [
        (bad, keys[5], "m5", "RuntimeError: probe 5 refuses to be destroyed"),
        (bad, keys[1], "m1", "RuntimeError: probe 1 refuses to be destroyed"),
    ]
    assert log == [6, 5, 4, "plain", 2, 1, 0]
    assert all(m.handle == 0 for m in mats)
    if batch_path.name != "python":
        assert batch_path.chunks == [3, 3]
    assert "differ between ranks" in str(info.value)
    del info, mats
    with pytest.raises(cgc.CollectiveGCError, match="differ between ranks"):
        cgc.collect(comm)


def test_diagnostics_walk_containers_that_change_while_they_look() -> None:
    """The walk behind immortal() and view() copies the containers it looks
    into; a collection started by that copy runs callbacks (and, with
    threads, other threads) that may change them: it must not raise. Here a
    gc callback changes the dict the destroy's argument is, every time."""
    comm = MPI.COMM_SELF.Dup()
    shared: dict[int, Any] = {i: [i] for i in range(2000)}
    added = [10**6]

    def meddle(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            shared[added[0]] = None
            added[0] += 1

    saved = gc.get_threshold()
    try:
        cp.install(comm)
        owner = _Owner()
        cgc.register(owner, _noop_destroy, shared, comm=comm)
        gc.callbacks.append(meddle)
        gc.set_threshold(100, 10, 10)
        try:
            assert cp.immortal(comm) == []
            cgc.view(comm, file=None)
        finally:
            gc.callbacks.remove(meddle)
            gc.set_threshold(*saved)
        assert added[0] > 10**6, "no collection ran during the walk: the test tested nothing"
        del owner
        assert cgc.collect(comm, generation=None).destroyed == 1
    finally:
        comm.Free()


class _Owner:
    pass


def _noop_destroy(*args: Any) -> None:
    pass


def test_collect_takes_a_petsc_object(petsc: Any) -> None:
    """From the core v2 redesign (issue 14)."""
    from _util import Obj, noop

    comm = MPI.COMM_WORLD.Dup()
    other = MPI.COMM_WORLD.Dup()
    try:
        cp.install(other)
        cp.install(comm)
        vec = petsc.Vec().createMPI(4, comm=comm)
        o = Obj()
        cgc.register(o, noop, comm=comm)
        del o
        # A PETSc object holds PETSc's inner duplicate of comm: found anyway.
        assert cgc.collect(vec, generation=None).destroyed == 1
        vec.destroy()
        unmanaged = MPI.COMM_WORLD.Dup()
        stray = petsc.Vec().createMPI(4, comm=unmanaged)
        with pytest.raises(TypeError, match="cannot tell which communicator"):
            cgc.collect(stray)
        stray.destroy()
        unmanaged.Free()
    finally:
        cgc.collect(comm)
        cgc.collect(other)
        comm.Free()
        other.Free()


# -- issue 39: the promise, round 5 ------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("timeout", [None, 20.0])
def test_after_a_petsc_destroy_failing_on_one_rank_petsc_still_works_until_the_next_sync_point(
    comm: MPI.Intracomm, timeout: float | None, batched: bool
) -> None:
    """Issue 39, item 2. A shell Mat, the only PETSc object on a fresh
    communicator, whose Python context raises in ``destroy`` on rank 1 only.
    Where it succeeded, the Mat was the last object on PETSc's inner
    duplicate of the communicator, which PETSc freed with it; on rank 1 the
    wreck (leaked on purpose) kept it. So the program's next PETSc call on
    the communicator hung: ``createAIJ`` duplicated the communicator
    (``MPI_Comm_dup`` in ``PetscCommDuplicate``) on the other ranks, while
    rank 1 reused its inner communicator and went on to an
    ``MPI_Allgather``, before the family's next agreement could say what
    failed. The promise (README, DestroyError): PETSc's state of the
    communicator does not differ between ranks before the next sync point,
    which raises DestroyError naming the failure on every rank; the family
    refuses from then on (and PETSc still works on the communicator). The
    same from the C runs of destroys and from Python's."""
    rank, bad = comm.Get_rank(), 1
    was = cp.batch_destroys()
    cp.batch_destroys(batched)
    try:
        log: list[Any] = []
        owner = Holder()
        owner.mat = probe_mat(comm, "shell", log, fail=rank == bad)
        key = cp.manage(owner, owner.mat, comm=comm, name="shell").key
        del owner
        cgc.collect(comm, generation=None, timeout=timeout)  # the failure waits for the next
        assert log == ["shell"]  # PETSc called the context's destroy on every rank
        # The next step's PETSc objects: made and used on every rank (it hung here).
        n = 2 * comm.Get_size()
        A = PETSc.Mat().createAIJ([n, n], nnz=1, comm=comm)
        A.setUp()
        lo, hi = A.getOwnershipRange()
        for i in range(lo, hi):
            A.setValue(i, i, 1.0)
        A.assemble()
        x, y = A.createVecs()
        x.set(1.0)
        A.mult(x, y)
        assert y.sum() == n
        for obj in (A, x, y):
            obj.destroy()
        got: tuple[str, Any] = ("returned", None)
        try:
            cgc.collect(comm, generation=None, timeout=timeout)
        except cgc.DestroyError as exc:
            got = ("DestroyError", exc.failures)
            del exc
        assert same_on_all(comm, got), comm.allgather(got)
        assert got == (
            "DestroyError",
            [(bad, key, "shell", "RuntimeError: probe shell refuses to be destroyed")],
        ), got
        # Every rank knows: no later sync point runs on the family ...
        with pytest.raises(cgc.CollectiveGCError, match="differ between ranks"):
            cgc.collect(comm, generation=None)
        # ... which keeps PETSc's inner communicator alive on every rank alike.
        assert same_on_all(comm, cp.held(comm)) and cp.held(comm) == 1
        v = PETSc.Vec().createMPI((2, PETSc.DECIDE), comm=comm)
        v.set(1.0)
        assert v.sum() == 2 * comm.Get_size()
        v.destroy()
    finally:
        cp.batch_destroys(was)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("batched", [True, False])
def test_petsc_inner_communicators_held_for_destroys_are_let_go_two_sync_points_later(
    comm: MPI.Intracomm, batched: bool
) -> None:
    """What the sync points hold so that a failed PETSc destroy cannot make
    PETSc's state differ between ranks (see the test above) is let go once
    two more sync points passed with no failure: nothing kept for longer,
    and a loop that destroys on one communicator at every step holds one."""
    was = cp.batch_destroys()
    cp.batch_destroys(batched)
    try:
        seen = []
        for _ in range(3):  # a solver loop: objects made and dropped at each step
            owner = Holder()
            owner.vec = PETSc.Vec().createMPI(2, comm=comm)
            cp.manage(owner, owner.vec, comm=comm)
            del owner
            cgc.collect(comm, generation=None)
            seen.append(cp.held(comm))
        for _ in range(3):  # no more destroys
            cgc.collect(comm, generation=None)
            seen.append(cp.held(comm))
        assert same_on_all(comm, seen), comm.allgather(seen)
        assert seen[:4] == [1, 1, 1, 1] and seen[-1] == 0, seen
        serial = Holder()
        serial.vec = PETSc.Vec().createSeq(2, comm=MPI.COMM_SELF)
        cp.manage(serial, serial.vec, comm=comm)
        del serial
        cgc.collect(comm, generation=None)
        assert cp.held(comm) == 0  # nothing to hold for a serial object
    finally:
        cp.batch_destroys(was)


@pytest.mark.mpi(min_size=2)
def test_the_family_cleanup_outlives_the_member_it_was_first_installed_on(
    comm: MPI.Intracomm,
) -> None:
    """Issue 39, item 6. ``cp.install`` on a library's ``Dup()`` of the
    communicator, then on the communicator itself; the library frees its
    duplicate. ``install``'s docstring: "each sync point of comm's family
    ... ends with PETSc.garbage_cleanup(comm)"; docs/petsc.md: "One family
    has one cleanup, whichever of its communicators cp.install ran on". So
    the PETSc garbage of Vecs made on the communicator and dropped must be
    cleaned by its next sync points: the member that goes away must not
    take the family's cleanup with it."""
    lib = comm.Dup()
    cp.install(lib)
    cp.install(comm)
    cgc.collect(comm, generation=None)
    lib.Free()
    cgc.collect(comm, generation=None)
    vecs = [PETSc.Vec().createMPI(2, comm=comm) for _ in range(3)]
    del vecs
    before = len(cp.garbage(comm))
    for _ in range(3):
        cgc.collect(comm, generation=None)
    verdicts = comm.allgather((before, cp.garbage(comm)))
    assert all(held == 3 for held, _ in verdicts), verdicts  # petsc4py delayed them
    assert all(left == [] for _, left in verdicts), verdicts


@pytest.mark.mpi(min_size=2)
def test_the_family_cleanup_forgets_the_members_that_were_freed(comm: MPI.Intracomm) -> None:
    """A loop that makes a library communicator congruent with ``comm`` at
    each step (a DOLFINx mesh's), manages a Vec on it and frees it: the
    family's PETSc cleanup looks at the members in use, not at every one
    the run installed (make bench-dolfinx's profile: each vote of the steps
    walked the whole history, 0.2 ms a sync point after 200 steps), and
    still cleans the garbage of the communicator that stays."""
    from collective_gc.petsc import _cleanup

    cp.install(comm)
    for _ in range(20):
        lib = comm.Dup()
        owner = Holder()
        owner.vec = PETSc.Vec().createMPI(2, comm=lib)
        cp.manage(owner, owner.vec, comm=lib)
        del owner
        cgc.collect(lib, generation=None)
        lib.Free()
        cgc.collect(comm, generation=None)
    cleanup = _cleanup.cleanup_of(cgc.manager(comm))
    assert cleanup is not None
    kept = len(cleanup.installed)
    vecs = [PETSc.Vec().createMPI(2, comm=comm) for _ in range(3)]
    del vecs
    cgc.collect(comm, generation=None)
    verdicts = comm.allgather((kept, cp.garbage(comm)))
    assert all(n <= 2 and left == [] for n, left in verdicts), verdicts


@pytest.mark.mpi(min_size=2)
def test_a_held_member_freed_by_its_dropped_hold_is_not_read_again(comm: MPI.Intracomm) -> None:
    """Seen as a segmentation fault in make bench-dolfinx, 1 run in 2: a
    Vec on a library communicator's PETSc inner communicator, managed on the
    communicator itself, installs that inner communicator as a member of
    the family; its destroy holds it; the library frees its own; two sync
    points later the vote drops the hold,
    which was the last reference: PETSc frees the member inside the vote,
    and the vote (and any vote after it before the members were set again)
    read garbage through its dead handle. The state now marks itself stale,
    reads nothing, says there is garbage, and the finish sets the members
    again: the freed one gone, the sync points go on, nothing left held."""
    from collective_gc.petsc import _cleanup

    lib = comm.Dup()
    owner = Holder()
    owner.vec = PETSc.Vec().createMPI(2, comm=lib)
    inner = owner.vec.getComm().tompi4py()
    handle = MPI._handleof(inner)
    cp.manage(owner, owner.vec, comm=comm)
    del owner, inner
    cgc.collect(comm, generation=None)  # destroyed, its inner communicator held
    lib.Free()
    cleanup = _cleanup.cleanup_of(cgc.manager(comm))
    assert cleanup is not None
    seen = [(cp.held(comm), handle in cleanup.state.members)]
    for _ in range(4):
        cgc.collect(comm, generation=None)
        seen.append((cp.held(comm), handle in cleanup.state.members))
    verdicts = comm.allgather((seen, cleanup.state.stale, cp.garbage(comm)))
    assert all(v == verdicts[0] for v in verdicts), verdicts
    assert seen[0] == (1, True) and seen[-1] == (0, False), seen
    assert not cleanup.state.stale and cp.garbage(comm) == [], verdicts


@pytest.mark.mpi(min_size=3)
def test_a_parents_sync_point_drops_a_childs_holds_on_every_rank_alike(
    comm: MPI.Intracomm,
) -> None:
    """Found reading the C CommState (a review, issue 38): a parent's sync
    point asks each child family whether it has something, and a rank with
    an object queued there answers before asking the child's votes; the
    other ranks' answer ran the votes, which dropped PETSc's holds that were
    due. So a hold went on some ranks in the parent's prepare and on the
    others only at the child's visit, with the parent's destroys between.
    Now only the child's own sync points age and drop its holds: a destroy
    of the parent's, run between the two, sees the hold on every rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    child = cgc.split(comm, int(rank == size - 1))  # ranks 0..size-2: a child of size >= 2
    owner = Holder()
    owner.vec = PETSc.Vec().createMPI(2, comm=child)
    cp.manage(owner, owner.vec, comm=child)
    del owner
    cgc.collect(child, generation=None)  # destroyed; its inner communicator held
    probe = Holder()
    cgc.register(probe, lambda: None, comm=child)
    cgc.collect(child, generation=None)  # the hold's first vote
    cgc.collect(child, generation=None)  # due at the child's next vote
    held_before = cp.held(child)
    if rank == 0:
        del probe  # queued on rank 0 alone: its answer comes before the votes
    seen: list[int] = []
    watcher = Holder()
    cgc.register(watcher, lambda c: seen.append(cp.held(c)), child, comm=comm)
    del watcher
    cgc.collect(comm, generation=None)  # the parent: prepare, agree, destroy (seen), visit
    verdicts = comm.allgather((rank < size - 1, held_before, seen, cp.held(child)))
    mine = [v[1:] for v in verdicts if v[0]]
    # In the child: held until its own visit, on every rank alike; gone after it.
    assert all(v == (1, [1], 0) for v in mine), verdicts
    probe = None  # ranks 1..: their probe too; then every rank has it queued
    cgc.collect(child, generation=None)
    left = (len(cgc.pending(child)), no_garbage(child), cp.held(child))
    del child
    cgc.collect(comm, generation=None)  # the dropped child is freed at its parent's sync point
    assert same_on_all(comm, left) and left == (0, True, 0), left


def test_communicator_handles_compare_as_mpi4py_gives_them() -> None:
    """Found reading the C CommState (a review, issue 38): MPI._handleof
    gives a handle cast to an unsigned pointer-sized integer, and an MPICH
    communicator is an int that is below 0 for a duplicate: its integer is
    above 2**63. The C state refused it (a signed conversion: OverflowError,
    so cp.manage and install failed there), and PETSc's inner communicator
    read from its attribute came back signed, never equal to mpi4py's
    integer for the same communicator. Both now take and give mpi4py's."""
    mpich_dup = -2080374783  # 0x84000001 as an int: an MPICH duplicate's handle
    as_mpi4py = mpich_dup % (1 << 64)
    assert as_mpi4py > (1 << 63)
    # PETSc keeps the handle in a union with a void*: anything above 32 bits is not its.
    for raw in (0x84000001, 0xDEAD_0000_8400_0001):
        assert _internals.comm_handle(raw, int_handles=True) == as_mpi4py
    assert _internals.comm_handle(0x7F00_1234_5678, int_handles=False) == 0x7F00_1234_5678
    # The state's members and holds take such an integer (serial: nothing is
    # held, so no handle is used) in both twins.
    state = _destroyers.comm_state(True)
    state.set_members((as_mpi4py, 0x7F00_1234_5678))
    assert state.members == (as_mpi4py, 0x7F00_1234_5678)
    _destroyers.comm_state(False).hold(as_mpi4py)


@pytest.mark.mpi(min_size=2)
def test_one_owner_managed_on_two_congruent_communicators(comm: MPI.Intracomm) -> None:
    """Issue 39, item 7 (a regression of families). Two layers of a
    program manage what each owns on one owner object: a solver's Mat on
    the mesh's communicator, and a second Mat on the communicator PETSc
    shows for it (``getComm().tompi4py()``, PETSc's inner duplicate of the
    mesh's: congruent with it). docs/petsc.md described this before
    families (one registration per communicator); now the second is refused
    with a message that names neither communicator, and README's
    RegistrationError row does not list the case. Either answer is a
    promise kept: accepted (two keys, both destroyed once the owner dies,
    newest first), or refused naming both communicators and that they are
    one family."""

    class PoissonStep:
        A: Any
        P: Any

    mesh = comm.Dup()
    log: list[Any] = []
    step = PoissonStep()
    step.A = probe_mat(mesh, "A", log)
    step.P = probe_mat(mesh, "P", log)
    inner = step.P.getComm().tompi4py()
    assert MPI.Comm.Compare(inner, mesh) == MPI.CONGRUENT
    first = cp.manage(step, step.A, comm=mesh, name="solver")
    outcome, text = "accepted", ""
    try:
        cp.manage(step, step.P, comm=inner, name="preconditioner")
    except cgc.RegistrationError as exc:
        outcome, text = "refused", str(exc)
    del step
    cgc.collect(mesh, generation=None)
    verdicts = comm.allgather((outcome, text, list(log), first.state))
    if outcome == "accepted":
        assert all(v[2] == ["P", "A"] and v[3] == "destroyed" for v in verdicts), verdicts
    else:
        assert all(v[0] == "refused" for v in verdicts), verdicts
        # Both communicators, and why they clash: they are one family.
        assert text.count("communicator") >= 2 and "family" in text, text
    cgc.manager(mesh).close()
    mesh.Free()


@pytest.mark.mpi(min_size=2)
def test_a_cleanup_that_frees_an_installed_inner_communicator_is_no_failure(
    comm: MPI.Intracomm,
) -> None:
    """Found while reproducing issue 39, item 7. ``cp.install`` on a
    communicator and on PETSc's inner duplicate of it (what ``cp.manage``
    does for an object's ``getComm().tompi4py()``): one family, two
    installed members. The Vec dropped there is PETSc's last object on the
    inner duplicate, so the cleanup of the first member frees it; the
    cleanup must not then read the freed member (it raised
    CollectiveGCError "was freed", counted as a failed PETSc destroy: a
    DestroyError at the next sync point, and the family refused for
    good). The garbage is cleaned and the sync points go on."""
    mesh = comm.Dup()
    vec = PETSc.Vec().createMPI(2, comm=mesh)
    inner = vec.getComm().tompi4py()
    cp.install(mesh)
    cp.install(inner)
    del vec, inner
    outcomes = [attempt(lambda: cgc.collect(mesh, generation=None))[0] for _ in range(3)]
    verdicts = comm.allgather((outcomes, cp.garbage(mesh)))
    assert verdicts == [(["ok", "ok", "ok"], [])] * comm.Get_size(), verdicts
    cgc.manager(mesh).close()
    mesh.Free()


@pytest.mark.mpi(min_size=2)
def test_an_unread_release_cleans_past_a_member_an_earlier_cleanup_freed(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside the releases whose layouts were read (a PETSc after 3.24),
    managing a parallel object installs its communicator and PETSc's inner
    one, and each sync point with garbage cleans every installed one. The
    cleanup of the first can free the second (PETSc's last object on it
    destroyed); the loop must pass over it. From a review of the PETSc
    adapter (stop 57): reading the freed member's communicator raised, and
    the family was refused for a PETSc destroy that never failed."""
    monkeypatch.setattr(_internals, "PETSC_RELEASE", (3, 99))
    monkeypatch.setattr(_internals, "PETSC4PY_RELEASE", (3, 99))
    monkeypatch.setattr(_internals, "READER", None)
    kept = PETSc.Vec().createMPI(2, comm=comm)  # unmanaged: holds PETSc's inner one
    owner = Holder()
    owner.vec = PETSc.Vec().createMPI(2, comm=comm)
    cp.manage(owner, owner.vec, comm=comm, name="managed")
    del owner
    seen = [attempt(lambda: cgc.collect(comm, generation=None, timeout=30))[0] for _ in range(3)]
    del kept  # PETSc's garbage: its cleanup frees the inner communicator
    seen += [attempt(lambda: cgc.collect(comm, generation=None, timeout=30))[0] for _ in range(3)]
    verdicts = comm.allgather(seen)
    assert all(v == ["ok"] * 6 for v in verdicts), verdicts


def test_the_petsc_questions_make_no_manager() -> None:
    """``cp.held`` and ``cp.immortal`` of a communicator collective_gc never
    saw answer "nothing" without making a manager for it (a question has no
    side effect: such a manager would be one more for the exit agreement
    and the leak checks). From a review of the PETSc adapter (stop 57)."""
    c = MPI.COMM_SELF.Dup()
    try:
        answers = (cp.held(c), cp.immortal(c))
        made = [m for m in cgc.managers() if not m.comm_freed and m.comm == c]
    finally:
        c.Free()
    assert (answers, made) == ((0, []), [])


# Communicators on which a test left PETSc's state split between ranks: never
# freed here (a free would be collective PETSc work on them).
_SPLIT: list[MPI.Intracomm] = []


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_cleanup_failing_on_one_rank_stops_the_later_ones_on_every_rank(
    comm: MPI.Intracomm,
) -> None:
    """The family's PETSc participant cleans PETSc's garbage on each installed
    communicator that holds some, each cleanup collective over its own. A
    raw Python-type Mat dropped on ``comm`` whose context's destroy fails on
    the last rank makes ``comm``'s cleanup raise there only: then no rank
    starts the cleanup of a library's duplicate after it (the ranks that
    went on waited in it for ever), and the failure is reported by the
    next agreement, on every rank. From a review of the PETSc adapter
    (stop 57): the first error left the loop on its rank only."""
    rank, bad = comm.Get_rank(), comm.Get_size() - 1
    lib = comm.Dup()
    _SPLIT.append(lib)
    log: list[Any] = []
    tracker = Tracker()
    cp.install(comm)
    cp.install(lib)  # a second member, cleaned after comm's
    mat = probe_mat(comm, "raw", log, fail=rank == bad)
    vec = PETSc.Vec().createMPI(2, comm=lib)
    tracker.watch(vec)
    del mat, vec  # PETSc's garbage now, on comm's and on lib's
    first, _ = attempt(lambda: cgc.collect(comm, generation=None, timeout=60))
    cleaned = tracker.alive() == 0
    second, _ = attempt(lambda: cgc.collect(comm, generation=None, timeout=60))
    verdicts = comm.allgather((first, cleaned, second, log))
    tracker.close()
    assert all(v == ("ok", False, "DestroyError", ["raw"]) for v in verdicts), verdicts


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_an_unread_release_stops_cleaning_past_a_cleanup_failing_on_one_rank(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where PETSc's layouts are not read, ``cp.manage`` installs a
    communicator and PETSc's inner one, and each sync point cleans both,
    in that order. When the first cleanup raises on one rank only, the
    other ranks' cleanup frees the inner communicator (its last object
    gone) while it survives with the wreck on the failing rank: no rank
    may clean it then (the failing rank alone would wait in a cleanup
    nobody joins). From the review of stop 57's diff: a loop that went on
    past the failure on its rank hung here."""
    monkeypatch.setattr(_internals, "PETSC_RELEASE", (3, 99))
    monkeypatch.setattr(_internals, "PETSC4PY_RELEASE", (3, 99))
    monkeypatch.setattr(_internals, "READER", None)
    rank, bad = comm.Get_rank(), comm.Get_size() - 1
    log: list[Any] = []
    owner = Holder()
    owner.vec = PETSc.Vec().createMPI(2, comm=comm)
    cp.manage(owner, owner.vec, comm=comm, name="managed")  # installs comm and its inner one
    mat = probe_mat(comm, "raw", log, fail=rank == bad)  # unmanaged: PETSc's garbage once dropped
    del owner, mat
    first, _ = attempt(lambda: cgc.collect(comm, generation=None, timeout=60))
    second, _ = attempt(lambda: cgc.collect(comm, generation=None, timeout=60))
    verdicts = comm.allgather((first, second, log))
    assert all(v == ("ok", "DestroyError", ["raw"]) for v in verdicts), verdicts


class _StoresMeanwhile:
    """Stands in for the weak reference in manage()'s cache of its last
    communicator: dereferenced, it stores another communicator's entry in
    the cache first, as another thread's manage() may while this one runs."""

    def __init__(self, comm: MPI.Intracomm, other: list[Any]) -> None:
        self.comm, self.other = comm, other

    def __call__(self) -> MPI.Intracomm:
        cp._LAST[:] = self.other
        return self.comm


def test_manage_reads_its_cache_of_the_last_communicator_in_one_step(
    comm: MPI.Intracomm,
) -> None:
    """manage() keeps the communicator of its last call, with its manager,
    family and cleanup, for the next call's fast path; another thread's
    call may store its own meanwhile (threads may manage objects on
    different communicators). One call must take one entry: the manager
    read after another call stored its own would register this
    communicator's object on that other communicator. From a review of the
    PETSc adapter (stop 57)."""
    if _destroyers.NATIVE is None:
        pytest.skip("the C path is off in this process (COLLECTIVE_GC_PURE_PYTHON=1)")
    lib = MPI.COMM_SELF.Dup()
    try:
        first = Holder()
        first.vec = PETSc.Vec().createSeq(2, comm=PETSc.COMM_SELF)
        cp.manage(first, first.vec, comm=lib)  # the cache holds lib's entry
        other = list(cp._LAST)
        second = Holder()
        second.vec = PETSc.Vec().createMPI(2, comm=comm)
        cp.manage(second, second.vec, comm=comm)  # now comm's
        ref, mgr, fam, cleanup = cp._LAST
        cp._LAST[:] = [_StoresMeanwhile(comm, other), mgr, fam, cleanup]
        third = Holder()
        third.vec = PETSc.Vec().createMPI(2, comm=comm)
        before = (cgc.manager(comm).registered, cgc.manager(lib).registered)
        cp.manage(third, third.vec, comm=comm)
        after = (cgc.manager(comm).registered, cgc.manager(lib).registered)
        assert (after[0] - before[0], after[1] - before[1]) == (1, 0), (before, after)
        del first, second, third, ref, mgr, fam, cleanup, other
        for _ in range(2):
            cgc.collect(comm, generation=None, timeout=30)
            cgc.collect(lib, generation=None, timeout=30)
    finally:
        cp._LAST[:] = [None, None, None, None]
        cgc.manager(lib).close()
        lib.Free()
