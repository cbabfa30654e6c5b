"""The promise off the happy path (issue 11): threads, interrupts, freed
communicators, diagnostics at the worst moment, bad arguments.

Each test names the defect it guards. They run serially and under
``mpiexec -n 4``; the ones about deadlines, exit and MPI_Finalize start their
own jobs and are in test_reliability_jobs.py.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import io
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import collective_gc as cgc
from collective_gc import _destroy, _registration

from _util import CheckedLog, GcDisabled, Obj, same_on_all

WORLD = MPI.COMM_WORLD


class Token:
    """What a destroy checks: the object it stands for must be dead by then."""

    def __init__(self, obj: object) -> None:
        self.ref = weakref.ref(obj)
        self.destroyed = 0


def noop(*args: object) -> None:
    pass


def checked_destroy(token: Token) -> None:
    assert token.ref() is None, "destroy of a live object"
    token.destroyed += 1


# -- 1: registration from several threads ---------------------------------------


def test_threads_register_and_drop_on_comm_self_while_syncing() -> None:
    comm = MPI.COMM_SELF.Dup()
    tokens: list[Token] = []
    keys: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker() -> None:
        try:
            for _ in range(4000):
                o = Obj()
                t = Token(o)
                reg = cgc.register(o, checked_destroy, t, comm=comm)
                tokens.append(t)
                keys.append(reg.key)
                del o
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    # Switch threads as often as possible: races show up in one run, not one in ten.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            cgc.collect(comm, generation=None)
        stop.set()
        for t in threads:
            t.join()
        assert not errors, errors
        for _ in range(3):
            cgc.collect(comm)
        assert len(keys) == len(set(keys)) == 16000, "duplicate keys"
        assert sorted(keys) == list(range(16000))
        assert [t.destroyed for t in tokens] == [1] * 16000, "lost or repeated destroys"
        assert cgc.pending(comm) == [] and cgc.manager(comm).alive() == []
    finally:
        sys.setswitchinterval(interval)
        comm.Free()


def test_first_lookup_from_several_threads_makes_one_manager() -> None:
    # Found by the stress harness: two managers for one communicator, each
    # numbering its registrations from 0.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(50):
            comm = MPI.COMM_SELF.Dup()
            start = threading.Barrier(4)
            found: list[object] = []

            def lookup(
                comm: MPI.Intracomm = comm,
                start: threading.Barrier = start,
                found: list[object] = found,
            ) -> None:
                start.wait()
                found.append(cgc.manager(comm))

            threads = [threading.Thread(target=lookup) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len({id(m) for m in found}) == 1, found
            assert not cgc.manager(comm).comm_freed
            comm.Free()
    finally:
        sys.setswitchinterval(interval)


def test_other_threads_may_register_while_a_destroy_runs() -> None:
    comm = MPI.COMM_SELF.Dup()
    started, release = threading.Event(), threading.Event()
    got: list[Any] = []

    def slow_destroy() -> None:
        started.set()
        release.wait(10)

    def other() -> None:
        started.wait(10)
        try:
            got.append(cgc.register(Obj(), noop, comm=comm))
        except BaseException as exc:  # reported below
            got.append(exc)
        finally:
            release.set()

    try:
        with GcDisabled():
            o = Obj()
            cgc.register(o, slow_destroy, comm=comm)
            del o
            t = threading.Thread(target=other)
            t.start()
            cgc.collect(comm, generation=None)
            t.join()
        # The rule "not from inside a destroy" is for the destroying thread only.
        assert isinstance(got[0], cgc.Registration), got
        # ... which is still refused.
        refused: list[BaseException] = []

        def registering_destroy() -> None:
            try:
                cgc.register(Obj(), noop, comm=comm)
            except cgc.CollectiveGCError as exc:
                refused.append(exc)

        o = Obj()
        cgc.register(o, registering_destroy, comm=comm)
        del o
        cgc.collect(comm)
        assert refused and "from inside a destroy" in str(refused[0])
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_two_threads_registering_at_once_on_a_parallel_comm_is_refused() -> None:
    comm = WORLD.Dup()
    outcome: list[BaseException] = []
    try:
        if comm.Get_rank() == 0:
            # The first registration on the communicator waits for every rank
            # (it makes the manager's duplicate); the others come late, so a
            # second thread registers while the first one is still inside.
            first = threading.Thread(
                target=lambda: outcome.append(
                    cgc.register(Obj(), noop, comm=comm)  # type: ignore[func-returns-value]
                ),
                name="first-registrar",
            )
            first.start()
            time.sleep(0.3)
            try:
                cgc.register(Obj(), noop, comm=comm)
            except cgc.RegistrationError as exc:
                outcome.append(exc)
            first.join()
        else:
            time.sleep(1.0)
            cgc.register(Obj(), noop, comm=comm)
        if comm.Get_rank() == 0:
            errors = [e for e in outcome if isinstance(e, cgc.RegistrationError)]
            assert errors, outcome
            text = str(errors[0])
            assert "'first-registrar'" in text and "'MainThread'" in text, text
        # Nothing was mis-keyed: the one registration made agrees everywhere.
        assert cgc.manager(comm).next_key == 1
        cgc.collect(comm)
    finally:
        comm.Free()


# -- 2 and 7: freed communicators ------------------------------------------------


def test_manager_of_a_freed_communicator() -> None:
    comm = WORLD.Dup()
    log = CheckedLog(WORLD)
    o = Obj()
    cgc.register(o, log.destroy, "after-free", comm=comm)
    mgr = cgc.manager(comm)
    del o
    comm.Free()
    assert mgr.comm_freed
    with pytest.raises(cgc.CollectiveGCError, match="was freed"):
        mgr.comm  # noqa: B018 (the property is the test)
    with pytest.raises(ValueError, match="COMM_NULL"):
        cgc.collect(comm)
    # Its pending destroy is not lost: the manager still agrees over its own
    # duplicate (the exit agreement does this for a program that never asks).
    assert mgr.sync().destroyed == 1
    assert log.keys == ["after-free"]


def test_freed_communicators_do_not_accumulate() -> None:
    before = len(cgc.managers())
    for _ in range(300):
        comm = WORLD.Dup()
        o = Obj()
        cgc.register(o, noop, comm=comm)
        del o
        cgc.collect(comm, generation=None)
        comm.Free()
    cgc.manager(MPI.COMM_SELF)  # a lookup is a safe point to let go of freed managers
    assert len(cgc.managers()) <= before + 2, len(cgc.managers())


# -- 3: KeyboardInterrupt or SystemExit raised by a destroy on one rank ------------


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_interrupt_in_a_destroy_on_one_rank(
    comm: MPI.Intracomm, exc_type: type[BaseException]
) -> None:
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    log = CheckedLog(comm)

    def destroy(tag: str) -> None:
        log.destroy(tag)
        if tag == "b" and rank == last:
            raise exc_type

    with GcDisabled():
        objs = [Obj() for _ in range(3)]
        regs = [cgc.register(o, destroy, t, comm=comm, name=t) for o, t in zip(objs, "abc")]
        del objs
        if rank == last:
            with pytest.raises(exc_type) as info:
                cgc.collect(comm, generation=None)
            notes = "".join(getattr(info.value, "__notes__", []))
            assert "every agreed destroy ran" in notes, notes
        else:
            with pytest.raises(cgc.DestroyError) as err:
                cgc.collect(comm, generation=None)
            assert err.value.failures == [(last, regs[1].key, "b", f"{exc_type.__name__}: ")]
    assert log.keys == ["c", "b", "a"]
    # The user caught it: the next sync point is in step on every rank.
    o = Obj()
    cgc.register(o, log.destroy, "d", comm=comm)
    del o
    assert cgc.collect(comm).destroyed == 1
    assert log.keys == ["c", "b", "a", "d"]


@contextlib.contextmanager
def _interrupted_batches(comm: MPI.Intracomm) -> Iterator[list[str]]:
    """Register four objects (keys 0, 1: plain destroys; 2, 3: a batched
    one, so two runs of destroys: k3 k2, then k1 k0) and drop them; yields
    the destroy log, and frees the communicator and the batch after."""
    log: list[str] = []

    def batched(tag: str) -> None:
        log.append(tag)

    def run_batch(argss: list[tuple[Any, ...]]) -> Any:
        for args in argss:
            batched(*args)
        return []

    _destroy.set_batch(batched, run_batch)
    try:
        with GcDisabled():
            objs = [Obj() for _ in range(4)]
            for i, o in enumerate(objs):
                cgc.register(o, log.append if i < 2 else batched, f"k{i}", comm=comm)
            del objs, o
            yield log
    finally:
        _destroy.set_batch(batched, None)
        comm.Free()


class _Between:
    """A trace function raising KeyboardInterrupt in _destroy.run where the
    second run of destroys is about to begin, as a signal landing there would."""

    def __init__(self) -> None:
        source, first = inspect.getsourcelines(_destroy.run)
        self.lines = {first + i for i, line in enumerate(source) if "= segments[pos]" in line}
        assert self.lines
        self.fired = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not _destroy.run.__code__:
            return None
        if (
            event == "line"
            and frame.f_lineno in self.lines
            and frame.f_locals.get("pos") == 1
            and not self.fired
        ):
            self.fired += 1
            raise KeyboardInterrupt
        return self


def _collect_interrupted(comm: MPI.Intracomm, interrupt_here: bool) -> tuple[str, int]:
    tracer = _Between()
    if interrupt_here:
        sys.settrace(tracer)
    try:
        cgc.collect(comm, generation=None, timeout=60)
        outcome = "ok"
    except KeyboardInterrupt as exc:
        held = "held until the sync point's collectives were done" in str(exc.__notes__)
        outcome = "KeyboardInterrupt, held" if held else "KeyboardInterrupt"
    finally:
        sys.settrace(None)
    return outcome, tracer.fired


def test_interrupt_between_runs_of_destroys_is_held_and_the_rest_run() -> None:
    # An interrupt (a signal) can land between two runs of destroys: the runs
    # not begun still run (on more than one rank, the others run them all),
    # and the interrupt is raised once the sync point is done.
    comm = MPI.COMM_SELF.Dup()
    with _interrupted_batches(comm) as log:
        assert _collect_interrupted(comm, True) == ("KeyboardInterrupt, held", 1)
        assert log == ["k3", "k2", "k1", "k0"]
        assert cgc.pending(comm) == [] and cgc.manager(comm).registered == 0
        assert cgc.manager(comm).broken is None
        assert cgc.collect(comm, generation=None).destroyed == 0


@pytest.mark.mpi(min_size=2)
def test_interrupt_between_runs_on_one_rank_leaves_every_rank_in_step() -> None:
    comm = WORLD.Dup()
    rank = comm.Get_rank()
    with _interrupted_batches(comm) as log:
        outcome = _collect_interrupted(comm, rank == 0)
        everyone = comm.allgather((outcome, log, cgc.manager(comm).registered))
        want = [
            (
                ("KeyboardInterrupt, held", 1) if r == 0 else ("ok", 0),
                ["k3", "k2", "k1", "k0"],
                0,
            )
            for r in range(comm.Get_size())
        ]
        assert everyone == want, everyone
        # In step: the next sync point agrees and destroys everywhere.
        o = Obj()
        cgc.register(o, log.append, "k4", comm=comm)
        del o
        assert cgc.collect(comm, generation=None, timeout=60).destroyed == 1
        assert log[-1] == "k4"


@pytest.mark.mpi(min_size=3)
def test_mismatch_in_a_derived_communicator_raises_on_every_rank_of_the_parent() -> None:
    parent = WORLD.Dup()
    rank = parent.Get_rank()
    child = cgc.split(parent, int(rank >= 2))
    keep = [Obj()]
    cgc.register(keep[0], noop, comm=child)
    if rank == 0:
        keep.append(Obj())
        cgc.register(keep[1], noop, comm=child)  # registered on one rank of the child only
    # Ranks 0 and 1 find their child's keys differ; ranks 2 and 3 are not in
    # it. Every rank of the parent must raise, none may wait in its header.
    with pytest.raises(cgc.DestroyError, match="disagree"):
        cgc.collect(parent, timeout=30)
    assert cgc.collect(parent, timeout=30).destroyed == 0  # the parent goes on


# -- 8 and 9: diagnostics change nothing ---------------------------------------------


def test_destroy_that_detaches_and_asks_pending_loses_nothing(comm: MPI.Intracomm) -> None:
    log = CheckedLog(comm)
    with GcDisabled():
        box = [Obj()]
        sib_reg = cgc.register(box[0], log.destroy, "sibling", comm=comm)
        later = [Obj() for _ in range(3)]
        later_regs = [
            cgc.register(o, log.destroy, f"later{i}", comm=comm) for i, o in enumerate(later)
        ]
        seen: list[int] = []

        def destroy() -> None:
            log.destroy("first")
            box.clear()  # a sibling dies during the sync point...
            assert sib_reg.detach()  # ...and its registration is detached here
            later.clear()  # three more managed objects die, queued meanwhile
            seen.append(len(cgc.pending(comm)))  # diagnostics, mid-sync
            cgc.view(comm, file=None)  # collective: every rank runs this destroy

        first = Obj()
        cgc.register(first, destroy, comm=comm)
        del first
        assert cgc.collect(comm, generation=None).destroyed == 1
        assert seen == [3]
        assert [r.state for r in later_regs] == ["queued"] * 3
        assert cgc.collect(comm, generation=None).destroyed == 3
    assert log.keys == ["first", "later2", "later1", "later0"]
    assert sib_reg.state == "detached"


def test_diagnostics_do_not_silence_strict_mode(comm: MPI.Intracomm) -> None:
    with cgc.collective_scope(comm, strict=True) as scope:
        o = Obj()
        o.peer = o
        cgc.register(o, noop, comm=comm, name="cyclic-one")
        del o
        gc.collect()
        assert [r.name for r in cgc.pending(comm)] == ["cyclic-one"]
        assert "cyclic-one" in cgc.view(comm, file=None)
        assert cgc.pending(comm)[0].state == "queued"
        with pytest.raises(cgc.CyclicFinalizationError, match="cyclic-one"):
            scope.sync()


def test_find_cycles_while_another_thread_changes_what_it_walks() -> None:
    # Found by the stress harness: the walk is a generator, and a dict it was
    # iterating changed size on another thread meanwhile.
    shared: dict[int, Obj] = {}
    root = Obj(shared)
    root.peer = root
    stop = threading.Event()

    def mutate() -> None:
        i = 0
        while not stop.is_set():
            shared[i % 500] = Obj()
            if i % 3 == 0:
                shared.pop((i * 7) % 500, None)
            i += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=mutate)
    t.start()
    try:
        for _ in range(200):
            assert cgc.find_cycles(root, max_depth=3)
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)


# -- 10: local calls are local ---------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_local_calls_on_one_rank_make_no_collective() -> None:
    comm = WORLD.Dup()
    try:
        if comm.Get_rank() == 0:
            # With a collective hidden inside, any of these would hang here.
            assert cgc.pending(comm) == []
            assert cgc.current_scope(comm) is None
            cgc.collective_scope(comm)  # constructed, not entered
            assert cgc.pending(comm) == []
        comm.Barrier()
    finally:
        comm.Free()


# -- 11: GC state with scopes on several threads -------------------------------------


def test_overlapping_scopes_on_two_threads_restore_the_collector() -> None:
    assert gc.isenabled()
    comms = [MPI.COMM_SELF.Dup(), MPI.COMM_SELF.Dup()]
    inside, leave = threading.Event(), threading.Event()

    def second() -> None:
        with cgc.collective_scope(comms[1]):
            inside.set()
            leave.wait(10)

    try:
        t = threading.Thread(target=second)
        with cgc.collective_scope(comms[0]):
            t.start()
            inside.wait(10)
            assert not gc.isenabled()
        assert not gc.isenabled()  # the other thread's scope is still open
        leave.set()
        t.join()
        assert gc.isenabled()
    finally:
        leave.set()
        for c in comms:
            c.Free()


def test_misnested_exit_restores_the_collector_and_the_stack() -> None:
    comm = MPI.COMM_SELF.Dup()
    try:
        outer = cgc.collective_scope(comm, gc="auto")
        inner = cgc.collective_scope(comm, gc="managed")
        outer.__enter__()
        inner.__enter__()
        with pytest.raises(cgc.CollectiveGCError, match="innermost first"):
            outer.__exit__(None, None, None)
        assert not gc.isenabled()  # inner (managed) is still open
        inner.__exit__(None, None, None)
        assert gc.isenabled() and cgc.current_scope() is None
    finally:
        comm.Free()


# -- 12: bad arguments ---------------------------------------------------------------


@pytest.mark.parametrize("timeout", [-1, 0, float("nan")])
def test_bad_timeouts_refused_before_any_collective(comm: MPI.Intracomm, timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout"):
        cgc.collect(comm, timeout=timeout)
    with pytest.raises(ValueError, match="generation"):
        cgc.collect(comm, generation=3)
    with pytest.raises(TypeError, match="timeout"):
        cgc.collect(comm, timeout="1")  # type: ignore[arg-type]
    # The manager is untouched and usable on every rank.
    log = CheckedLog(comm)
    o = Obj()
    cgc.register(o, log.destroy, 1, comm=comm)
    del o
    assert cgc.collect(comm, timeout=60).destroyed == 1 and log.keys == [1]


# -- 17: the C and Python batch passes skip the same registrations --------------------


# The Python passes always; the C ones where the optional extension is built
# (test_the_c_sync_passes_are_built_here fails where it is not).
_C = _registration.SPEEDUPS
_TAKES = [_registration.take_batch_py] + ([_C.take_batch] if _C else [])
_RUNS = [_destroy.run_each_py] + ([_C.run_each] if _C else [])


def test_batch_passes_agree_on_a_registration_without_a_destroy() -> None:
    results = []
    for take in _TAKES:
        inbox: list[object] = []
        objs = [Obj() for _ in range(3)]
        regs = [
            _registration.make_registration(o, None, inbox.append, i, noop, (i,), {}, None)  # type: ignore[arg-type]
            for i, o in enumerate(objs)
        ]
        # As left by a destroy that ran meanwhile:
        assert _registration.Ledger().claim(regs[1], _registration.DESTROYED) is not None
        table = {r.key: r for r in regs}
        taken, fns, argss, segments = take(table, [2, 1, 0], _registration.DESTROYED, ())
        results.append(([r.key for r in taken], argss, sorted(table), segments))
    assert all(r == ([2, 0], [(2,), (0,)], [1], [(0, 2, -1)]) for r in results), results


def test_run_each_tries_every_call_in_both_versions() -> None:
    for run in _RUNS:
        calls: list[int] = []

        def f(i: int, calls: list[int] = calls) -> None:
            calls.append(i)
            if i % 2:
                raise (KeyboardInterrupt if i == 1 else ValueError)(i)

        errors = run([f] * 5, [(i,) for i in range(5)])
        assert calls == list(range(5))
        assert [(i, type(e)) for i, e in errors] == [(1, KeyboardInterrupt), (3, ValueError)]


# -- 19: view writes to the stdout of the moment --------------------------------------


def test_view_writes_to_the_current_stdout(comm: MPI.Intracomm) -> None:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        text = cgc.view(comm)
    if comm.Get_rank() == 0:
        assert buf.getvalue() == text and "queued on a communicator" in text
    else:
        assert buf.getvalue() == ""


# -- the keys still agree after all of the above --------------------------------------


def test_keys_agree_after_hostile_tests(comm: MPI.Intracomm) -> None:
    regs = [cgc.register(Obj(), noop, comm=comm) for _ in range(3)]
    assert same_on_all(comm, [r.key for r in regs])
    assert np.all(np.diff([r.key for r in regs]) == 1)
    cgc.collect(comm)
