"""Destroys: failing and blocking destroys, destroys that detach or ask what is pending, the
pass that runs them (the bound twin of the family state's), bad input.

Every test runs on COMM_SELF (serially) or on every rank of COMM_WORLD (under
``mpiexec -n 4``); the ones that need other ranks are marked ``mpi``. Verdicts
that could differ between ranks are gathered first and asserted on every rank
alike, so that a failing test never leaves some ranks waiting.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import collective_gc as cgc
from collective_gc import _registration

from _util import CheckedLog, GcDisabled, Obj


def test_destroy_that_detaches_and_asks_pending_loses_nothing(comm: MPI.Intracomm) -> None:
    """Issue 11, defects 8 and 9."""
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


def _state_with(
    calls: list[tuple[Any, tuple[Any, ...]]],
) -> tuple[Any, list[Obj], list[Any]]:
    """A family state of size 1 (the bound twin: C where built) with a
    registration for each (destroy, args) of ``calls``, keys 0..n-1."""
    from collective_gc._registration import GC, Registration
    from collective_gc._state import FamilyState, new_registration
    from collective_gc._syncpoint import CollectStats

    state = FamilyState(0, 1, GC, Registration, CollectStats)
    objs = [Obj() for _ in calls]
    regs = []
    for o, (fn, args) in zip(objs, calls):  # the guarded path's steps: key, registration, store
        key = state.take_key(0)
        reg = new_registration(
            Registration, GC.finalize, o, None, state.inbox.append, key, fn, args, None, None
        )
        state.store(reg)
        regs.append(reg)
    return state, objs, regs


def test_the_destroy_pass_skips_a_registration_destroyed_meanwhile() -> None:
    """Keys agreed for a registration whose destroy ran meanwhile (explicitly,
    on every rank) run nothing for it. Issue 11, defect 17."""
    log: list[int] = []
    state, objs, regs = _state_with([(log.append, (i,)) for i in range(3)])
    assert state.claim(regs[1], _registration.DESTROYED) is not None
    keys = np.arange(3, dtype=np.int64).tobytes()
    count, failures, interrupt = state.destroy(keys, (), ())
    assert (count, failures, interrupt, log) == (2, [], None, [2, 0])
    assert not state.live and [r.alive for r in regs] == [False] * 3


def test_the_destroy_pass_tries_every_call_whatever_raises() -> None:
    """Plain destroys and a batched run alike: every call is made, newest
    first, and what raised is reported with its key, a KeyboardInterrupt too.
    Issue 11, defect 17."""
    calls: list[int] = []

    def f(i: int) -> None:
        calls.append(i)
        if i % 2:
            raise (KeyboardInterrupt if i == 1 else ValueError)(i)

    def batched(i: int) -> None:
        f(i)

    def run(argss: list[tuple[Any, ...]]) -> list[tuple[int, BaseException]]:
        errors = []
        for at, (i,) in enumerate(argss):
            try:
                batched(i)
            except BaseException as exc:  # noqa: BLE001 (a runner reports, never raises)
                errors.append((at, exc))
        return errors

    state, objs, regs = _state_with([(f if i < 3 else batched, (i,)) for i in range(6)])
    keys = np.arange(6, dtype=np.int64).tobytes()
    count, failures, _ = state.destroy(keys, (batched,), (run,))
    assert count == 6 and calls == [5, 4, 3, 2, 1, 0]
    assert sorted((k, type(e)) for k, _, e in failures) == [
        (1, KeyboardInterrupt),
        (3, ValueError),
        (5, ValueError),
    ]


def test_destroy_raising_on_every_rank(comm: MPI.Intracomm) -> None:
    """From the fault tests of the reliability work."""
    log = CheckedLog(comm)

    def bad(tag: int) -> None:
        log.destroy(tag)
        raise ValueError(f"cannot destroy {tag}")

    objs = [Obj() for _ in range(2)]
    for i, o in enumerate(objs):
        cgc.register(o, bad, i, comm=comm, name=f"r{i}")
    del o
    objs.clear()
    # Every agreed destroy runs; what failed is agreed by the family's next
    # collective, which raises it on every rank.
    assert cgc.collect(comm).destroyed == 2
    assert log.keys == [1, 0]
    with pytest.raises(cgc.DestroyError) as info:
        cgc.collect(comm)
    assert len(info.value.failures) == 2 * comm.Get_size()
    assert {f[0] for f in info.value.failures} == set(range(comm.Get_size()))
    assert cgc.collect(comm).pending == 0


def test_bad_input_loses_nothing(comm: MPI.Intracomm) -> None:
    """From the fault tests of the reliability work."""
    log = CheckedLog(comm)
    queued = Obj()
    cgc.register(queued, log.destroy, "kept", comm=comm)
    del queued
    for bad in (
        lambda: cgc.register(1.5, print, comm=comm),  # not weakly referenceable
        lambda: cgc.register(Obj(), "close", comm=comm),  # not callable
        lambda: cgc.register(Obj(), print, comm="world"),  # not a communicator
    ):
        with pytest.raises((cgc.RegistrationError, TypeError)):
            bad()
    freed = comm.Dup()
    freed.Free()
    with pytest.raises(ValueError, match="COMM_NULL"):
        cgc.register(Obj(), print, comm=freed)
    with pytest.raises(ValueError, match="COMM_NULL"):
        cgc.collect(freed)
    # Nothing queued was lost, and the refusals consumed no key.
    assert cgc.manager(comm).next_key == 1
    assert cgc.collect(comm).destroyed == 1 and log.keys == ["kept"]


@pytest.mark.mpi(min_size=2)
def test_collect_on_a_communicator_this_rank_is_not_in(comm: MPI.Intracomm) -> None:
    """From the fault tests of the reliability work."""
    sub = comm.Split(0 if comm.Get_rank() else MPI.UNDEFINED, 0)
    if comm.Get_rank() == 0:
        with pytest.raises(ValueError, match="not in it"):
            cgc.collect(sub)
    else:
        assert cgc.collect(sub).destroyed == 0
        sub.Free()
