"""Destroys: failing and blocking destroys, destroys that detach or ask what is pending, the C
and Python passes that run them, bad input.

Every test runs on COMM_SELF (serially) or on every rank of COMM_WORLD (under
``mpiexec -n 4``); the ones that need other ranks are marked ``mpi``. Verdicts
that could differ between ranks are gathered first and asserted on every rank
alike, so that a failing test never leaves some ranks waiting.
"""

from __future__ import annotations

import pytest
from mpi4py import MPI

import collective_gc as cgc
from collective_gc import _destroy, _registration

from _util import CheckedLog, GcDisabled, Obj, noop


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


# The Python passes always; the C ones where the optional extension is built
# (test_the_c_sync_passes_are_built_here fails where it is not).
_C = _registration.SPEEDUPS


_TAKES = [_registration.take_batch_py] + ([_C.take_batch] if _C else [])


_RUNS = [_destroy.run_each_py] + ([_C.run_each] if _C else [])


def test_batch_passes_agree_on_a_registration_without_a_destroy() -> None:
    """Issue 11, defect 17."""
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
    """Issue 11, defect 17."""
    for run in _RUNS:
        calls: list[int] = []

        def f(i: int, calls: list[int] = calls) -> None:
            calls.append(i)
            if i % 2:
                raise (KeyboardInterrupt if i == 1 else ValueError)(i)

        errors = run([f] * 5, [(i,) for i in range(5)])
        assert calls == list(range(5))
        assert [(i, type(e)) for i, e in errors] == [(1, KeyboardInterrupt), (3, ValueError)]


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
