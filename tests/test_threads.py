"""Threads: registering, dropping, looking up and syncing from several threads; scopes on
two threads; diagnostics while another thread changes what they walk.

Every test runs on COMM_SELF (serially) or on every rank of COMM_WORLD (under
``mpiexec -n 4``); the ones that need other ranks are marked ``mpi``. Verdicts
that could differ between ranks are gathered first and asserted on every rank
alike, so that a failing test never leaves some ranks waiting.
"""

from __future__ import annotations

import threading
from typing import Any

from mpi4py import MPI

import collective_gc as cgc

from _util import (
    GcDisabled,
    Obj,
    noop,
)


def test_snapshot_from_another_thread_during_sync_points(comm: MPI.Intracomm) -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    mgr = cgc.manager(comm)
    stop = threading.Event()
    errors: list[BaseException] = []
    inside = threading.Event()
    go_on = threading.Event()
    snaps: list[Any] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                during = inside.is_set() and not go_on.is_set()  # before the snapshot
                snap = mgr.snapshot()
                keys = [r.key for r in snap.pending]
                assert keys == sorted(set(keys)), keys
                if during:
                    snaps.append(snap)
                    go_on.set()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def blocking() -> None:
        inside.set()
        assert go_on.wait(30)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        with GcDisabled():
            for step in range(30):
                objs = [Obj() for _ in range(400)]
                regs = [cgc.register(o, noop, comm=comm) for o in objs]
                if step == 15:
                    special = Obj()
                    sreg = cgc.register(special, blocking, comm=comm)
                    del special
                del objs[::2]
                cgc.collect(comm, generation=None, timeout=60)
                del objs, regs
        cgc.collect(comm, generation=None, timeout=60)
    finally:
        stop.set()
        go_on.set()
        t.join(30)
    assert not errors, errors
    assert snaps, "the reader never saw the sync point with the blocking destroy"
    # Taken while the agreed destroys ran: none of them is pending any more.
    assert sreg.key not in [r.key for r in snaps[0].pending]
    assert not sreg.alive
