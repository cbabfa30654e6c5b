"""A failure a sync point reports leaves no reference cycle behind.

Our users run with the automatic collector off (``gc.disable()`` and a
managed collect). An exception caught inside a sync point keeps its
traceback, whose frames link to the frames that called them (``f_back``):
a frame that still holds the exception once it has returned closes a cycle
that only the cyclic collector frees, and with it everything those frames
hold (the failed destroy's arguments, the batch of destroyed objects).

Each test makes a sync point fail, catches its error without binding it,
and then checks, with the collector off, that what the failing code held
was freed by reference counting alone and that the next collection finds
no garbage. A failed destroy is kept until the family's next collective
reports it on every rank: what it held is freed once that report is
dropped. Verdicts are gathered and asserted on every rank alike.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
from mpi4py import MPI

import collective_gc as cgc
from collective_gc import local

from _util import GcDisabled, Obj

WORLD = MPI.COMM_WORLD


class Resource:
    """What failing code holds: freed by refcounting once the error is dropped."""

    __slots__ = ("__weakref__",)


def fail(res: Resource) -> None:
    raise RuntimeError("this destroy fails")


def interrupt(res: Resource) -> None:
    raise KeyboardInterrupt


def noop(*args: Any) -> None:
    pass


def leftovers(comm: MPI.Intracomm, action: Callable[[], tuple[str, list[weakref.ref[Any]]]]) -> str:
    """Run ``action`` with the collector off: it makes a sync point on ``comm``
    fail, catches the error and returns what it raised and weak references
    to what the failing code held. Returns a verdict, the same on every rank
    when all is well."""
    cgc.collect(comm, generation=None)  # the manager and its agreement exist before
    with GcDisabled():
        gc.collect()
        outcome, refs = action()
        alive = sum(r() is not None for r in refs)
        found = gc.collect()
    return (
        f"{outcome}; {alive} of {len(refs)} held objects alive; {found} objects in garbage cycles"
    )


def raised_by(fn: Callable[[], object]) -> str:
    """What ``fn()`` raised (DestroyError or KeyboardInterrupt), unbound."""
    try:
        fn()
    except cgc.DestroyError:
        return "DestroyError"
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    return "nothing raised"


def fail_once(
    comm: MPI.Intracomm, destroy: Callable[[Resource], None], on: MPI.Intracomm | None = None
) -> tuple[str, list[Any]]:
    """The sync point of ``comm`` where the destroy (registered on ``on``, a
    communicator its sync points reach; ``comm`` if None) fails, then the
    next one, which reports it: what each raised."""
    owner, res = Obj(), Resource()
    ref = weakref.ref(res)
    cgc.register(owner, destroy, res, comm=comm if on is None else on)
    del owner, res, on
    first = raised_by(lambda: cgc.collect(comm, generation=None))
    then = raised_by(lambda: cgc.collect(comm, generation=None))
    return f"{first}, then {then}", [ref]


@pytest.mark.parametrize(
    ("destroy", "raised"),
    [
        (fail, "nothing raised, then DestroyError"),
        (interrupt, "KeyboardInterrupt, then DestroyError"),
    ],
)
def test_a_failed_destroy_leaves_no_cycle(destroy: Callable[[Resource], None], raised: str) -> None:
    comm = MPI.COMM_SELF.Dup()
    try:
        verdict = leftovers(comm, lambda: fail_once(comm, destroy))
    finally:
        comm.Free()
    assert verdict == f"{raised}; 0 of 1 held objects alive; 0 objects in garbage cycles"


class FailingFinish(cgc.Participant):
    """A finish that raises while holding a resource in its frame."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref[Any]] = []

    def finish(self, mgr: cgc.Manager, flags: int) -> None:
        res = Resource()
        self.refs.append(weakref.ref(res))
        raise RuntimeError("this finish fails")


def test_a_failed_finish_leaves_no_cycle() -> None:
    comm = MPI.COMM_SELF.Dup()

    def action() -> tuple[str, list[Any]]:
        part = FailingFinish()
        try:
            cgc.manager(comm).sync(participants=[part])
        except cgc.DestroyError:
            return "DestroyError", part.refs
        return "nothing raised", part.refs

    try:
        verdict = leftovers(comm, action)
    finally:
        comm.Free()
    assert verdict == "DestroyError; 0 of 1 held objects alive; 0 objects in garbage cycles"


def test_a_failed_destroy_on_a_derived_communicator_leaves_no_cycle() -> None:
    comm = MPI.COMM_SELF.Dup()

    try:
        verdict = leftovers(comm, lambda: fail_once(comm, fail, on=cgc.dup(comm)))
    finally:
        cgc.collect(comm, generation=None)  # frees the derived communicator
        comm.Free()
    assert verdict == (
        "nothing raised, then DestroyError; 0 of 1 held objects alive; 0 objects in garbage cycles"
    )


def test_a_failed_destroy_at_a_scope_exit_leaves_no_cycle() -> None:
    comm = MPI.COMM_SELF.Dup()

    def action() -> tuple[str, list[Any]]:
        res = Resource()
        ref = weakref.ref(res)
        try:
            with cgc.collective_scope(comm, gc="off", exit_collect=None):
                cgc.register(Obj(), fail, res, comm=comm)  # the object dies at once
                del res
        except cgc.DestroyError:
            return "DestroyError", [ref]
        return "nothing raised", [ref]

    try:
        verdict = leftovers(comm, action)
    finally:
        comm.Free()
    assert verdict == "DestroyError; 0 of 1 held objects alive; 0 objects in garbage cycles"


def test_a_failed_rank_local_destroy_leaves_no_cycle(capfd: pytest.CaptureFixture[str]) -> None:
    # Reported on stderr by the reaper thread, which keeps nothing of it.
    with GcDisabled():
        gc.collect()
        owner, res = Obj(), Resource()
        ref = weakref.ref(res)
        local.register(owner, fail, res)
        del owner, res
        assert local.flush(30)
        alive = ref() is not None
        found = gc.collect()
    assert (alive, found) == (False, 0)
    assert "RuntimeError: this destroy fails" in capfd.readouterr().err


@pytest.mark.mpi(min_size=2)
def test_a_destroy_failed_on_one_rank_leaves_no_cycle_on_any(comm: MPI.Intracomm) -> None:
    def on_rank_0(res: Resource) -> None:
        if comm.Get_rank() == 0:
            raise RuntimeError("this destroy fails on rank 0")

    verdicts = comm.allgather(leftovers(comm, lambda: fail_once(comm, on_rank_0)))
    assert (
        verdicts
        == [
            "nothing raised, then DestroyError; 0 of 1 held objects alive; "
            "0 objects in garbage cycles"
        ]
        * comm.Get_size()
    )


@pytest.mark.mpi(min_size=2)
def test_a_failed_destroy_on_a_child_family_leaves_no_cycle(comm: MPI.Intracomm) -> None:
    """A child family (a split in another order: not congruent with the
    communicator, so a family of its own, whose sync point the parent's
    visits) reports its failures to the parent's sync point. From a review of
    the report step (stop 57): the list the child's sync point filled with
    this rank's failures stayed held by that sync point's frame, which the
    failures' tracebacks reach."""

    def action() -> tuple[str, list[Any]]:
        return fail_once(comm, fail, on=cgc.split(comm, 0, key=-comm.Get_rank()))

    try:
        verdict = leftovers(comm, action)
    finally:
        for _ in range(3):
            cgc.collect(comm, generation=None)  # frees the child
    verdicts = comm.allgather(verdict)
    assert verdicts == [verdicts[0]] * comm.Get_size(), verdicts
    assert verdicts[0] == (
        "nothing raised, then DestroyError; 0 of 1 held objects alive; 0 objects in garbage cycles"
    )
