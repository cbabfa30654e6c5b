"""ProcessPrefetch: ``fn(index)`` in worker processes, arrays through a reusable slot ring.

Worker ``w`` of ``W`` makes the elements at positions ``w, w + W, ...`` and
the consumer reads them round-robin, so elements come in the order of
``indices``. Each element is pickled (protocol 5) with its large contiguous
buffers (numpy arrays) out of band: the worker copies them into one of its
slots, a shared-memory segment it reuses, and sends only a small header; the
parent rebuilds the element with arrays that *view* the slot (no copy).

A slot is reused only after every array built on it is dead: all arrays of an
element view one uint8 ``base`` array over the slot, and a weak reference to
``base`` (a lease, see ``_pool``) hands the slot back when it dies; the
mapping itself is unmapped by the rank-local reaper once no slot table and no
lease hold it. Credits bound how far a worker runs ahead (``buffer_size``);
the slot allowance lets a worker grow its ring when the consumer keeps
elements alive (``list(loader)`` works), never for freed slots on their way.
"""

from __future__ import annotations

import pickle
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from .._reaper import register
from . import _pool
from . import _protocol as P
from ._shm import supported
from ._worker import bootstrapping, preparation

__all__ = ["ProcessPrefetch"]

K = TypeVar("K")
T = TypeVar("T")


class ProcessPrefetch(Generic[T]):
    """Iterate ``fn(i) for i in indices``, computed ahead by ``num_workers`` processes.

    ``fn`` and the items of ``indices`` must be picklable (a module-level
    function, or a callable object of a module-level class; one defined in the
    main script works, since workers re-import it without running its
    ``if __name__ == "__main__":`` part). Elements are numpy arrays, or any
    picklable structure of them and plain values; they arrive in the order of
    ``indices``. Arrays of 4 KiB and more view shared memory, valid for as long
    as you keep them: keeping elements costs memory, never correctness.

    Workers are started at construction (spawned fresh, never forked; they
    never initialize MPI, even under ``mpiexec``), and stopped when the
    iteration ends, on :meth:`close`, when the loader is garbage collected, at
    interpreter exit, or when this process dies by any signal.

    A single-use iterator. After the last element, an error, or :meth:`close`,
    ``next()`` raises StopIteration. An exception in ``fn`` is re-raised here,
    as its own type when possible, with the worker's traceback text in the
    message; a worker that dies raises :class:`WorkerError` with its exit code.
    Either error ends the iteration.

    Raises at construction: ValueError (``num_workers`` or ``buffer_size`` < 1),
    TypeError (``fn`` or ``indices`` cannot be pickled), RuntimeError (not
    Linux, or called while a worker is importing the main module: put the
    loader under ``if __name__ == "__main__":``).

    Args:
        fn: called as ``fn(index)`` in a worker, once per index.
        indices: a sequence (list, range, array) of picklable keys.
        num_workers: worker processes (at most one per element).
        buffer_size: elements made but not yet consumed, over all workers
            (default: 4 per worker).
        close_timeout: seconds to wait for a worker to exit before SIGKILL.
    """

    def __init__(
        self,
        fn: Callable[[K], T],
        indices: Sequence[K],
        *,
        num_workers: int,
        buffer_size: int | None = None,
        close_timeout: float = 2.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        if buffer_size is None:
            buffer_size = 4 * num_workers
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be at least 1, got {buffer_size}")
        if not supported():
            raise RuntimeError("ProcessPrefetch needs Linux (memfd_create); use ThreadPrefetch")
        if bootstrapping():
            raise RuntimeError(
                "a ProcessPrefetch was created while a worker imports the main module; "
                "create loaders under `if __name__ == '__main__':`"
            )
        self._name = getattr(fn, "__qualname__", type(fn).__qualname__)
        self._n = len(indices)
        self._pos = 0
        num_workers = max(1, min(num_workers, self._n))
        window = -(-buffer_size // num_workers)
        try:
            configs = [
                pickle.dumps((fn, indices[w::num_workers], w, window), protocol=5)
                for w in range(num_workers)
            ]
        except Exception as exc:
            raise TypeError(f"ProcessPrefetch needs a picklable fn and indices: {exc}") from exc
        prep = pickle.dumps(preparation())
        env = _pool.child_environment()
        # PR_SET_PDEATHSIG fires when the *thread* that started a worker exits:
        # only the main thread lives as long as the process.
        pdeathsig = threading.current_thread() is threading.main_thread()
        workers: list[_pool.WorkerHandle] = []
        self._pool = _pool.Pool(workers, close_timeout)
        try:
            for w in range(num_workers if self._n else 0):
                workers.append(_pool.WorkerHandle.spawn(w, window, pdeathsig, env))
            for handle, config in zip(workers, configs):
                handle.send_boot(prep, config)
        except BaseException:
            _pool.shutdown(self._pool)
            raise
        _pool.track(self._pool)
        self._reg = register(self, _pool.shutdown, (self._pool,), {}, "ProcessPrefetch")

    def __iter__(self) -> ProcessPrefetch[T]:
        return self

    def __enter__(self) -> ProcessPrefetch[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers and wait for them (SIGKILL after ``close_timeout``). Idempotent.

        Elements already handed out stay valid; their memory is released when
        they die.
        """
        self._reg.destroy()

    @property
    def closed(self) -> bool:
        """True once the workers are stopped (end, error, :meth:`close`)."""
        return self._pool.closed

    def __repr__(self) -> str:
        state = "closed" if self._pool.closed else "open"
        return (
            f"<ProcessPrefetch {self._name} {self._pos}/{self._n} elements, "
            f"{len(self._pool.workers)} workers, {state}>"
        )

    def __next__(self) -> T:
        pool = self._pool
        if self._pos >= self._n or pool.closed:
            self.close()
            raise StopIteration
        worker = pool.workers[self._pos % len(pool.workers)]
        message = worker.recv(block=False)
        if message is False:
            # About to wait: every worker gets what it is owed first, so none
            # idles for want of a credit or a slot while we wait.
            for w in pool.workers:
                w.flush()
            message = worker.recv(block=True)
        assert message is not False  # recv(block=True) never returns False
        if message is None or message[0] != P.ITEM:
            error = self._error(worker, message)
            self.close()
            # The traceback keeps this frame: let it keep neither the loader nor
            # the error itself (that would be a cycle).
            del self, pool, worker, message
            try:
                raise error
            finally:
                del error
        try:
            element: T = _build(worker, message)
        except BaseException:
            self.close()
            del self, pool, worker, message
            raise
        self._pos += 1
        worker.grant()
        return element

    def _error(self, worker: _pool.WorkerHandle, message: _pool.Message | None) -> BaseException:
        where = f"{worker.describe()} of {self!r}"
        if message is None:
            text, code = worker.exit_status()
            return P.WorkerError(
                f"{where} {text} before sending element {self._pos}", exitcode=code
            )
        if message[0] == P.ERROR:
            return P.rebuild_error(bytes(message[5]), where)
        return P.WorkerError(f"{where} sent message kind {message[0]} for element {self._pos}")


def _build(worker: _pool.WorkerHandle, message: _pool.Message) -> Any:
    _, slot, capacity, pickle_len, nbuf, inline, fd = message
    if fd >= 0:
        worker.attach(slot, fd, capacity)
    if slot < 0:
        return pickle.loads(inline)
    view = worker.slots[slot].view
    lengths = struct.unpack_from(f"<{nbuf}q", view, P.lengths_offset(pickle_len))
    _, offsets, total = P.layout(pickle_len, lengths)
    # Every array of the element views `base` (numpy keeps the first non-owning
    # ndarray as the base of views), so `base` dies with the element's last array.
    base: np.ndarray[Any, Any] = np.frombuffer(view, np.uint8, total)
    worker.lease(slot, base)
    buffers = [base[o : o + n] for o, n in zip(offsets, lengths)]
    return pickle.loads(view[:pickle_len], buffers=buffers)
