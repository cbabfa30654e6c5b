"""Per-rank data loading: prefetch on a thread or in worker processes.

Every rank of a job feeds itself from its own shard (:func:`shard_indices`).
:class:`ProcessPrefetch` runs ``fn(index)`` in spawned worker processes that
never initialize MPI and die with their parent; arrays come back through
reusable shared-memory slots, unmapped through collective_gc's rank-local
reaper once the last array built on them is dead. :class:`ThreadPrefetch` is
the same contract with one background thread. See ``docs/loader.md``.

The names are imported on first use: a worker process imports
``collective_gc.data._worker`` (and through it ``_shm`` and ``_protocol``)
and nothing else of this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._prefetch import ProcessPrefetch
    from ._protocol import LoaderError, RemoteTraceback, WorkerError
    from ._shard import shard_indices
    from ._thread import ThreadPrefetch

__all__ = [
    "LoaderError",
    "ProcessPrefetch",
    "RemoteTraceback",
    "ThreadPrefetch",
    "WorkerError",
    "shard_indices",
]

_HOME = {
    "ProcessPrefetch": "._prefetch",
    "ThreadPrefetch": "._thread",
    "WorkerError": "._protocol",
    "LoaderError": "._protocol",
    "RemoteTraceback": "._protocol",
    "shard_indices": "._shard",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
