"""ProcessPrefetch: ``fn(index)`` in worker processes, arrays through a reusable slot ring.

Worker ``w`` of ``W`` makes the elements at positions ``start + w, start + w +
W, ...`` (``start``: where the loader resumes, 0 unless :meth:`set_state` said
otherwise) and the consumer reads them round-robin, so elements come in the
order of ``indices``. A plain numpy array goes straight into one of the
worker's slots, a shared-memory segment it reuses; any other element is
pickled (protocol 5) with its large contiguous buffers out of band, copied
into a slot. Only a small header crosses the socket; the parent rebuilds the
element with arrays that *view* the slot (no copy).

A slot is reused only after every array built on it is dead: all arrays of an
element view one ``base`` array over the slot, and a weak reference to
``base`` (a lease, see ``_pool``) hands the slot back when it dies; the
mapping itself is unmapped by the rank-local reaper once no slot table and no
lease hold it. ``buffer_size`` bounds how far a worker runs ahead; the slot
allowance lets a worker grow its ring when the consumer keeps elements alive
(``list(loader)`` works), never for freed slots on their way.

Interrupts: KeyboardInterrupt or SystemExit can strike at almost any bytecode
of ``__next__``. Everything it needs to go on lives on the loader and its
handles, never only in a local: the received message stays in the worker's
inbox until its element is handed out, an element made but not returned is
kept in ``_ready``, an error found but not raised in ``_raise_next``. The
moves from one to the next are plain stores (no call, so no interrupt between
them). A message that comes by socket is received, with its descriptor,
into buffers of the handle (see ``_pool``), so no interrupt loses it either;
should the element numbers ever disagree, every later call raises
:class:`LoaderError`.
"""

from __future__ import annotations

import functools
import pickle
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, NoReturn, TypeVar

import numpy as np

from ..local import register
from . import _channel, _leases, _pool
from . import _protocol as P
from ._shm import supported
from ._worker import bootstrapping, preparation

__all__ = ["ProcessPrefetch"]

K = TypeVar("K")
T = TypeVar("T")

_NOTHING: Any = object()  # no element kept in _ready (None is a valid element)
_unpack_head = P.HEAD.unpack_from
_read_mark = P.read_mark
_STATE_VERSION = 1


class _Holder:
    """What the loader's finalizer stops: the pool, once started, and one that
    set_state() retired and not yet stopped. Refers to no loader."""

    __slots__ = ("pool", "retired")

    def __init__(self) -> None:
        self.pool: _pool.Pool | None = None
        self.retired: _pool.Pool | None = None


def _stop(holder: _Holder) -> None:
    _retire(holder)
    if holder.pool is not None:
        _pool.shutdown(holder.pool)


def _retire(holder: _Holder) -> None:
    # Resumable: the pool is forgotten only once its shutdown has returned.
    if holder.retired is not None:
        _pool.shutdown(holder.retired)
        holder.retired = None


class ProcessPrefetch(Generic[T]):
    """Iterate ``fn(i) for i in indices``, computed ahead by ``num_workers`` processes.

    ``fn`` and the items of ``indices`` must be picklable (a module-level
    function, or a callable object of a module-level class; one defined in the
    main script works, since workers re-import it without running its
    ``if __name__ == "__main__":`` part). Elements are numpy arrays, or any
    picklable structure of them and plain values; they arrive in the order of
    ``indices``. Arrays of 4 KiB and more view shared memory, valid for as long
    as you keep them: keeping elements costs memory, never correctness.

    Nothing starts at construction: the workers are spawned (fresh, never
    forked; they never initialize MPI, even under ``mpiexec``) by the first
    ``next()``, and stopped when the iteration ends, on :meth:`close`, when the
    loader is garbage collected, at interpreter exit, or when this process
    dies by any signal, whichever thread made the loader. Whatever ``fn``
    starts in a worker is stopped with it. ``num_workers=0`` runs ``fn`` in
    this process, inside ``next()``: no worker, the same API.

    A single-use iterator. After the last element, an error, or :meth:`close`
    (from any thread, even while another waits in ``next()``), ``next()``
    raises StopIteration. An exception in ``fn`` (or ``worker_init_fn``) is
    re-raised here, as itself when it pickles, else as its own type or
    :class:`WorkerError`, with the worker's traceback as its ``__cause__``; a
    worker that dies raises :class:`WorkerError` with its exit code. Either
    error ends the iteration.

    KeyboardInterrupt or SystemExit inside ``next()`` loses nothing: the next
    call delivers the next element in order. Should that ever fail (the element
    numbers disagree), that call and every later one raise
    :class:`LoaderError`; an epoch is never silently cut short.

    In a process forked from this one (a checkpoint writer), a started
    loader is inert: its ``next()`` raises :class:`LoaderError`, and closing
    or dropping it touches nothing this process's loader uses; the child
    holds none of its descriptors or shared memory (its copies of elements
    are private copies). A loader made in the child works.

    :meth:`get_state` after ``k`` elements, passed to :meth:`set_state` of a
    new loader over the same ``indices``, or of this one between two
    ``next()`` calls (to rewind or skip ahead), makes it deliver element ``k``
    onwards.

    Raises at construction: ValueError (``num_workers`` < 0, ``buffer_size``
    < 1), TypeError (``fn``, ``worker_init_fn`` or ``indices`` cannot be
    pickled), RuntimeError (not Linux, or called while a worker is importing
    the main module: put the loader under ``if __name__ == "__main__":``).

    Args:
        fn: called as ``fn(index)`` in a worker, once per index.
        indices: a sequence (list, range, array) of picklable keys.
        num_workers: worker processes (at most one per element); 0: in-process.
        buffer_size: elements made but not yet consumed, over all workers
            (default: 4 per worker).
        close_timeout: seconds to wait for a worker to exit before SIGKILL.
        worker_init_fn: called as ``worker_init_fn(worker_id)`` in each worker
            before its first element (not in-process, as in PyTorch).
    """

    def __init__(
        self,
        fn: Callable[[K], T],
        indices: Sequence[K],
        *,
        num_workers: int,
        buffer_size: int | None = None,
        close_timeout: float = 2.0,
        worker_init_fn: Callable[[int], object] | None = None,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers must be at least 0, got {num_workers}")
        if buffer_size is None:
            buffer_size = 4 * max(1, num_workers)
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be at least 1, got {buffer_size}")
        if num_workers and not supported():
            raise RuntimeError("ProcessPrefetch needs Linux (memfd_create); use ThreadPrefetch")
        if num_workers and bootstrapping():
            raise RuntimeError(
                "a ProcessPrefetch was created while a worker imports the main module; "
                "create loaders under `if __name__ == '__main__':`"
            )
        self._name = getattr(fn, "__qualname__", type(fn).__qualname__)
        self._fn = fn
        self._indices = indices
        self._n = len(indices)
        self._pos = 0  # elements delivered (or kept in _ready to be)
        self._start = 0  # the position the workers started from
        self._num_workers = num_workers
        self._buffer_size = buffer_size
        self._close_timeout = close_timeout
        self._ready: Any = _NOTHING
        self._raise_next: BaseException | None = None
        self._fault: str | None = None
        self._started = False
        self._launching: _pool.Launch | None = None
        self._closed = False
        self._blob = b""
        if num_workers:
            try:
                # Checked now, so that a bad argument fails here, not in a worker.
                self._blob = pickle.dumps((fn, worker_init_fn), protocol=5)
                pickle.dumps(indices[:1], protocol=5)
            except Exception as exc:
                raise TypeError(
                    f"ProcessPrefetch needs a picklable fn, worker_init_fn and indices: {exc}"
                ) from exc
        self._holder = _Holder()
        self._reg = register(self, _stop, self._holder, name="ProcessPrefetch")

    def __iter__(self) -> ProcessPrefetch[T]:
        return self

    def __enter__(self) -> ProcessPrefetch[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers and wait for them (SIGKILL after ``close_timeout``). Idempotent.

        Any thread: a ``next()`` waiting meanwhile raises StopIteration.
        Elements already handed out stay valid; their memory is released when
        they die.
        """
        self._closed = True
        self._reg.destroy()
        # Again, directly: if an interrupt cut an earlier close short, the
        # registration has run (it runs once) but the shutdown is unfinished.
        _stop(self._holder)

    @property
    def closed(self) -> bool:
        """True once the loader is done: end, error, :meth:`close`."""
        return self._closed

    def get_state(self) -> dict[str, int]:
        """The loader's position, for :meth:`set_state` of a new loader: a dict of ints.

        ``{"version": 1, "position": k, "length": len(indices)}`` after ``k``
        elements were delivered.
        """
        position = self._pos - (self._ready is not _NOTHING)
        return {"version": _STATE_VERSION, "position": position, "length": self._n}

    def set_state(self, state: Mapping[str, int]) -> None:
        """Go to the position saved by :meth:`get_state`: the next ``next()`` delivers it.

        Before the first ``next()`` (resuming a checkpoint in a new loader) or
        between two ``next()`` calls of a live loader, to rewind or skip ahead.
        At the current position nothing changes. Skipping at most
        ``buffer_size`` elements ahead keeps the workers: the elements in
        between, which they make already, are taken and dropped here (an error
        among them is raised here and ends the iteration, as ``next()``
        would). Otherwise the workers are stopped (elements already handed
        out stay valid) and the next ``next()`` starts new ones at the
        position. An interrupt inside it is harmless: call it again.

        Raises RuntimeError if the loader is closed (its end, an error,
        :meth:`close`), ValueError for a state of another version or of
        indices of another length.
        """
        if self._closed:
            raise RuntimeError(f"set_state() on {self!r}: the loader is closed")
        if state.get("version") != _STATE_VERSION or state.get("length") != self._n:
            raise ValueError(
                f"{self!r} cannot resume from state {dict(state)!r}: it needs version "
                f"{_STATE_VERSION} and length {self._n}"
            )
        position = int(state["position"])
        if not 0 <= position <= self._n:
            raise ValueError(f"position {position} is outside 0..{self._n} in {dict(state)!r}")
        holder = self._holder
        current = self.get_state()["position"]
        if position == current and self._fault is None:
            return  # already there: keep the workers and what they made
        pool = holder.pool
        if (
            current < position <= current + self._buffer_size
            and self._started
            and pool is not None
            and not pool.closed
            and self._fault is None
            and self._raise_next is None
        ):
            # Within a buffer ahead: the workers make (or made) these already.
            # Keep them, and take and drop the elements in between; a position
            # is absolute, so a call an interrupt cut short is simply repeated.
            while self.get_state()["position"] < position:
                try:
                    next(self)
                except StopIteration:  # closed meanwhile from another thread
                    return
            return
        _retire(holder)  # one an earlier, interrupted call left
        # Stores only from here to the shutdown (no call, so no interrupt
        # between them): the running pool becomes the retired one, which the
        # next call, next() or the finalizer stops if an interrupt stops us.
        holder.retired = holder.pool
        holder.pool = None
        self._launching = None
        self._started = False
        self._ready = _NOTHING
        self._raise_next = None
        self._fault = None
        self._pos = self._start = position
        _retire(holder)

    def __repr__(self) -> str:
        if self._closed:
            state = "closed"
        elif not self._num_workers:
            state = "in-process"
        elif self._started:
            state = "running"
        else:
            state = "not started"
        pool = self._holder.pool
        workers = len(pool.workers) if pool is not None else 0
        return (
            f"<ProcessPrefetch {self._name} {self._pos}/{self._n} elements, "
            f"{workers} workers, {state}>"
        )

    # -- starting -----------------------------------------------------------------------

    def _launch(self) -> None:
        """Spawn the workers for positions ``_start`` onwards (the first ``next()``).

        Resumable: an interrupt while waiting leaves ``_launching`` for the
        next call to wait on, so start-up is never begun twice. Its work (the
        boot pickles, ``import multiprocessing``, spawning) runs on the
        spawner thread, where no interrupt strikes: here only a few objects
        are made and a request queued, so even interrupts every 50 us let it
        finish.
        """
        launch = self._launching
        if launch is None:
            _retire(self._holder)  # the pool set_state() left, if it was cut short
            remaining = self._n - self._start
            count = max(1, min(self._num_workers, remaining))
            window = -(-self._buffer_size // count)
            prepare = functools.partial(
                _boots, self._blob, self._indices, self._start, count, window
            )
            pool = _pool.Pool([], self._close_timeout)
            launch = _pool.Launch(pool, count, window, prepare)
            # Two stores: an interrupt before them only drops objects that
            # started nothing; after them, the next call resumes this launch.
            self._holder.pool = pool
            self._launching = launch
        if not launch.submitted:
            _pool.submit(launch)  # again after an interrupt: it still runs once
            launch.submitted = True
        # Polled, never Event.wait(): an interrupt that lands inside
        # Event.wait can leave the event's own lock held by this thread; the
        # spawner's set() and every later wait would then block for ever.
        delay = 1e-4
        while not launch.done.is_set():
            if launch.pool.forked:  # the spawner thread is the parent's, not ours
                self._forked(launch.pool)
            time.sleep(delay)
            delay = min(2 * delay, 2e-3)
        self._launching = None
        if launch.error is not None:
            self._holder.pool = None
            _pool.shutdown(launch.pool)
            error, launch.error = launch.error, None
            try:
                raise error
            finally:
                del error
        self._started = True

    # -- iterating ----------------------------------------------------------------------

    def __next__(self) -> T:
        ready = self._ready
        if ready is not _NOTHING:  # made by a call an interrupt cut short
            self._ready = _NOTHING
            return ready  # type: ignore[no-any-return]
        if self._raise_next is not None:
            error, self._raise_next = self._raise_next, None
            del self
            try:
                raise error
            finally:
                del error
        if self._fault is not None:
            raise P.LoaderError(self._fault)
        pos = self._pos
        if pos >= self._n or self._closed:
            self.close()
            raise StopIteration
        if not self._num_workers:
            return self._next_in_process(pos)
        if not self._started:
            self._launch()
        pool = self._holder.pool
        if pool is None or pool.closed:  # closed from another thread as it started
            if pool is not None and pool.forked:
                self._forked(pool)
            self._closed = True
            raise StopIteration
        workers = pool.workers
        count = len(workers)
        offset = pos - self._start
        worker = workers[offset % count]
        mine = offset // count  # the element's number in its worker's share
        # One load: close() from another thread may drop the handle's view, and
        # this local keeps the mapping until we are done with it.
        ring = worker.ring
        entry = (mine % worker.entries) * P.RING_ENTRY
        src: Any
        # Posted in the ring (see _protocol): read in place, no system call.
        if ring is not None and _read_mark(ring, entry)[0] == mine + 1:
            src, at = ring, entry + 8
        else:
            inbox = worker.inbox
            if not (inbox[0] or inbox[1]) and not worker.poll():
                # About to wait: every worker gets what it is owed first, so none
                # idles for want of a credit or a slot while we wait.
                for w in workers:
                    w.flush()
                _leases.release_backlog()
                worker.wait(mine)
            # The ring first: a message on the socket may be the element after it.
            if ring is not None and _read_mark(ring, entry)[0] == mine + 1:
                src, at = ring, entry + 8
            else:
                src, at = worker.inview, 0
        kind, slot, seq, capacity, size, nbuf = _unpack_head(src, at)
        if not kind:  # nothing came, yet the worker is past it (see WorkerHandle.wait)
            self._lost(worker, pos)
        if kind == P.ITEM or kind == P.ARRAY:
            if seq != mine:
                self._lost(worker, pos)
            try:
                element, lease = _build(worker, src, at, kind, slot, seq, capacity, size, nbuf)
            except KeyError:  # its slot table emptied: closed meanwhile from another thread
                if not pool.closed:
                    raise
                self._closed = True
                raise StopIteration from None
            if lease is None and slot >= 0:
                self._lost(worker, pos)
            # Delivered: no call from here to the return, so no interrupt between
            # these stores; an interrupt in flush() leaves the element in _ready.
            if lease is not None:
                lease.delivered = True
            if not at:  # from the inbox (a ring entry stays until the worker rewrites it)
                worker.inview[:4] = _channel.EMPTY
            self._pos = pos + 1
            consumed = worker.consumed = mine + 1
            if consumed - worker.sent_consumed >= worker.batch:
                self._ready = element
                worker.flush()
                self._ready = _NOTHING
            return element  # type: ignore[no-any-return]
        if pool.closed or self._closed:  # closed meanwhile, maybe from another thread
            self._closed = True
            raise StopIteration
        error = self._error(worker, src, at, kind, size)
        self._raise_next = error
        self.close()
        error, self._raise_next = self._raise_next, None
        # The traceback keeps this frame: let it keep neither the loader nor
        # the error itself (that would be a cycle).
        del self, pool, workers, worker
        try:
            raise error
        finally:
            del error

    def _next_in_process(self, pos: int) -> T:
        # An interrupt anywhere here leaves _pos alone: the next call makes the
        # same element again.
        self._started = True
        try:
            element = self._fn(self._indices[pos])
        except Exception:  # as with workers, an error of fn ends the iteration
            self.close()
            raise
        self._pos = pos + 1
        return element

    def _forked(self, pool: _pool.Pool) -> NoReturn:
        self._fault = (
            f"{self!r} belongs to process {pool.owner}, and this process is a child "
            f"forked from it: the parent's workers go on serving the parent (its loader is "
            f"untouched), and cannot be used here; make a new loader in the child"
        )
        raise P.LoaderError(self._fault)

    def _lost(self, worker: _pool.WorkerHandle, pos: int) -> NoReturn:
        if worker.closed and not worker.forked:
            # close() from another thread took the descriptor or the slot table
            # as we built the element: the end, as for any close meanwhile.
            self._closed = True
            raise StopIteration
        self._fault = (
            f"{self!r} lost element {pos}: the message from {worker.describe()} that "
            "carries it, or its slot's descriptor, is missing; the loader cannot go on "
            "in order"
        )
        self.close()
        raise P.LoaderError(self._fault)

    def _error(
        self, worker: _pool.WorkerHandle, src: memoryview, at: int, kind: int, size: int
    ) -> BaseException:
        where = f"{worker.describe()} of {self!r}"
        if kind == P.ERROR:
            start = at + P.HEAD.size
            return P.rebuild_error(bytes(src[start : start + size]), where)
        if kind == _channel.END:  # the worker's end: it died
            text, code = worker.exit_status()
            return P.WorkerError(
                f"{where} {text} before sending element {self._pos}", exitcode=code
            )
        return P.WorkerError(f"{where} sent message kind {kind} for element {self._pos}")


def _boots(blob: bytes, indices: Sequence[Any], start: int, count: int, window: int) -> list[bytes]:
    """Each worker's boot data: what it needs to look like this process, then
    ``fn``, ``worker_init_fn``, its share of ``indices`` from ``start``.

    Run on the spawner thread (see ``_pool.Launch``), never in the loader's.
    """
    fn, init_fn = pickle.loads(blob)
    try:
        prep = pickle.dumps(preparation())
        return [
            prep + pickle.dumps((fn, init_fn, indices[start + w :: count], w, window), protocol=5)
            for w in range(count)
        ]
    except Exception as exc:
        raise TypeError(f"ProcessPrefetch needs picklable indices: {exc}") from exc


def _build(
    worker: _pool.WorkerHandle,
    src: memoryview,
    at: int,
    kind: int,
    slot: int,
    seq: int,
    capacity: int,
    size: int,
    nbuf: int,
) -> tuple[Any, _leases.Lease | None]:
    """The element whose message is at ``src[at:]`` (its inbox or ring entry), and
    the lease of its slot (None if inline).

    ``(None, None)`` with ``slot >= 0``: the segment's descriptor is gone.
    """
    inview = src
    start = at + P.HEAD.size
    if slot < 0:
        return pickle.loads(inview[start : start + size]), None
    if capacity and worker.attached != seq and not worker.attach(slot, capacity, seq):
        return None, None
    view = worker.slots[slot].view
    if kind == P.ARRAY:
        end = start + P.ARRAY_META.size + 8 * nbuf
        meta = bytes(inview[start:end])
        described = _DESCRIBED.get(meta)
        if described is None:
            described = _describe(meta, nbuf)
        dtype, shape, order = described
        # The element's only array views `base`, which views the slot.
        base: np.ndarray[Any, Any] = np.frombuffer(view, dtype, size // dtype.itemsize)
        lease = worker.lease(slot, seq, base)
        return base.reshape(shape, order=order), lease  # type: ignore[call-overload]
    lengths = struct.unpack_from(f"<{nbuf}q", view, P.lengths_offset(size))
    _, offsets, total = P.layout(size, lengths)
    # Every array of the element views `base` (numpy keeps the first non-owning
    # ndarray as the base of views), so `base` dies with the element's last array.
    base = np.frombuffer(view, np.uint8, total)
    lease = worker.lease(slot, seq, base)
    buffers = [base[o : o + n] for o, n in zip(offsets, lengths)]
    return pickle.loads(view[:size], buffers=buffers), lease


# ARRAY descriptions seen, decoded: elements of a stream mostly share one
# dtype and shape, and decoding them (a dtype from its string, above all)
# costs more than the lookup. Bounded: a stream of ever-new shapes only
# refills it.
_DESCRIBED: dict[bytes, tuple[np.dtype[Any], tuple[int, ...], str]] = {}


def _describe(meta: bytes, ndim: int) -> tuple[np.dtype[Any], tuple[int, ...], str]:
    dtype, order = P.ARRAY_META.unpack_from(meta)
    shape = struct.unpack_from(f"<{ndim}q", meta, P.ARRAY_META.size)
    described = (np.dtype(dtype.rstrip(b"\0").decode()), shape, order.decode())
    if len(_DESCRIBED) >= 256:
        _DESCRIBED.clear()
    _DESCRIBED[meta] = described
    return described
