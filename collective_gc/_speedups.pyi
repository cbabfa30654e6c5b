# The C twins of collective_gc._state's typed state (see _speedups.c's
# header). Each C type has its Python twin's fields and methods, which this
# stub states by deriving from it: mypy then checks every call into C
# against the same signatures as the twin's.
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from . import _state
from .petsc import _destroyers

class GcState(_state.GcState): ...
class RegistrationFields(_state.RegistrationFields): ...
class Region(_state.Region): ...

class FamilyState(_state.FamilyState):
    persistent: bool  # (a property in the twin, a field here)

def new_registration(
    cls: type[_state.RegistrationFields],
    callback: Callable[[Any], None],
    obj: object,
    owner: Any,
    push: Callable[[Any], object],
    key: int,
    destroy: Callable[..., object],
    args: tuple[Any, ...],
    name: str | None,
    origin: Any,
    /,
) -> Any: ...
def note_queued(reg: _state.RegistrationFields, seq: int, /) -> None: ...
def take_call(
    reg: Any, state: int, live: dict[int, Any], /
) -> tuple[Callable[..., object], tuple[Any, ...]] | None: ...

class CommState(_destroyers.CommState): ...

class PetscRun:
    def __call__(self, argss: list[tuple[Any, ...]], /) -> list[tuple[int, BaseException]]: ...

class Petsc:
    """What collective_gc.petsc reads and runs of PETSc (addresses given once)."""

    def __init__(
        self,
        inner_kv: int,
        counter_kv: int,
        garbage_kv: int,
        getptr: int,
        getcomm: int,
        destroy: int,
        seterr: int,
        commdup: int,
        commfree: int,
        fast: tuple[type, ...],
        failed: Callable[[Any, list[tuple[Any, BaseException]]], BaseException],
        self_delayed: bool,
        /,
    ) -> None: ...
    def garbage(self, handle: int, /) -> int: ...
    def sort(self, objs: tuple[Any, ...], comm: MPI.Comm, /) -> int: ...
    def runner(self, many: bool, /) -> PetscRun: ...
    def comm_state(self, parallel: bool, /) -> CommState: ...
