"""Asynchronous exceptions (signal handlers that raise) during sync points and every other
collective region: the agreement's wait, destroys, finishes, strict mode's report, ``view``,
the first registration, ``close``, exit.

Issue 25: an interrupt storm (a ``signal.setitimer`` handler raising every
50-400 us) during loops of sync points. Whatever lands where, nothing queued
is lost, nothing runs twice, and on more than one rank every rank leaves each
sync point through the same collectives (the exception is raised afterwards on
its own rank). See ``collective_gc/_interrupts.py``.

Verdicts that could differ between ranks are gathered before they are
asserted, and every collective that may fail has a deadline of a few seconds,
so that a failing test aborts the job instead of hanging it. The exit tests
start their own 4-rank jobs (marker ``launcher``).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import random
import re
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import collective_gc as cgc
import collective_gc.testing as cgc_testing
from collective_gc import _destroy, _interrupts, _scope, _state, _transport

from _util import (
    FINISHED,
    JOB_HEAD,
    TIMEOUT,
    WORLD,
    Asked,
    CheckedLog,
    Finisher,
    GcDisabled,
    Obj,
    Recorder,
    attempt,
    everyone,
    job_report,
    noop,
    outcome_of,
    run_job,
    sync_with,
)


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_leaves_by_an_exception_wakes_the_others(comm: MPI.Intracomm) -> None:
    """Rank 1 leaves a sync point's wait by a second Ctrl-C (the first is held
    until the region's end, the second runs at once) while the others are
    still on their way. They must hear of it at once, naming rank 1, instead
    of waiting for it at their next collective (before: for ever, or until
    their own timeout, 20 s here)."""
    rank = comm.Get_rank()
    cgc.collect(comm, generation=None)  # the private duplicate exists everywhere
    comm.Barrier()
    # The number of the sync point rank 1 leaves: the family's next. (Not
    # always 1: a duplicate congruent with a live member of an earlier
    # test's family, one an earlier test could not free, joins that family.)
    fam = cgc_testing.family(comm)
    assert fam is not None
    left_at = fam.seq
    outcome, message, took = "OK", "", 0.0
    if rank == 1:
        timers = [threading.Timer(t, os.kill, (os.getpid(), signal.SIGINT)) for t in (0.3, 0.6)]
        for t in timers:
            t.start()
        try:
            cgc.collect(comm, generation=None, timeout=30)
        except KeyboardInterrupt:
            outcome = "INTERRUPTED"
        finally:
            for t in timers:
                t.join()
    else:
        time.sleep(1.5)
        t0 = time.monotonic()
        try:
            for _ in range(2):  # this one may complete: rank 1 had sent its part
                cgc.collect(comm, generation=None, timeout=20)
        except cgc.CollectiveTimeoutError as exc:
            outcome, message = "TIMEOUT", str(exc)
        took = time.monotonic() - t0
    states = everyone(comm, (outcome, took, message, cgc.manager(comm).broken is not None))
    assert states[1][0] == "INTERRUPTED" and states[1][3], states[1]
    for r, (got, took, text, broken) in enumerate(states):
        if r != 1:
            assert got == "TIMEOUT" and broken, (r, got, text)
            assert took < 5.0, f"rank {r} waited {took:.1f} s for the rank that left"
            assert re.search(
                rf"rank 1 left the collectives by an exception at sync point {left_at}\b", text
            ), (
                r,
                text,
            )


class Storm:
    """The state of a :func:`storm`: ``calls`` counts its handler's calls,
    ``raised`` the exceptions it raised, and it raises only while ``budget``
    is positive (one less each time). The test sets the budget just before the
    call it aims at and zeroes it just after (and first thing in its except
    clause), so that nothing lands in the test's own loop."""

    def __init__(self) -> None:
        self.calls = 0
        self.raised = 0
        self.budget = 0
        self.on = True  # cleared first at the end: a late handler must not re-arm


@contextmanager
def storm(
    exc: Callable[[], BaseException], lo: float = 50e-6, hi: float = 400e-6, seed: int = 0
) -> Iterator[Storm]:
    """While inside: SIGALRM every ``lo``..``hi`` seconds (random), its handler
    raising ``exc()`` while the budget lasts."""
    rng = random.Random(seed)
    state = Storm()

    def handler(signum: int, frame: Any) -> None:
        state.calls += 1
        if state.on:
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(lo, hi))
        if state.budget > 0:
            state.budget -= 1
            state.raised += 1
            raise exc()

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, rng.uniform(lo, hi))
    try:
        yield state
    finally:
        state.on = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_an_interrupt_storm_on_comm_self_loses_no_destroy() -> None:
    """Issue 25, defect 2: an interrupt storm during a loop of
    ``collect(COMM_SELF)``, 400 objects dying per step: some destroys never ran
    and nothing reported them (lost at ``Registry.drain`` after ``del
    inbox[:n]``, and in ``_destroy.run`` after ``take_batch``), and an
    interrupt right after a run of destroys was a spurious DestroyError."""
    comm = MPI.COMM_SELF
    ran: list[int] = []
    registered = 0
    other: list[str] = []
    hits = 0
    # At least 300 steps, and more (up to 5,000) until the storm has reached
    # the sync points 100 times: how often it does depends on the machine.
    for step in range(5000):
        if step >= 300 and hits > 100:
            break
        # Registration is outside the storm: the count of what was registered
        # must be exact.
        objs = [Obj() for _ in range(400)]
        for i, o in enumerate(objs):
            cgc.register(o, ran.append, registered + i, comm=comm)  # a C destroy: no bytecode
        registered += len(objs)
        del objs, o
        with storm(KeyboardInterrupt, seed=step) as st:
            for _ in range(3):
                try:
                    st.budget = 3
                    cgc.collect(comm, generation=None)
                    st.budget = 0
                except KeyboardInterrupt:
                    st.budget = 0
                except Exception as exc:  # noqa: BLE001 (what the test looks for)
                    st.budget = 0
                    other.append(f"{type(exc).__name__}: {exc}"[:300])
        hits += st.raised
    cgc.collect(comm, generation=None)
    assert hits > 100, hits  # the storm did reach the sync points
    assert not other, other[:3]
    assert not cgc.pending(comm)
    assert len(ran) == len(set(ran)), "a destroy ran twice"
    assert sorted(ran) == list(range(registered)), (
        f"{registered - len(set(ran))} of {registered} destroys never ran"
    )


def _storm_on_one_rank(
    comm: MPI.Intracomm, exc: Callable[[], BaseException], timeout: float | None, steps: int
) -> None:
    """Every rank registers 400 objects per step and drops them, then runs one
    ``collect(comm)``; rank 1 does so under a storm raising ``exc()``. Every
    rank must run every sync point (none left unusable), and every destroy must
    run once on every rank."""
    rank = comm.Get_rank()
    mgr = cgc.manager(comm)
    ran: list[int] = []
    raised = 0
    other: list[str] = []
    registered = 0
    for step in range(steps):
        objs = [Obj() for _ in range(400)]
        for i, o in enumerate(objs):
            cgc.register(o, ran.append, registered + i, comm=comm)
        registered += len(objs)
        del objs, o
        # An exception that lands before the sync point began (in collect's
        # own steps) leaves it not run on this rank: retried, as a program
        # that catches interrupts would (sync_count says whether it ran).
        target = mgr.sync_count + 1
        with storm(exc, seed=step) if rank == 1 else _calm() as st:
            while mgr.sync_count < target and not other:
                try:
                    st.budget = 3
                    cgc.collect(comm, generation=None, timeout=timeout)
                    st.budget = 0
                except (KeyboardInterrupt, TimeoutError):
                    st.budget = 0
                except Exception as err:  # noqa: BLE001 (what the test looks for)
                    st.budget = 0
                    other.append(f"{type(err).__name__}: {err}"[:300])
        raised += st.raised
        if other:
            break  # this rank's manager is unusable: the others would wait
    # At once, on this rank alone: the others may be waiting in a sync point
    # this rank will not reach (a failed assertion aborts the job).
    assert not other, other[:2]
    everyone = comm.allgather(raised)
    assert everyone[1] > 5, everyone  # the storm reached rank 1's sync points
    while cgc.pending(comm) or comm.allreduce(len(cgc.pending(comm))):
        cgc.collect(comm, generation=None, timeout=timeout)
    counts = comm.allgather((len(ran), len(set(ran)), sorted(ran) == list(range(registered))))
    assert all(c == (registered, registered, True) for c in counts), (registered, counts)


@contextmanager
def _calm() -> Iterator[Storm]:
    yield Storm()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("timeout", [None, 30.0])
def test_a_keyboard_interrupt_storm_on_one_rank_leaves_every_rank_in_step(
    comm: MPI.Intracomm, timeout: float | None
) -> None:
    """Issue 25, defect 1: one rank under a KeyboardInterrupt storm in a loop of
    ``collect(comm)``: an interrupt landing between starting the agreement's
    allreduce and waiting on it left that rank's manager unusable while the
    others went on (and then waited for ever at the next sync point)."""
    _storm_on_one_rank(comm, KeyboardInterrupt, timeout, 60)


@pytest.mark.mpi(min_size=2)
def test_a_watchdog_raising_timeouterror_on_one_rank_leaves_every_rank_in_step(
    comm: MPI.Intracomm,
) -> None:
    """Issue 25, defect 1: the same with a handler that raises an ordinary
    exception (TimeoutError, as a per-step ``signal.alarm`` watchdog would):
    inside ``wait()`` an Exception was not held at all."""
    _storm_on_one_rank(comm, lambda: TimeoutError("step watchdog"), 30.0, 60)


def test_handlers_are_wrapped_and_keep_working_and_a_second_ctrl_c_is_at_once() -> None:
    """What a program sees (issue 25): after a region, its SIGINT handler is
    wrapped (``__wrapped__`` is it) and still runs outside regions; inside one
    it runs at the region's end, with the frame the signal arrived in; a second
    SIGINT inside the same region runs at once."""
    calls: list[str] = []

    def mine(signum: int, frame: Any) -> None:
        calls.append("frame" if frame is not None else "none")
        raise KeyboardInterrupt("mine")

    previous = signal.signal(signal.SIGINT, mine)
    try:
        entered = _interrupts.enter()
        _interrupts.leave(entered)
        wrapper = signal.getsignal(signal.SIGINT)
        assert isinstance(wrapper, _interrupts.Deferring) and wrapper.__wrapped__ is mine
        with pytest.raises(KeyboardInterrupt, match="mine"):
            signal.raise_signal(signal.SIGINT)  # outside a region: at once
        entered = _interrupts.enter()
        try:
            signal.raise_signal(signal.SIGINT)  # deferred
            assert _interrupts.deferred() == 1 and calls == ["frame"]
            with pytest.raises(KeyboardInterrupt, match="mine"):
                signal.raise_signal(signal.SIGINT)  # the second: at once
            assert calls == ["frame", "frame"]
        finally:
            with pytest.raises(KeyboardInterrupt, match="mine") as info:
                _interrupts.leave(entered)
        assert calls == ["frame"] * 3
        assert any("handler ran once" in n for n in info.value.__notes__)
        assert _interrupts.deferred() == 0
    finally:
        signal.signal(signal.SIGINT, previous)


def test_keyboard_interrupt_in_a_destroy_lets_the_others_run() -> None:
    # Serial: an interrupt on one rank of a parallel job ends the job anyway.
    comm = MPI.COMM_SELF.Dup()
    log: list[str] = []

    def destroy(tag: str) -> None:
        log.append(tag)
        if tag == "b":
            raise KeyboardInterrupt

    try:
        with GcDisabled():
            objs = [Obj() for _ in range(3)]
            regs = [cgc.register(o, destroy, t, comm=comm) for o, t in zip(objs, "abc")]
            del objs
            with pytest.raises(KeyboardInterrupt):
                cgc.collect(comm, generation=None)
        assert log == ["c", "b", "a"]  # every agreed destroy ran, newest first
        assert all(r.state == "destroyed" for r in regs)
        # The next agreement reports it, as any failed destroy.
        with pytest.raises(cgc.DestroyError, match="KeyboardInterrupt"):
            cgc.collect(comm)
        assert cgc.collect(comm).destroyed == 0 and log == ["c", "b", "a"]
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("timeout", [8.0, None])
def test_an_interrupt_in_the_agreement_wait_leaves_every_rank_alike(
    comm: MPI.Intracomm, timeout: float | None
) -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    # ``timeout`` is rank 0's (None: the in-place Wait path, where the signal's
    # handler runs as soon as Wait returns); the others always have one, or this
    # test would hang them: with none they wait for ever in the error check.
    rank = comm.Get_rank()
    log: list[int] = []
    o = Obj()
    reg = cgc.register(o, log.append, 1, comm=comm)
    cgc.collect(comm, generation=None, timeout=30)
    del o
    mgr = cgc.manager(comm)

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    if rank == 0:
        previous = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            seen = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=timeout))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    else:
        time.sleep(1.5)  # rank 0 is waiting (or polling) for us meanwhile
        seen = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=8.0))
    state = (seen, mgr.broken, log)
    states = everyone(comm, state)
    if mgr.broken is not None and reg.alive:
        reg.detach()  # nothing left here for the exit agreement
    # The interrupt is held until the sync point's collectives are done, then
    # raised on rank 0 only: every rank ran the same destroys (a collective
    # destroy run on some ranks only hangs them), and the manager is usable
    # everywhere, so the next sync point is in step.
    assert [s[0] for s in states] == ["KeyboardInterrupt"] + ["ok"] * (len(states) - 1), states
    assert all(s[1] is None and s[2] == [1] for s in states), states
    assert cgc.collect(comm, generation=None, timeout=30).sync == mgr.sync_count - 1


def _interrupted_then_failed(
    comm: MPI.Intracomm, sync: Any, late_sync: Any
) -> tuple[str, str, bool]:
    """Rank 0 runs ``sync`` and gets a KeyboardInterrupt 0.3 s into its wait;
    the other ranks arrive 1.5 s later and run ``late_sync``. What each rank
    raised, what that had as its context, and whether the manager is broken."""
    rank = comm.Get_rank()
    o = Obj()
    reg = cgc.register(o, noop, comm=comm)
    cgc.collect(comm, generation=None, timeout=30)
    mgr = cgc.manager(comm)

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    raised: BaseException | None = None
    if rank == 0:
        previous = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            sync()
        except BaseException as exc:  # noqa: BLE001 (KeyboardInterrupt included: it is the point)
            raised = exc
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    else:
        time.sleep(1.5)  # rank 0 is waiting (or polling) for us meanwhile
        try:
            late_sync()
        except BaseException as exc:  # noqa: BLE001
            raised = exc
    if mgr.broken is not None and reg.alive:
        reg.detach()  # nothing left here for the exit agreement
    del o
    context = None if raised is None else raised.__context__
    return type(raised).__name__, type(context).__name__, mgr.broken is not None


# Communicators with a request rank 0 let go of while it was active: never
# freed here (MPI may still complete it).
_POSTED_ON: list[MPI.Intracomm] = []


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("post", ["Iallreduce", "Ibcast"])
def test_an_interrupt_just_after_a_collective_is_posted_keeps_its_buffers(
    comm: MPI.Intracomm, post: str
) -> None:
    """An interrupt can land at the first bytecode after MPI posted a
    non-blocking collective, before the caller holds the request: a second
    Ctrl-C inside a protected region, any signal outside one (the pytest
    plugin's checks). MPI reads and writes the buffers once the other ranks
    arrive, so they must outlive the interrupt. A profile hook stands in
    for the signal's handler: on rank 0 it raises KeyboardInterrupt as the
    post returns, the worst moment (the request is dropped with the call's
    result), where the interpreter reports returns from the extension's
    methods (mpi4py 3's; mpi4py 4's, Cython functions, are not reported),
    else as the wait that takes the request is entered. The others' results
    show that rank 0's buffer was read. From a review of
    collective_gc._transport (stop 55): the request and its buffers were
    kept only once a wait held them."""
    lib = comm.Dup()
    _POSTED_ON.append(lib)
    rank, size = comm.Get_rank(), comm.Get_size()
    if post == "Iallreduce":
        buf = np.full(8, float(rank + 1))
        expected = size * (size + 1) / 2
    else:
        buf = np.full(8, 7.0 if rank == 0 else 0.0)
        expected = 7.0
    ref = weakref.ref(buf)

    def hook(frame: Any, event: str, arg: Any) -> None:
        returned = event == "c_return" and getattr(arg, "__name__", "") == post
        entered = (
            event == "call"
            and frame.f_code.co_name == "_wait"
            and frame.f_code.co_filename == _transport.__file__
        )
        if returned or entered:
            sys.setprofile(None)
            raise KeyboardInterrupt

    result = None
    raised = False
    if rank == 0:
        sys.setprofile(hook)
    try:
        if post == "Iallreduce":
            result = _transport.allreduce(lib, buf, MPI.SUM, None, str)
        else:
            _transport.bcast(lib, buf, 0, None, str)
            result = buf
    except KeyboardInterrupt:
        raised = True
    finally:
        sys.setprofile(None)
    values = None if result is None else sorted(set(result.tolist()))
    del buf, result
    verdicts = everyone(comm, (raised, ref() is not None, values))
    assert verdicts[0][:2] == (True, True), verdicts  # interrupted, its buffer kept
    assert all(v == (False, False, [expected]) for v in verdicts[1:]), verdicts


@pytest.mark.mpi(min_size=2)
def test_an_interrupt_as_an_agreement_is_abandoned_leaves_its_request_to_the_prune(
    comm: MPI.Intracomm,
) -> None:
    """A family's state abandons an agreement that timed out in two stores:
    its persistent request given to the transport's keep (MPI may still
    complete it, and write the buffer), then its own field cleared. An
    interrupt between the two (a second Ctrl-C) left the field set, and
    letting go of the family freed the request while it was still active:
    erroneous, and the keep then dropped the buffer MPI writes once the
    late rank arrives. A profile hook raises KeyboardInterrupt there on rank
    0, the Python twin's (the C twin abandons in one C call, under the GIL);
    rank 1 arrives once rank 0 has let go. The request must outlive the let
    go and be freed by the prune that finds it complete. From stop 55's
    review of the interrupt windows (the persistent request's double owner)."""
    from collective_gc._registration import GC, Registration
    from collective_gc._syncpoint import CollectStats

    lib = comm.Dup()
    _POSTED_ON.append(lib)
    rank, size = comm.Get_rank(), comm.Get_size()
    state = _state.PythonFamilyState(rank, size, GC, Registration, CollectStats)
    state.open(lib, True)
    taken: list[MPI.Request] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        if (
            event == "return"
            and frame.f_code is _transport.keep_alive.__code__
            and frame.f_back is not None
            and frame.f_back.f_code.co_name == "_abandon"
        ):
            sys.setprofile(None)
            taken.append(frame.f_locals["req"])
            raise KeyboardInterrupt

    outcome = None
    if rank == 0:
        profiler = sys.getprofile()
        sys.setprofile(hook)
        try:
            state.exchange(False, 0, 0, 0, time.monotonic() + 0.3)
        except KeyboardInterrupt:
            outcome = "interrupted"
        finally:
            sys.setprofile(profiler)
        persistent = state.persistent  # (set back to None where MPI has none after all)
        state.close(True)  # the family lets go of everything it has
        alive = bool(taken) and taken[0] != MPI.REQUEST_NULL
    comm.Barrier()
    if rank != 0:
        # The same collective on the other ranks (persistent ones match
        # persistent ones only): rank 0's request completes now. Its notice
        # may end this wait first; the request completes all the same.
        state.exchange(False, 0, 0, 0, None)
        state.close(True)
    persistent = comm.bcast(persistent if rank == 0 else None, root=0)
    if not persistent:
        pytest.skip("this MPI or mpi4py offers no persistent allreduce")
    if rank == 0:
        assert outcome == "interrupted" and taken and alive, (outcome, taken)
        req = taken.pop()
        give_up = time.monotonic() + 60
        while not _transport.test_kept(req):
            assert time.monotonic() < give_up, "the abandoned allreduce never completed"
            time.sleep(0.001)
        _transport.keep_alive(MPI.REQUEST_NULL)  # (adds nothing; prunes)
        assert req == MPI.REQUEST_NULL  # freed by the prune, once
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_an_interrupt_held_in_a_wait_that_then_times_out_is_raised_not_lost(
    comm: MPI.Intracomm,
) -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    # Rank 0's wait holds the interrupt, then its deadline passes: the
    # interrupt (what the user asked for) is raised, the timeout its context;
    # the late ranks see the timeout. Every manager is unusable.
    states = everyone(
        comm,
        _interrupted_then_failed(
            comm,
            lambda: cgc.collect(comm, generation=None, timeout=0.8),
            lambda: cgc.collect(comm, generation=None, timeout=8.0),
        ),
    )
    assert states == [("KeyboardInterrupt", "CollectiveTimeoutError", True)] + [
        ("CollectiveTimeoutError", "NoneType", True)
    ] * (len(states) - 1), states


_DESTROY_INTERRUPT_JOB = (
    JOB_HEAD
    + """
import time


def interrupt_on(r, me):
    if r == me:
        raise KeyboardInterrupt(f"a destroy on rank {me}")


comm = MPI.COMM_WORLD.Dup()
cgc.collect(comm, generation=None, timeout=30)
a, b = Obj(), Obj()
cgc.register(a, interrupt_on, 0, rank, comm=comm)
cgc.register(b, time.sleep, 2.5 if rank == 1 else 0.0, comm=comm)
del a, b
raised = ("nothing", "nothing")
try:
    cgc.manager(comm).sync(deadline=time.monotonic() + (1.0 if rank == 0 else 30.0), final=True)
except BaseException as exc:
    raised = (type(exc).__name__, type(exc.__context__).__name__)
time.sleep(2.0)  # the late rank has been told
print(raised, flush=True)
"""
)


@pytest.mark.launcher
def test_a_destroys_interrupt_is_raised_when_the_final_check_then_times_out(
    tmp_path: Path,
) -> None:
    """A destroy raises KeyboardInterrupt on rank 0; another destroy makes
    rank 1 late past rank 0's deadline, so the final sync point's check
    times out on rank 0. Rank 0 must raise the interrupt, the timeout its
    context. From a review of this stop's change: interrupts among the sync
    point's failures (a destroy's) were dropped with them when a later
    collective of it failed. A job of its own: the late rank's notices, sent
    once the others had left, stay unreceived on the family's duplicate, and
    MPICH, reusing a freed one's context, delivered one to the next test's
    communicator (py313-mpich stack, stop 59)."""
    proc, outs, errs, _ = run_job(tmp_path, _DESTROY_INTERRUPT_JOB)
    report = job_report(proc, outs, errs)
    assert outs[0].strip() == "('KeyboardInterrupt', 'CollectiveTimeoutError')", report


@pytest.mark.mpi(min_size=2)
def test_an_interrupt_held_in_a_wait_that_then_finds_a_mismatch_is_raised_not_lost(
    comm: MPI.Intracomm,
) -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    # Rank 0 is at the exit agreement, the others at a sync point: every rank
    # raises CollectiveMismatchError, except that rank 0's held interrupt is
    # raised instead, with the mismatch as its context.
    mgr = cgc.manager(comm)
    states = everyone(
        comm,
        _interrupted_then_failed(
            comm,
            lambda: mgr.sync(at_exit=True, deadline=time.monotonic() + 30),
            lambda: cgc.collect(comm, generation=None, timeout=30),
        ),
    )
    assert states == [("KeyboardInterrupt", "CollectiveMismatchError", True)] + [
        ("CollectiveMismatchError", "NoneType", True)
    ] * (len(states) - 1), states


@pytest.mark.mpi(min_size=2)
def test_an_interrupt_held_in_a_wait_that_then_finds_a_bad_vote_is_raised_not_lost(
    comm: MPI.Intracomm,
) -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    # Every rank refuses the out-of-range vote and keeps its manager; rank 0
    # raises its held interrupt instead, with the refusal as its context.
    mgr = cgc.manager(comm)

    def sync() -> None:
        mgr.add_participant(Recorder(5, 256))  # on every rank alike, before its sync point
        cgc.collect(comm, generation=None, timeout=30)

    states = everyone(comm, _interrupted_then_failed(comm, sync, sync))
    # Its participant votes out of range for good: nothing is left for the
    # exit agreement, which it would refuse too.
    for reg in mgr.alive() + mgr.pending():
        reg.detach()
    mgr.mark_unusable("the end of this test: a participant votes out of range")
    assert states == [("KeyboardInterrupt", "CollectiveGCError", False)] + [
        ("CollectiveGCError", "NoneType", False)
    ] * (len(states) - 1), states


@pytest.mark.mpi(min_size=2)
def test_an_interrupt_in_a_finish_is_its_rank_s_and_a_destroy_error_elsewhere(
    comm: MPI.Intracomm,
) -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    rank = comm.Get_rank()
    mgr = cgc.manager(comm)
    o = Obj()
    cgc.register(o, noop, comm=comm)
    del o
    first = Finisher("first", 1, KeyboardInterrupt(), True)
    second = Finisher("second", -1, None, False)
    text = ""
    try:
        # With a destroy to run, so the error check comes before the finishes.
        sync_with(mgr, first, second)
    except BaseException as exc:  # noqa: BLE001 (the interrupt is the point)
        text = f"{type(exc).__name__}: {exc} {getattr(exc, '__notes__', '')}"
    seen = "ok" if mgr.destroyed == 1 else f"destroyed {mgr.destroyed}"
    verdict = everyone(comm, (seen, text.split(":")[0], list(FINISHED), mgr.broken))
    # Every participant finished on every rank, the sync point's collectives
    # were all made, rank 1 got its interrupt back and the others a
    # DestroyError naming it; the manager stays usable everywhere.
    assert all(v[0] == "ok" and v[2] == ["first", "second"] and v[3] is None for v in verdict), (
        verdict
    )
    assert [v[1] for v in verdict] == [
        "KeyboardInterrupt" if r == 1 else "DestroyError" for r in range(len(verdict))
    ], verdict
    if rank != 1:
        assert "the finish of Finisher" in text and "KeyboardInterrupt" in text, text
    assert cgc.collect(comm, generation=None, timeout=30).sync == mgr.sync_count - 1


@pytest.mark.mpi(min_size=2)
def test_a_may_raise_raising_keyboardinterrupt_is_its_rank_s_and_a_destroy_error_elsewhere(
    comm: MPI.Intracomm,
) -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    # Issue 25: a signal's KeyboardInterrupt can no longer land in may_raise
    # (the sync point is a protected region, see test_interrupts.py), so one
    # that may_raise raises is its own code's: a yes and a failure, as from a
    # finish (it was held and the question asked again).
    mgr = cgc.manager(comm)
    asked = Asked(1, KeyboardInterrupt())
    seen = outcome_of(lambda: sync_with(mgr, asked))
    verdict = everyone(comm, (seen, asked.asked, list(FINISHED), mgr.broken))
    assert [v[0] for v in verdict] == [
        "KeyboardInterrupt" if r == 1 else "DestroyError" for r in range(len(verdict))
    ], verdict
    assert all(v[1] == 1 and v[2] == ["asked"] and v[3] is None for v in verdict), verdict
    assert cgc.collect(comm, generation=None, timeout=30).sync == mgr.sync_count - 1


LATE = 1.0  # how late rank 1 arrives


ALARM = 0.3  # how far into its wait rank 0 is interrupted


def interrupted_on_rank_0(
    comm: MPI.Intracomm, fn: Callable[[], Any], *, late: bool = True
) -> tuple[str, Any, list[str]]:
    """Every rank runs ``fn``, rank 1 ``LATE`` seconds after the others if
    ``late``; rank 0 gets a KeyboardInterrupt (SIGALRM) ``ALARM`` seconds into
    its call. What ``fn`` raised or returned (see :func:`attempt`), and on
    rank 0 the functions the interrupt landed in (``fn``'s calls, innermost
    first)."""
    rank = comm.Get_rank()
    if rank == 1 and late:
        time.sleep(LATE)
    if rank != 0:
        return (*attempt(fn), [])
    where: list[str] = []

    def interrupt(signum: int, frame: Any) -> None:
        while frame is not None and frame.f_code is not attempt.__code__:  # inside fn
            where.append(frame.f_code.co_name)
            frame = frame.f_back
        raise KeyboardInterrupt("SIGALRM")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, ALARM)
    try:
        return (*attempt(fn), where)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def barrier(comm: MPI.Intracomm) -> None:
    """A barrier on the test's communicator that gives up after ``TIMEOUT``."""
    req = comm.Ibarrier()
    deadline = time.monotonic() + TIMEOUT
    while not req.Test():
        if time.monotonic() > deadline:
            raise TimeoutError("a rank did not reach the test's barrier")
        time.sleep(1e-3)


def collect_ok(comm: MPI.Intracomm) -> tuple[str, Any]:
    """A sync point with a deadline: ("ok", destroyed) or what it raised."""
    seen, stats = attempt(lambda: cgc.collect(comm, generation=None, timeout=TIMEOUT))
    return seen, None if stats is None else stats.destroyed


def _strict_sync(comm: MPI.Intracomm, late: bool) -> tuple[str, str, list[str]]:
    """In a strict scope, a managed object dies in a cycle on every rank; then
    a sync point, rank 0 interrupted in it. What that sync point raised, what
    the scope's exit sync point raised, and where rank 0 was interrupted."""
    seen: list[tuple[str, Any, list[str]]] = []

    def body() -> None:
        with cgc.collective_scope(
            comm, strict=True, gc="off", exit_collect=None, timeout=TIMEOUT
        ) as scope:
            o = Obj()
            o.peer = o
            cgc.register(o, noop, comm=comm, name="cyclic")
            del o
            gc.collect()
            barrier(comm)  # every rank has its cyclic death queued
            seen.append(interrupted_on_rank_0(comm, scope.sync, late=late))

    left = attempt(body)[0]
    (sync, _, where), *_ = seen or [("not reached", None, [])]
    return sync, left, where


def _assert_strict_outcome(comm: MPI.Intracomm, late: bool, inside: str, outside: str) -> None:
    """Run :func:`_strict_sync`; rank 0 raises its interrupt, every other rank
    the report, every manager stays usable; rank 0 was interrupted in
    ``inside``, not in ``outside``."""
    sync, left, where = _strict_sync(comm, late=late)
    broken = cgc.manager(comm).broken
    after = collect_ok(comm)
    states = everyone(comm, (sync, left, broken, after))
    wheres = everyone(comm, where)
    assert inside in wheres[0] and outside not in wheres[0], (wheres[0], states)
    assert states == [("KeyboardInterrupt", "ok", None, ("ok", 0))] + [
        ("CyclicFinalizationError", "ok", None, ("ok", 0))
    ] * (comm.Get_size() - 1), states


@pytest.mark.mpi(min_size=2)
def test_strict_sync_interrupted_while_waiting_still_reports_on_every_rank(
    comm: MPI.Intracomm,
) -> None:
    """Found by a hostile review of the promise (reproducer h13)."""
    # h13: rank 0's interrupt is held through the sync point's agreement, which
    # then sees the cyclic death: rank 0 must still take part in the strict
    # report's gather (the others wait in it), then raise the interrupt.
    # Interrupted in the agreement, not in the gather of the report (see below).
    _assert_strict_outcome(comm, late=True, inside="agree", outside="allgather")


@pytest.mark.mpi(min_size=2)
def test_strict_report_interrupted_while_waiting_holds_the_interrupt(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a hostile review of the promise (reproducer h2)."""
    # h2: the sync point completes at once; rank 1 is slow formatting its rows
    # of the strict report, and rank 0 is interrupted while it waits for them
    # in the report's gather (Manager.allgather): held until the gather is
    # done, then raised on rank 0; the others raise the report.
    if comm.Get_rank() == 1:
        real = _scope._origin

        def slow(origin: Any) -> str:
            time.sleep(LATE)
            return real(origin)

        monkeypatch.setattr(_scope, "_origin", slow)
    # Interrupted in the gather of the report, not in the agreement (see above).
    _assert_strict_outcome(comm, late=False, inside="allgather", outside="agree")


@pytest.mark.mpi(min_size=2)
def test_view_interrupted_while_waiting_holds_the_interrupt(comm: MPI.Intracomm) -> None:
    """Found by a hostile review of the promise (reproducer h11)."""
    cgc.collect(comm, generation=None, timeout=TIMEOUT)  # the private duplicate exists
    mgr = cgc.manager(comm)
    seen, text, where = interrupted_on_rank_0(
        comm, lambda: cgc.view(comm, file=None, timeout=TIMEOUT)
    )
    broken = mgr.broken
    after = collect_ok(comm)
    states = everyone(comm, (seen, isinstance(text, str), broken, after))
    wheres = everyone(comm, where)
    assert "view" in wheres[0] and "allgather" in wheres[0], (wheres[0], states)
    # The gather completes on every rank; rank 0 raises its interrupt after it.
    n = comm.Get_size()
    assert states == [("KeyboardInterrupt", False, None, ("ok", 0))] + [
        ("ok", True, None, ("ok", 0))
    ] * (n - 1), states


@pytest.mark.mpi(min_size=2)
def test_a_failure_whose_str_raises_an_interrupt_hangs_no_rank(comm: MPI.Intracomm) -> None:
    """Found by a hostile review of the promise (reproducer h12)."""
    rank = comm.Get_rank()

    class Weird(RuntimeError):
        def __str__(self) -> str:
            raise KeyboardInterrupt("from __str__")

    def destroy() -> None:
        if rank == 1:
            raise Weird()

    o = Obj()
    cgc.register(o, destroy, comm=comm, name="weird")
    del o
    first, _ = attempt(lambda: cgc.collect(comm, generation=None, timeout=10))
    seen, _ = attempt(lambda: cgc.collect(comm, generation=None, timeout=10))
    states = everyone(comm, (first, seen))
    # The error report (at the next agreement) still reaches every rank: rank
    # 1 raises the interrupt its str() raised, the others the DestroyError
    # (not a timeout).
    assert states == [("ok", "DestroyError"), ("ok", "KeyboardInterrupt")] + [
        ("ok", "DestroyError")
    ] * (comm.Get_size() - 2), states


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("in_scope", [False, True])
def test_a_first_registration_interrupted_while_waiting_completes_on_every_rank(
    comm: MPI.Intracomm, in_scope: bool
) -> None:
    """Found by a hostile review of the promise (reproducer h6)."""
    # The first registration on a fresh communicator makes its private
    # duplicate, waiting for a late rank 1; rank 0 is interrupted meanwhile:
    # the duplicate is still made and the object registered on every rank,
    # rank 0's register then raising the interrupt. Outside a scope the wait
    # has no deadline (MPI's Wait: the signal's handler runs once it
    # returns); in a scope with a timeout it polls against the scope's. (A
    # scope makes its own communicator's family as it is entered: there the
    # fresh communicator is another one, a library's, made in the scope.)
    held = [Obj()]
    ref = weakref.ref(held[0])
    target = comm.Split(0, key=comm.Get_size() - comm.Get_rank()) if in_scope else comm

    def first() -> cgc.Registration:
        return cgc.register(held[0], noop, comm=target, name="first")

    if in_scope:
        got: list[tuple[str, Any, list[str]]] = []

        def body() -> None:
            with cgc.collective_scope(comm, gc="auto", exit_collect=None, timeout=TIMEOUT):
                got.append(interrupted_on_rank_0(comm, first))

        left = attempt(body)[0]  # and the scope's exit sync point
        seen, reg, where = got[0] if got else ("not reached", None, [])
    else:
        left = "ok"
        seen, reg, where = interrupted_on_rank_0(comm, first)
    mgr = cgc.manager(target)
    snap = mgr.snapshot()
    state = (
        len(cgc.pending(target)),
        [(r.key, r.name, r() is held[0]) for r in snap.alive],
        snap.next_key,
        snap.broken,
    )
    returned = None if reg is None else (type(reg).__name__, reg.key)
    held.clear()  # dropped on every rank
    del reg, snap
    dead = ref() is None
    after = collect_ok(target)
    if in_scope:
        cgc.manager(target).close(timeout=TIMEOUT)
        target.Free()
    states = everyone(comm, (seen, left, returned, state, dead, after))
    wheres = everyone(comm, where)
    assert "dup" in wheres[0], (wheres[0], states)  # making the private duplicate
    registered = (0, [(0, "first", True)], 1, None)
    n = comm.Get_size()
    assert states == [("KeyboardInterrupt", "ok", None, registered, True, ("ok", 1))] + [
        ("ok", "ok", ("Registration", 0), registered, True, ("ok", 1))
    ] * (n - 1), states


@pytest.mark.mpi(min_size=2)
def test_close_interrupted_while_waiting_lets_go_on_every_rank(comm: MPI.Intracomm) -> None:
    """Found by a hostile review of the promise (reproducer h7)."""
    cgc.collect(comm, generation=None, timeout=TIMEOUT)  # the private duplicate exists
    mgr = cgc.manager(comm)
    seen, _, where = interrupted_on_rank_0(comm, lambda: mgr.close(timeout=TIMEOUT))
    broken = mgr.broken
    states = everyone(comm, (seen, broken is not None and "closed" in broken, broken))
    wheres = everyone(comm, where)
    assert "close" in wheres[0], (wheres[0], states)
    # close's last sync point completes everywhere, so every manager lets go;
    # rank 0 raises its interrupt after.
    assert [s[:2] for s in states] == [("KeyboardInterrupt", True)] + [("ok", True)] * (
        comm.Get_size() - 1
    ), states


_EXIT_INTERRUPT_JOB = (
    JOB_HEAD
    + """
comm = MPI.COMM_WORLD
sub = cgc.dup(comm)


def on_world():
    print(f"destroy W ran on rank {rank}", flush=True)


def on_sub():
    if rank == 0:
        raise KeyboardInterrupt("stop at exit")


w = Obj()
cgc.register(w, on_world, comm=comm, name="W")
s = Obj()
cgc.register(s, on_sub, comm=sub, name="S")
del w, s  # both queued on every rank: agreed at exit, the derived communicator first
print(f"script end on rank {rank}", flush=True)
"""
)


@pytest.mark.launcher
def test_at_exit_an_interrupt_in_a_derived_destroy_leaves_the_parent_agreed(
    tmp_path: Path,
) -> None:
    """Found by a hostile review of the promise (reproducer h4)."""
    # h4: rank 0's interrupt in S's destroy (on a cgc.dup communicator) during
    # the exit agreement is raised only after that agreement's collectives;
    # the parent's exit agreement still runs on every rank (W is destroyed
    # everywhere), and no rank waits for the exit timeout.
    proc, outs, errs, took = run_job(tmp_path, _EXIT_INTERRUPT_JOB, COLLECTIVE_GC_EXIT_TIMEOUT="20")
    report = job_report(proc, outs, errs)
    for rank in range(4):
        assert f"script end on rank {rank}" in outs[rank], report
        assert f"destroy W ran on rank {rank}" in outs[rank], report
    assert took < 10.0, f"the job took {took:.1f} s (exit timeout 20 s)\n{report}"
    assert "KeyboardInterrupt" in errs[0], report


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_interrupt_in_a_destroy_on_one_rank(
    comm: MPI.Intracomm, exc_type: type[BaseException]
) -> None:
    """Issue 11, defect 3."""
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
            cgc.collect(comm, generation=None)
        # The next agreement reports it on every rank, the last one included.
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
    """A trace function raising KeyboardInterrupt in the Python twin's loop
    over the runs of destroys (collective_gc._state._run_destroys) where the
    second run is about to begin, as a signal landing there would. (The C
    twin runs them in one C loop: no Python code runs between two runs, so
    nothing can land there.)"""

    def __init__(self) -> None:
        source, first = inspect.getsourcelines(_state._run_destroys)
        self.lines = {first + i for i, line in enumerate(source) if "= segments[pos]" in line}
        assert self.lines
        self.fired = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not _state._run_destroys.__code__:
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


# What an interrupt between two runs of destroys does: held and raised at the
# end in the Python twin; in C there is no "between" for it to land in.
_LANDED = ("KeyboardInterrupt, held", 1) if cgc_testing.speedups() == "python" else ("ok", 0)


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
    """Issue 11, defect 3."""
    # An interrupt (a signal) can land between two runs of destroys: the runs
    # not begun still run (on more than one rank, the others run them all),
    # and the interrupt is raised once the sync point is done.
    comm = MPI.COMM_SELF.Dup()
    with _interrupted_batches(comm) as log:
        assert _collect_interrupted(comm, True) == _LANDED
        assert log == ["k3", "k2", "k1", "k0"]
        assert cgc.pending(comm) == [] and cgc.manager(comm).registered == 0
        assert cgc.manager(comm).broken is None
        assert cgc.collect(comm, generation=None).destroyed == 0


@pytest.mark.mpi(min_size=2)
def test_interrupt_between_runs_on_one_rank_leaves_every_rank_in_step() -> None:
    """Issue 11, defect 3."""
    comm = WORLD.Dup()
    rank = comm.Get_rank()
    with _interrupted_batches(comm) as log:
        outcome = _collect_interrupted(comm, rank == 0)
        everyone = comm.allgather((outcome, log, cgc.manager(comm).registered))
        want = [
            (
                _LANDED if r == 0 else ("ok", 0),
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


# -- handlers installed inside a region -------------------------------------------


class Preempted(Exception):
    """What a library's SIGALRM-based preemption raises from its handler."""


@contextlib.contextmanager
def _alarm_restored() -> Iterator[None]:
    """The SIGALRM handler and timer as they were, whatever the test installed."""
    previous = signal.getsignal(signal.SIGALRM)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _preempt(signum: int, frame: Any) -> None:
    raise Preempted("time slice over")


def test_a_handler_installed_inside_a_region_is_deferred_to_its_end() -> None:
    """Issue 32, defect 4: a handler installed while the main thread is inside
    a protected region (by a destroy, a finalizer, a participant) is deferred
    like the handlers that were there at its entry, not run inside."""
    with _alarm_restored():
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        entered = _interrupts.enter()
        try:
            signal.signal(signal.SIGALRM, _preempt)
            installed = signal.getsignal(signal.SIGALRM)
            signal.raise_signal(signal.SIGALRM)  # inside: noted, not run
            held = _interrupts.deferred()
        finally:
            with pytest.raises(Preempted, match="time slice over") as info:
                _interrupts.leave(entered)
        assert held == 1
        assert isinstance(installed, _interrupts.Deferring) and installed.__wrapped__ is _preempt
        assert any("handler ran once" in n for n in info.value.__notes__)
        assert _interrupts.deferred() == 0
        # Outside a region the same handler runs at once, as before, and one
        # installed there is installed as it is (the next region wraps it).
        with pytest.raises(Preempted):
            signal.raise_signal(signal.SIGALRM)
        signal.signal(signal.SIGALRM, _preempt)
        assert signal.getsignal(signal.SIGALRM) is _preempt


def test_a_signal_arriving_in_the_destroy_that_installed_its_handler_is_held() -> None:
    """Issue 32, defect 4: a destroy installs a SIGALRM handler (a library
    setting up its preemption in a destructor) and the signal arrives before
    the destroy returns: the destroy runs to its end, the other destroys run,
    and the handler's exception is raised once the sync point is done, not as
    a failure of that destroy."""
    comm = MPI.COMM_SELF.Dup()
    log: list[str] = []

    def destroy(tag: str) -> None:
        log.append(tag)
        if tag == "b":
            signal.signal(signal.SIGALRM, _preempt)
            signal.raise_signal(signal.SIGALRM)
            log.append("b, after the signal")

    try:
        with _alarm_restored(), GcDisabled():
            objs = [Obj() for _ in range(3)]
            for o, t in zip(objs, "abc"):
                cgc.register(o, destroy, t, comm=comm)
            del objs, o
            with pytest.raises(Preempted) as info:
                cgc.collect(comm, generation=None)
            assert log == ["c", "b", "b, after the signal", "a"]
            assert any("handler ran once" in n for n in info.value.__notes__)
            assert cgc.manager(comm).broken is None
            assert cgc.collect(comm, generation=None).destroyed == 0
    finally:
        comm.Free()


class _Tripwire:
    """A signal handler that, the first time the region's entry looks at it
    to wrap it, sends this process SIGUSR1: a signal arriving while the
    entry runs Python code."""

    armed = False

    def __call__(self, signum: int, frame: Any) -> None:
        pass

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # what isinstance() asks of a handler
        if _Tripwire.armed:
            _Tripwire.armed = False
            os.kill(os.getpid(), signal.SIGUSR1)
        return _Tripwire


@pytest.mark.mpi(min_size=2)
def test_a_signal_while_a_region_is_entered_is_held_to_its_end(
    comm: MPI.Intracomm,
) -> None:
    """Entering a sync point's protected region wraps the handlers installed
    since the last region, in Python; a signal arriving then is held to the
    region's end like any other (the entry counts the region before it
    looks at the handlers), its handler's exception raised once the sync
    point's collectives are done, with the note saying so; the depth is
    right afterwards, and later regions defer signals as before.

    Found by an interrupt storm on the Python 3.13 stack leg: the sync point
    then left a region it had not entered (SystemError from the C steady
    state; the Python version counted the depth below 0, and handlers then
    ran inside later sync points). Until a review of stop 59 the handler
    ran there, outside any region, and its exception left the entry.
    """
    log: list[str] = []

    def destroy(tag: str) -> None:
        log.append(tag)
        signal.raise_signal(signal.SIGUSR1)  # inside the region: held to its end
        log.append(f"{tag}, after the signal")

    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        assert cgc.collect(comm, generation=None).destroyed == 0  # the family, made
        signal.signal(signal.SIGUSR1, _preempt)
        signal.signal(signal.SIGUSR2, _Tripwire())
        _Tripwire.armed = True
        with pytest.raises(Preempted, match="time slice over") as info:
            cgc.collect(comm, generation=None)
        assert not _Tripwire.armed, "the entry did not look at the handler"
        assert any("handler ran once" in n for n in getattr(info.value, "__notes__", []))
        assert _interrupts.deferred() == 0
        assert cgc.manager(comm).broken is None
        with GcDisabled():
            obj = Obj()
            cgc.register(obj, destroy, "a", comm=comm)
            del obj
            with pytest.raises(Preempted) as info:
                cgc.collect(comm, generation=None)
        assert log == ["a", "a, after the signal"]
        assert any("handler ran once" in n for n in info.value.__notes__)
        assert cgc.collect(comm, generation=None).destroyed == 0
    finally:
        _Tripwire.armed = False
        for s, h in previous.items():
            signal.signal(s, h)


@pytest.mark.mpi(min_size=2)
def test_a_handler_installed_by_a_destroy_runs_after_the_collectives(
    comm: MPI.Intracomm,
) -> None:
    """Issue 32, defect 4: rank 0's destroy installs a SIGALRM handler that
    raises and arms a timer; the signal arrives while rank 0 waits for the
    others in the after-destroy collective (a final sync point's: a scope's
    exit, a close, the exit agreement). Before: the handler's exception
    left the sync point on rank 0, the others got CollectiveTimeoutError
    ("rank 0 left the collectives by an exception") and the manager was
    unusable everywhere. Now rank 0 raises it once the collectives are done,
    the others complete, and the manager stays usable everywhere."""
    rank = comm.Get_rank()
    log: list[str] = []

    def destroy(tag: str) -> None:
        log.append(tag)
        if rank == 0:
            signal.signal(signal.SIGALRM, _preempt)
            signal.setitimer(signal.ITIMER_REAL, 0.2)
        else:
            time.sleep(1.0)  # rank 0 waits in the after-destroy collective meanwhile

    with _alarm_restored():
        o = Obj()
        cgc.register(o, destroy, "x", comm=comm)
        del o
        mgr = cgc.manager(comm)
        seen, stats = attempt(lambda: mgr.sync(deadline=time.monotonic() + 20, final=True))
        broken = mgr.broken

        def one_more() -> int:
            o = Obj()
            cgc.register(o, log.append, "y", comm=comm)
            del o
            return cgc.collect(comm, generation=None, timeout=TIMEOUT).destroyed

        after = attempt(one_more)
    states = everyone(comm, (seen, broken, after, log))
    assert states == [("Preempted", None, ("ok", 1), ["x", "y"])] + [
        ("ok", None, ("ok", 1), ["x", "y"])
    ] * (comm.Get_size() - 1), states


# -- issue 39: the promise, round 5 ------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_the_interrupted_rank_raises_the_destroy_error_at_the_next_agreement_too(
    comm: MPI.Intracomm,
) -> None:
    """Issue 39, item 11. A destroy raises KeyboardInterrupt on rank 1: rank
    1 gets it at once, after the sync point's collectives; at the family's
    next agreement, here a sync point with a deadline on a library's
    ``Dup()`` of the communicator (congruent: the same family), every rank
    raises DestroyError naming it, rank 1 included, which is what keeps the
    ranks in step. README's row said only "the others" raise it there."""
    rank, bad = comm.Get_rank(), 1
    lib = comm.Dup()

    def brake(tag: str) -> None:
        if rank == bad:
            raise KeyboardInterrupt(tag)

    with GcDisabled():
        o = Obj()
        key = cgc.register(o, brake, "b", comm=comm, name="brake").key
        del o
        first = attempt(lambda: cgc.collect(comm, generation=None))[0]
        failures = None
        try:
            cgc.collect(lib, generation=None, timeout=30)
            second = "ok"
        except cgc.DestroyError as exc:
            second, failures = "DestroyError", exc.failures
            del exc
        third = cgc.collect(comm, generation=None).sync
    lib.Free()
    verdicts = everyone(comm, (first, second, failures, third))
    for r, (first, second, failures, _) in enumerate(verdicts):
        assert first == ("KeyboardInterrupt" if r == bad else "ok"), verdicts
        assert second == "DestroyError", verdicts
        assert failures == [(bad, key, "brake", "KeyboardInterrupt: b")], verdicts
    assert len({v[3] for v in verdicts}) == 1, verdicts  # the next sync point in step


def _fails(tag: str) -> None:
    raise ValueError(f"destroy {tag} fails")


@pytest.mark.mpi(min_size=2)
def test_a_second_ctrl_c_at_a_sync_points_end_keeps_its_failures_for_the_next(
    comm: MPI.Intracomm,
) -> None:
    """A sync point's destroys end with one failure on every rank, and a
    second Ctrl-C arrives once its collectives are done (each rank's
    destroys send SIGINT twice: the first is held, the second runs its
    handler at once). The KeyboardInterrupt is raised on every rank, and
    the failure is still reported, as DestroyError on every rank, by the
    family's next agreement. From the review of the report step (stop 57):
    the steady state had stored the failures for the steps to report, and
    the interrupt left them there, never reported."""
    import ctypes

    cgc.collect(comm, generation=None, timeout=30)  # the family exists, steady from now
    pid = os.getpid()
    # libc's kill() through ctypes: no Python code runs after it, and no
    # signal check (os.kill runs the handler at once for its own process).
    kill = ctypes.CDLL(None).kill
    # Destroys run newest first: a signal (its handler held: the first),
    # the failure (whose Python code lets the handler run), a signal (its
    # handler called at once: the second) whose handler runs at the sync
    # point's end, where the C steady state checks for signals.
    owners = [Obj(), Obj(), Obj()]
    cgc.register(owners[0], kill, pid, signal.SIGINT, comm=comm, name="second")
    cgc.register(owners[1], _fails, "x", comm=comm, name="fails")
    cgc.register(owners[2], kill, pid, signal.SIGINT, comm=comm, name="first")
    del owners
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        first = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=30))
    finally:
        signal.signal(signal.SIGINT, previous)
    message = ""
    try:
        cgc.collect(comm, generation=None, timeout=30)
        then = "ok"
    except cgc.DestroyError as exc:
        then, message = "DestroyError", str(exc)
    verdicts = everyone(comm, (first, then, "destroy x fails" in message))
    assert all(v == ("KeyboardInterrupt", "DestroyError", True) for v in verdicts), verdicts
