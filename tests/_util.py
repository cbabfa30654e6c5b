"""Small helpers shared by the tests."""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
from mpi4py import MPI

import collective_gc as cgc


class Obj:
    """A plain managed object; ``peer`` lets a test build cycles."""

    def __init__(self, tag: Any = None) -> None:
        self.tag = tag
        self.peer: Any = None


class CheckedLog:
    """A destroy log whose entries also check, collectively, that every rank
    destroys the same key at the same position (an MPI call, as a real
    collective destroy would make)."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.keys: list[Any] = []

    def destroy(self, tag: Any) -> None:
        self.keys.append(tag)
        if self.comm.Get_size() > 1:
            mine = (len(self.keys), tag)
            everyone = self.comm.allgather(mine)
            assert all(e == mine for e in everyone), f"destroy order differs: {everyone}"


def make_cycle(comm: MPI.Comm, log: CheckedLog, tag: Any) -> cgc.Registration:
    """Register an object that lives in a two-object reference cycle."""
    a, b = Obj(tag), Obj()
    a.peer, b.peer = b, a
    return cgc.register(a, log.destroy, tag, comm=comm, name=f"cyc{tag}")


def same_on_all(comm: MPI.Comm, value: Any) -> bool:
    return all(v == value for v in comm.allgather(value))


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process; a zombie (dead, not yet reaped) is not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class GcDisabled:
    """Context manager: automatic cyclic collection off, restored after."""

    def __enter__(self) -> None:
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was:
            gc.enable()


_WINDOWS: list[str | None] = []


def windows_or_skip(comm: MPI.Intracomm) -> None:
    """Collective on the first call (every rank runs the tests in one order):
    skip the test if this MPI cannot create an ``MPI.Win.Create`` window on
    ``comm``'s world at all. Open MPI 4.1 with ``btl=tcp,self`` (the transport
    between nodes) fails every creation with MPI_ERR_WIN, on every rank alike;
    that is this MPI's limit, not ours. The answer is agreed (an allreduce),
    so every rank skips or none."""
    why = windows_fail(comm)
    if why is not None:
        pytest.skip(f"this MPI cannot create windows over btl tcp,self: {why}")


def windows_fail(comm: MPI.Intracomm) -> str | None:
    """Collective on the first call: why ``MPI.Win.Create`` fails on every
    rank of ``comm``, or None if it works (see :func:`windows_or_skip`)."""
    if not _WINDOWS:
        why = None
        try:
            MPI.Win.Create(None, 1, MPI.INFO_NULL, comm).Free()
        except MPI.Exception as exc:
            why = exc.Get_error_string()
        failed = comm.allreduce(why is not None, op=MPI.LOR)
        if failed and not _tcp_only():
            # Only the TCP-only transport excuses it: on any other stack the
            # window tests must fail, not skip (every rank raises alike).
            raise RuntimeError(
                f"MPI.Win.Create fails on this stack ({why or 'on another rank'}) although "
                "its transport is not restricted to tcp,self"
            )
        _WINDOWS.append((why or "failed on another rank") if failed else None)
    return _WINDOWS[0]


def _tcp_only() -> bool:
    """Whether Open MPI was told to use only its TCP and self transports."""
    btl = os.environ.get("OMPI_MCA_btl", "").strip()
    names = {n.strip() for n in btl.split(",") if n.strip()}
    return bool(names) and not btl.startswith("^") and names <= {"tcp", "self"}
