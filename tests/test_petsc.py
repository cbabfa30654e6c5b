"""collective_gc.petsc with real petsc4py objects, serially and on 4 ranks.

"Destroyed exactly once" is checked with PETSc's own state, not our counters:
a serial tracker Vec is composed onto every object under test, so PETSc's
reference count of the tracker falls by one each time PETSc really destroys
one of them; Mats of Python type record the moment PETSc calls their
destroy; petsc4py nulls a handle when it destroys it; and PETSc's garbage maps
are read directly.

petsc4py is imported at the top on purpose: if it is missing, these tests
fail rather than skip.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from typing import Any

import pytest
from mpi4py import MPI
from petsc4py import PETSc

import collective_gc as cgc
from collective_gc import _manager
from collective_gc import petsc as cp
from collective_gc._manager import set_batch

from _util import GcDisabled, same_on_all


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

    def __init__(self, tag: Any, log: list[Any], fail: bool = False) -> None:
        self.tag, self.log, self.fail = tag, log, fail

    def destroy(self, mat: PETSc.Mat) -> None:
        self.log.append(self.tag)
        if self.fail:
            raise RuntimeError(f"probe {self.tag} refuses to be destroyed")

    def mult(self, mat: PETSc.Mat, x: PETSc.Vec, y: PETSc.Vec) -> None:
        x.copy(y)


def probe_mat(comm: MPI.Comm, tag: Any, log: list[Any], fail: bool = False) -> PETSc.Mat:
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
        assert [cls for _, cls in cp.garbage(comm)] == ["Vec"] * 4
        assert "Vec" in [cls for _, cls in cp.garbage(MPI.COMM_SELF)]
        assert tracker.alive() == 5  # delayed: PETSc has not destroyed them
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
        assert "PETSc garbage #" in text and "(COMM_SELF)" in text and "Vec" in text
        cgc.collect(comm)
        assert "PETSc garbage" not in cgc.view(comm, file=None)

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
def test_destroy_failing_in_petsc_is_reported_on_every_rank(comm: MPI.Intracomm) -> None:
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
    with pytest.raises(cgc.DestroyError) as info:
        cgc.collect(comm)
    assert info.value.failures == [
        (bad, reg.key, "faulty", "RuntimeError: probe m refuses to be destroyed")
    ]
    assert f"rank {bad}, key {reg.key} ('faulty')" in str(info.value)
    assert log == ["m"]  # PETSc called the Mat's destroy on every rank
    assert objs[0].handle == 0  # the Vec was still destroyed, after the Mat failed
    assert objs[1].handle == 0  # the failed Mat is forgotten, never destroyed again
    del info, objs
    assert cgc.collect(comm).destroyed == 0  # later sync points neither hang nor crash
    # The bad rank leaked its half-destroyed Mat (and its tracker reference).
    assert tracker.alive() == (1 if rank == bad else 0)
    assert no_garbage(comm)
    # The wreck keeps PETSc's inner communicator alive on the bad rank only:
    # PETSc's own cleanup would now duplicate the communicator on the other
    # ranks only, and hang. Give the bad rank some garbage there (a Random's
    # creation makes no collective call): the hook must see the split state,
    # skip the cleanup and say so on every rank.
    if rank == bad:
        PETSc.Random().create(comm)
    with pytest.warns(RuntimeWarning, match="differs between ranks"):
        cgc.collect(comm)
    tracker.close()


def test_failed_serial_destroy_is_never_repeated() -> None:
    # A serial wreck lands in COMM_SELF's garbage; cleaning it must not
    # destroy it again (that segfaulted before the wreck was forgotten).
    log: list[Any] = []
    comm = MPI.COMM_SELF
    owner = Holder()
    owner.mat = probe_mat(comm, "s", log, fail=True)
    mat = owner.mat
    cp.manage(owner, owner.mat, comm=comm, name="serial-faulty")
    del owner
    with pytest.raises(cgc.DestroyError, match="serial-faulty"):
        cgc.collect(comm)
    assert log == ["s"] and mat.handle == 0
    cgc.collect(comm)  # cleans COMM_SELF's garbage: the wreck is only dropped
    assert log == ["s"]
    assert cp.garbage(comm) == []


@pytest.mark.mpi(min_size=2)
def test_wrong_communicator_refused(comm: MPI.Intracomm) -> None:
    other = comm.Dup()
    try:
        v = PETSc.Vec().createMPI(2, comm=other)
        owner = Holder()
        with pytest.raises(cgc.RegistrationError, match="not the communicator"):
            cp.manage(owner, v, comm=comm)
        v.destroy()
        assert cgc.manager(comm).next_key == 0
    finally:
        other.Free()


# -- sync points destroy runs of single-object wrappers in C (collective_gc._speedups)


def test_the_c_batch_destroy_is_built_here() -> None:
    # The extension is optional for users (no compiler, no extension: the
    # Python path does the same), but this machine builds it, and the tests
    # below must exercise it: a missing build fails here rather than going
    # unnoticed.
    assert cp._BATCH is not None
    assert _manager._take_batch is not _manager._take_batch_py
    assert _manager._run_each is not _manager._run_each_py
    assert PETSc.Vec in cp._fast_types() and PETSc.DMDA in cp._fast_types()


class MyVec(PETSc.Vec):  # type: ignore[misc]
    """A user's subclass that overrides destroy(): never taken for the fast path."""

    log: list[Any] = []

    def destroy(self) -> MyVec:
        MyVec.log.append(self.getName())
        super().destroy()
        return self


_SPEEDUPS = (_manager._take_batch, _manager._run_each)


class BatchPath:
    """Which way sync points destroy single-object wrappers in a test, and the
    sizes of the batches the C way was handed (so a test sees it ran)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.chunks: list[int] = []

    def batch(self, argss: list[tuple[Any, ...]]) -> list[tuple[int, BaseException]]:
        self.chunks.append(len(argss))
        assert cp._BATCH is not None
        return cp._BATCH(argss)


@pytest.fixture(params=["c", "python", "mixed"])
def batch_path(request: pytest.FixtureRequest) -> Iterator[BatchPath]:
    """Run the test with the sync point's bookkeeping and PETSc destroys in C,
    then both in Python (the fallbacks without the extension), then the
    bookkeeping in Python and the destroys in C."""
    path = BatchPath(request.param)
    set_batch(cp._destroy_one, None if path.name == "python" else path.batch)
    if path.name != "c":
        _manager._take_batch = _manager._take_batch_py
        _manager._run_each = _manager._run_each_py
    try:
        yield path
    finally:
        set_batch(cp._destroy_one, cp._BATCH)
        _manager._take_batch, _manager._run_each = _SPEEDUPS


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
    del info, mats
    assert cgc.collect(comm).destroyed == 0
