"""Small helpers shared by the tests."""

from __future__ import annotations

import gc
from typing import Any

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
