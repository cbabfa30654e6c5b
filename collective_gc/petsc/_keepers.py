"""Owners that their own managed PETSc objects keep alive, so that they never die.

A registration holds its destroy call (the objects) strongly until its
owner dies; an object that refers back to the owner (an application
context, a callback, a ``setAttr`` value) makes the owner immortal. The
search is collective_gc._diagnose's (shortest paths first); what it walks
here is what keeps an owner alive: strong references the user made, not
the interpreter's (a function's globals, a class) nor the manager's.
"""

from __future__ import annotations

import functools
import gc
import types
import weakref
from collections.abc import Iterator

from petsc4py import PETSc

from .._collective import Collective
from .._diagnose import reference_paths
from .._manager import Manager
from .._registration import Registration

# Not walked into: their referents are the interpreter's, not the user's
# object graph (a function's globals reach every module). The library's own
# state is left out too, the manager and its family (which a derived
# communicator's destroy holds): through their registrations every owner
# would look reachable from every other, and each derived communicator's
# walk would cross its family's registry (and, through the family tree,
# others'), so that with many of them alive the walks' budget ran out
# before the last owners.
_OPAQUE = (
    type,
    types.ModuleType,
    types.FrameType,
    types.CodeType,
    types.BuiltinFunctionType,
    str,
    bytes,
    int,
    float,
    Manager,
    Collective,
)
_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)


def _opaque(obj: object) -> bool:
    # A weak proxy holds nothing strongly, and isinstance() on a dead one
    # raises ReferenceError: its type is read directly.
    return type(obj) in _PROXIES or isinstance(obj, _OPAQUE)


def _edges(obj: object) -> Iterator[tuple[str, object]]:
    """(label, referent) for the strong references out of ``obj`` that matter here."""
    if _opaque(obj):
        return
    # Containers are copied by their own copy(), in one C call: list() of a
    # dict's items allocates a tuple per item, so a collection (its callbacks,
    # finalizers, another thread given the GIL there) may change the dict in
    # the middle of it, and the walk would raise instead of looking.
    if isinstance(obj, dict):
        for k, v in dict.copy(obj).items():
            yield f"[{k!r}]", v
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):  # a list's iterator never raises for a change
            yield f"[{i}]", v
    elif isinstance(obj, (set, frozenset)):
        for v in set.copy(obj) if isinstance(obj, set) else obj:
            yield "{...}", v
    elif isinstance(obj, types.MethodType):
        yield ".__self__", obj.__self__
    elif isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            try:
                yield f".<closure of {obj.__name__}>", cell.cell_contents
            except ValueError:  # an empty cell
                pass
    elif isinstance(obj, functools.partial):
        yield ".func", obj.func
        yield ".args", obj.args
        yield ".keywords", obj.keywords
    elif isinstance(obj, PETSc.Object):
        # petsc4py's traverse gives the PETSc object's own attribute dict
        # (application context, callbacks, setAttr values): what petsc4py's
        # own cyclic collection follows.
        for ref in gc.get_referents(obj):
            yield ".<PETSc attributes>", ref
    else:
        inst = getattr(obj, "__dict__", None)
        for ref in gc.get_referents(obj):
            if ref is inst and isinstance(inst, dict):
                for k, v in dict.copy(inst).items():
                    yield f".{k}", v
            else:
                yield f".<{type(ref).__name__}>", ref


def path_to(
    roots: list[tuple[str, object]], owner: object, max_objects: int
) -> tuple[str | None, int]:
    """The shortest path of strong references from one of ``roots`` (named) to
    ``owner``, or None; and how many objects were looked at (at most about
    ``max_objects``). Local. See :func:`collective_gc._diagnose.reference_paths`."""
    for name, root in roots:
        if root is owner:
            return f"{name} -> {type(owner).__name__}", 1
    if _opaque(owner):
        return None, 0  # never walked to: a class or a module is alive anyway
    paths, seen = reference_paths(
        roots, owner, _edges, skip=_opaque, max_depth=8, max_objects=max_objects, limit=1
    )
    return (paths[0] if paths else None), seen


def _keeper(reg: Registration, owner: object, max_objects: int) -> tuple[str | None, int]:
    """How ``reg``'s own destroy call reaches its owner (see :func:`path_to`).

    The registration holds its destroy and arguments strongly, and is held
    by its manager, so an owner reachable from them can never die.
    """
    roots = [
        ("destroy args" if isinstance(ref, tuple) else "destroy", ref)
        for ref in gc.get_referents(reg)
        # Not the manager, nor its inbox's bound append.
        if not (_opaque(ref) or isinstance(ref, types.BuiltinMethodType))
    ]
    return path_to(roots, owner, max_objects)


def keepers(mgr: Manager, budget: int = 200_000) -> list[str]:
    """One line per live owner on ``mgr`` that its own destroy call keeps alive. Local."""
    # The budget bounds the whole walk (a view or the exit of a program with
    # many live owners must stay quick); what it leaves unchecked is said.
    out = []
    regs = mgr.alive()
    for i, reg in enumerate(regs):
        if budget <= 0:
            out.append(
                f"{len(regs) - i} more live registrations not checked for owners "
                "their own destroy call keeps alive (too many objects to walk)"
            )
            break
        owner = reg()
        path, seen = (None, 0) if owner is None else _keeper(reg, owner, min(budget, 5000))
        del owner
        budget -= max(seen, 1)
        if path is not None:
            out.append(
                f"{reg.typename} {reg.name!r} (key {reg.key}) is kept alive by its own "
                f"destroy call, so it never dies and its destroy never runs: {path}"
            )
    return out
