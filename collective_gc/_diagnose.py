"""Diagnostics: the reference cycles of a live object, and what is queued where.

``find_cycles`` answers the question strict mode raises: *why* did this object
die in the cyclic collector? It walks ``gc.get_referents`` from the object,
breadth first, and reports each shortest path back to it as attribute paths
(``Solver.ksp -> KSPWrapper.owner -> Solver``), so the user can see which
reference to break. Its search, ``reference_paths``, is also the PETSc
adapter's (which owner its own destroy call keeps alive). ``view`` is the
cross-rank table of what is queued, like PETSc's ``garbage_view`` but for
everything managed.
"""

from __future__ import annotations

import collections
import gc
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from typing import IO

from mpi4py import MPI

from . import _manager
from ._api import check_timeout
from ._comms import unreached_rows
from ._lookup import manager
from ._manager import Manager

__all__ = ["find_cycles", "view"]

# Objects whose referents are not part of a user's object graph in any useful
# sense: walking into them finds every cycle in the interpreter.
_OPAQUE = (type, types.ModuleType, types.FrameType, types.CodeType)


def _name(obj: object) -> str:
    return type(obj).__name__


def _edges(obj: object) -> Iterator[tuple[str, object]]:
    """(label, referent) pairs, looking through instance and class-less dicts."""
    # Containers are copied first (one C call that allocates only up front, so
    # no collector and no other thread can run inside it): another thread may
    # change them while the walk, a generator, is suspended.
    if isinstance(obj, _OPAQUE):
        return
    if isinstance(obj, dict):
        for k, v in dict.copy(obj).items():
            yield f"[{k!r}]", v
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(list(obj)):
            yield f"[{i}]", v
        return
    if isinstance(obj, (set, frozenset)):
        for v in list(obj):
            yield "{...}", v
        return
    inst_dict = getattr(obj, "__dict__", None) if not isinstance(obj, types.FunctionType) else None
    # The instance dict's items first, by name. Whether gc.get_referents
    # returns the dict or (Python 3.13: values kept inline) the values
    # themselves varies, so those are skipped below, not labelled twice.
    named: set[int] = set()
    if isinstance(inst_dict, dict):
        for k, v in dict.copy(inst_dict).items():
            named.add(id(v))
            yield f".{k}", v
    for ref in gc.get_referents(obj):
        if ref is inst_dict or id(ref) in named or ref is type(obj):
            continue
        yield _label(obj, ref), ref


def _label(owner: object, ref: object) -> str:
    for klass in type(owner).__mro__:
        for attr in getattr(klass, "__slots__", ()):
            if getattr(owner, attr, None) is ref:
                return f".{attr}"
    if isinstance(owner, types.MethodType):
        return ".__self__" if ref is owner.__self__ else ".__func__"
    if isinstance(owner, types.CellType):
        return ".cell_contents"
    if isinstance(owner, types.FunctionType) and isinstance(ref, tuple):
        return ".__closure__"
    return f".<{_name(ref)}>"


def _scalar(obj: object) -> bool:
    return isinstance(obj, (int, float, str, bytes))


def find_cycles(
    obj: object, *, max_depth: int = 8, max_objects: int = 100_000, limit: int = 10
) -> list[str]:
    """The reference cycles through a live ``obj``, as readable paths. Local.

    Returns at most ``limit`` paths, shortest first, each like
    ``"Solver.ksp -> KSPWrapper.owner -> Solver"``: follow the attributes
    (``.name``), items (``[key]``) or other references (``.<type>``) from
    ``obj`` and you come back to it. Breaking any one reference of a path
    breaks that cycle. Types, modules, frames and code objects are not walked
    into. An empty list means ``obj`` is in no cycle (within ``max_depth``
    references and ``max_objects`` visited objects).
    """
    paths, _ = reference_paths(
        [(_name(obj), obj)],
        obj,
        _edges,
        skip=_scalar,
        max_depth=max_depth,
        max_objects=max_objects,
        limit=limit,
    )
    return paths


def reference_paths(
    roots: Iterable[tuple[str, object]],
    target: object,
    edges: Callable[[object], Iterable[tuple[str, object]]],
    *,
    skip: Callable[[object], bool],
    max_depth: int,
    max_objects: int,
    limit: int,
) -> tuple[list[str], int]:
    """The shortest paths of references from ``roots`` to ``target``. Local.

    ``roots`` are ``(name, object)`` pairs: a path starts with its root's
    name, then names each object it goes through by its type, each followed
    by the label ``edges`` gave the reference out of it (``edges(obj)``
    yields ``(label, referent)`` pairs), and ends with the target's type:
    ``"Solver.ksp -> KSP.<PETSc attributes> -> Solver"``. A target among the
    roots is walked from like any root, so its paths are its cycles
    (:func:`find_cycles`); the PETSc adapter walks from a registration's
    destroy call to its owner. Breadth first, so shortest first: at most
    ``limit`` paths of at most ``max_depth`` references; a referent that
    ``skip`` is true of is not walked into, and the walk stops once it has
    seen ``max_objects`` objects. Also returns how many objects it saw.
    """
    if limit < 1:
        return [], 0
    # Each object seen, held so that its id cannot be reused by another one
    # while the walk runs (a container the collector frees meanwhile, say).
    nodes: dict[int, object] = {}
    via: dict[int, tuple[int, str]] = {}  # object -> (its referrer, the reference)
    names: dict[int, str] = {}  # the roots' names
    depth: dict[int, int] = {}
    queue: collections.deque[object] = collections.deque()
    for name, root in roots:
        rid = id(root)
        if rid not in nodes:
            nodes[rid], names[rid], depth[rid] = root, name, 0
            queue.append(root)

    def path(node: int, label: str) -> str:
        steps = []
        while True:
            steps.append(f"{names[node] if node in names else _name(nodes[node])}{label}")
            if node not in via:
                break
            node, label = via[node]
        return " -> ".join(steps[::-1]) + f" -> {_name(target)}"

    found: list[str] = []
    while queue and len(nodes) < max_objects:
        cur = queue.popleft()
        d = depth[id(cur)]
        for label, ref in edges(cur):
            if ref is target:
                found.append(path(id(cur), label))
                if len(found) >= limit:
                    return found, len(nodes)
                continue
            rid = id(ref)
            if rid in nodes or d + 1 >= max_depth or skip(ref):
                continue
            nodes[rid] = ref
            via[rid] = (id(cur), label)
            depth[rid] = d + 1
            queue.append(ref)
    return found, len(nodes)


def _rows(mgr: Manager) -> list[tuple[int, int, str, str, str]]:
    # The whole family's queue: a sync point of this communicator destroys
    # what is queued on the communicators congruent with it too.
    fam = _manager.family(mgr)
    queued = [] if fam is None else fam.registry.pending(fam.seq)
    rows = [
        (mgr.rank, r.key, r.typename, r.name, str(mgr.sync_count - r.queued_at)) for r in queued
    ]
    rows.extend((mgr.rank, -1, t, desc, "-") for t, desc in mgr.view_rows())
    rows.extend((mgr.rank, -1, t, desc, "-") for t, desc in unreached_rows(mgr))
    return rows


class _Stdout:
    """The default of ``view(file=)``: whatever ``sys.stdout`` is when view is called
    (pytest's capture, a redirect), not the one there was at import."""

    def __repr__(self) -> str:
        return "sys.stdout"


_STDOUT = _Stdout()


def view(
    comm: MPI.Intracomm,
    *,
    file: IO[str] | _Stdout | None = _STDOUT,
    timeout: float | None = None,
) -> str:
    """Collective: a per-rank table of what is queued on ``comm``; returns it on every rank.

    One row per queued destroy request: rank, key, type, name and age in sync
    points (how many sync points it has waited through), plus rows from
    adapters (PETSc's own garbage, key ``-``). Rank 0 prints it to ``file``
    (default: ``sys.stdout`` at the time of the call; None: print nothing).
    Every rank of ``comm`` must call it (it gathers); ``timeout`` bounds that
    wait (:class:`CollectiveTimeoutError`). It changes nothing: what the next
    sync point sees (cyclic finalizations included) is the same with or
    without it.
    """
    seconds = check_timeout(timeout)
    mgr = manager(comm)
    gathered = mgr.allgather(_rows(mgr), seconds)
    rows = [row for per in gathered for row in per]
    header = ("rank", "key", "type", "name", "age")
    table = [header] + [(str(r), "-" if k < 0 else str(k), t, n, a) for r, k, t, n, a in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [
        f"collective_gc: {len(rows)} queued on a communicator of size {mgr.size}, "
        f"after {mgr.sync_count} sync points"
    ]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    text = "\n".join(lines) + "\n"
    out = sys.stdout if isinstance(file, _Stdout) else file
    if out is not None and mgr.rank == 0:
        out.write(text)
        out.flush()
    return text
