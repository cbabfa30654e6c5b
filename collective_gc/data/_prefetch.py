"""ProcessPrefetch: ``fn(index)`` in worker processes, arrays through a reusable slot ring.

Worker ``w`` of ``W`` makes the elements at positions ``start + w, start + w +
W, ...`` (``start``: where the running pool started, 0 unless
:meth:`set_state` said otherwise) and the consumer reads them round-robin,
so elements come in the order of ``indices``. A plain numpy array goes
straight into one of the worker's slots, a shared-memory segment it reuses;
any other element is pickled (protocol 5) with its large contiguous buffers
out of band, copied into a slot. Only a small header crosses (the ring or
the socket, see ``_channel``); the parent rebuilds the element with arrays
that *view* the slot (no copy).

A slot is reused only after every array built on it is dead: all arrays of an
element view one ``base`` array over the slot, and a weak reference to
``base`` (a lease, see ``_leases``) hands the slot back when it dies; the
mapping itself is unmapped by the rank-local reaper once no slot table and no
lease hold it. ``buffer_size`` bounds how far a worker runs ahead; the slot
allowance lets a worker grow its ring when the consumer keeps elements alive
(``list(loader)`` works), never for freed slots on their way.

Interrupts, ``close()`` and forks: NOTE [ Loader shutdown and interrupts ]
in ``_loader``.
"""

from __future__ import annotations

import functools
import pickle
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

import numpy as np

from . import _channel, _leases, _pool
from . import _protocol as P
from ._loader import NOTHING, STATE_VERSION, Loader
from ._shm import supported
from ._worker import bootstrapping, preparation

__all__ = ["ProcessPrefetch"]

K = TypeVar("K")
T = TypeVar("T")

_unpack_head = P.HEAD.unpack_from
_read_mark = P.read_mark
_read_word = P.WORD.unpack_from
_store_word = P.WORD.pack_into


class ProcessPrefetch(Loader[T, _pool.Pool]):
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
        num_workers: worker processes (at most one per element); 0: none,
            ``fn`` runs on the thread that calls ``next()``, inside it, one
            element per call (and need not pickle), as PyTorch's
            ``num_workers=0``.
        buffer_size: elements made but not yet consumed, over all workers
            (default: 4 per worker); nothing is made ahead in-process.
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
        self._extra_state = {"length": self._n}
        self._num_workers = num_workers
        self._buffer_size = buffer_size
        self._close_timeout = close_timeout
        self._raise_next: BaseException | None = None  # an error found, not yet raised
        self._fault: str | None = None  # why every next() raises LoaderError
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
        # The running part is a _pool.Pool (None until the first next()).
        self._setup(_pool.shutdown, "ProcessPrefetch")

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
        self._holder.stop(None)

    def _position_in(self, state: Mapping[str, int]) -> int:
        if state.get("version") != STATE_VERSION or state.get("length") != self._n:
            raise ValueError(
                f"{self!r} cannot resume from state {dict(state)!r}: it needs version "
                f"{STATE_VERSION} and length {self._n}"
            )
        position = int(state["position"])
        if not 0 <= position <= self._n:
            raise ValueError(f"position {position} is outside 0..{self._n} in {dict(state)!r}")
        return position

    def _move_to(self, position: int) -> None:
        # At the position, or at most a buffer ahead: keep the workers (they
        # make those elements already) and take the ones in between, an error
        # among them raised as next() would. Otherwise a new pool, started by
        # the next next() at the position.
        current = self.get_state()["position"]
        if position == current and self._fault is None:
            return  # already there: keep the workers and what they made
        pool = self._holder.running
        if (
            current < position <= current + self._buffer_size
            and pool is not None
            and pool.ready
            and not pool.closed
            and self._fault is None
            and self._raise_next is None
        ):
            self._take_up_to(position)
            return
        # Both are about the running pool, which goes: harmless to clear
        # before it does (a next() meanwhile finds the same again).
        self._raise_next = None
        self._fault = None
        self._restart(position)

    def __repr__(self) -> str:
        pool = self._holder.running
        if self._closed:
            state = "closed"
        elif not self._num_workers:
            state = "in-process"
        elif pool is not None and pool.ready:
            state = "running"
        else:
            state = "not started"
        workers = len(pool.workers) if pool is not None else 0
        return (
            f"<ProcessPrefetch {self._name} {self._pos}/{self._n} elements, "
            f"{workers} workers, {state}>"
        )

    # -- starting -----------------------------------------------------------------------

    def _launch(self) -> _pool.Pool:
        """Spawn the workers for positions ``_start`` onwards (the first ``next()``).

        Resumable: the holder keeps the pool from before it is submitted, so
        a call an interrupt stopped while it waits is resumed by the next
        one, never begun twice. Its work (the boot pickles, ``import
        multiprocessing``, spawning) runs on the spawner thread: here only a
        few objects are made and a request queued, so even interrupts every
        50 us let it finish (NOTE [ Loader shutdown and interrupts ] in
        ``_loader``, rules 1, 4 and 6).
        """
        holder = self._holder
        pool = holder.running
        if pool is None:
            holder.retire()  # the pool set_state() left, if it was cut short
            remaining = self._n - self._start
            count = max(1, min(self._num_workers, remaining))
            window = -(-self._buffer_size // count)
            prepare = functools.partial(
                _boots, self._blob, self._indices, self._start, count, window
            )
            pool = _pool.Pool(count, window, prepare, self._close_timeout)
            holder.running = pool  # one store: from here the next call resumes this start-up
        if not pool.submitted:
            _pool.submit(pool)  # again after an interrupt: it still starts once
            pool.submitted = True
        # Polled, never Event.wait() (rule 4).
        delay = 1e-4
        while not pool.done.is_set():
            if pool.forked:  # the spawner thread is the parent's, not ours
                self._forked(pool)
            time.sleep(delay)
            delay = min(2 * delay, 2e-3)
        if pool.error is not None:
            # The failed pool is stopped; the next next() starts another.
            self._restart(self._start)
            error, pool.error = pool.error, None
            try:
                raise error
            finally:
                del error
        pool.ready = True
        return pool

    # -- iterating ----------------------------------------------------------------------

    def __next__(self) -> T:
        ready = self._ready
        if ready is not NOTHING:  # made by a call an interrupt cut short
            self._ready = NOTHING
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
            # In-process. An interrupt anywhere here leaves _pos alone: the
            # next call makes the same element again.
            try:
                element = self._fn(self._indices[pos])
            except Exception:  # as with workers, an error of fn ends the iteration
                self.close()
                del self  # the traceback keeps this frame: not the loader
                raise
            self._pos = pos + 1
            return element
        pool = self._holder.running
        if pool is None or not pool.ready:
            pool = self._launch()
        if pool.closed:  # closed from another thread as it started
            if pool.forked:
                self._forked(pool)
            self._closed = True
            raise StopIteration
        workers = pool.workers
        count = len(workers)
        offset = pos - self._start
        worker = workers[offset % count]
        # The per-element path talks to the channel: one more attribute load
        # than a handle that was its own channel, a few ns of the microseconds
        # an element costs.
        channel = worker.channel
        mine = offset // count  # the element's number in its worker's share
        # One load: close() from another thread may drop the channel's view, and
        # this local keeps the mapping until we are done with it.
        ring = channel.ring
        entry = (mine % channel.entries) * P.RING_ENTRY
        src: Any
        # Posted in the ring (see _protocol): read in place, no system call.
        if ring is not None and _read_mark(ring, entry)[0] == mine + 1:
            src, at = ring, entry + 8
        else:
            inbox = channel.inbox
            if not (inbox[0] or inbox[1]) and not channel.poll():
                # About to wait: every worker gets what it is owed first, so none
                # idles for want of a credit or a slot while we wait.
                for w in workers:
                    w.channel.flush()
                _leases.release_backlog()
                channel.wait(mine)
            # The ring first: a message on the socket may be the element after it.
            if ring is not None and _read_mark(ring, entry)[0] == mine + 1:
                src, at = ring, entry + 8
            else:
                src, at = channel.inview, 0
        kind, slot, seq, capacity, size, nbuf = _unpack_head(src, at)
        if not kind:  # nothing came, yet the worker is past it (see Channel.wait)
            self._lost(worker, pos)
        if kind == P.ITEM or kind == P.ARRAY:
            if seq != mine:
                self._lost(worker, pos)
            try:
                element, lease = _build(channel, src, at, kind, slot, seq, capacity, size, nbuf)
            except KeyError:  # its slot table emptied: closed meanwhile from another thread
                if not pool.closed:
                    raise
                self._closed = True
                raise StopIteration from None
            if lease is None and slot >= 0:
                self._lost(worker, pos)
            consumed = mine + 1
            need = 0
            if ring is not None:
                # CONSUMED once per element, a store (an element dropped by an
                # interrupt after it is built again from the same slot and entry,
                # which the worker rewrites only after two more), and a look at
                # whether the worker sleeps until it (see _protocol, "Doorbells").
                _store_word(ring, channel.control + P.CONSUMED_AT, consumed)
                need = _read_word(ring, channel.control + P.SLEEP_AT)[0]
            # Delivered: plain stores to the return (rule 2 of the NOTE in
            # _loader); an interrupt in flush() leaves the element in _ready.
            if lease is not None:
                lease.delivered = True
            if not at:  # from the inbox (a ring entry stays until the worker rewrites it)
                channel.inview[:4] = _channel.EMPTY
            self._pos = pos + 1
            channel.consumed = consumed
            if consumed - channel.sent_consumed >= channel.batch or (
                need and need != channel.rang and (need < 0 or need <= consumed)
            ):
                self._ready = element
                channel.flush()
                self._ready = NOTHING
            return element
        if pool.closed or self._closed:  # closed meanwhile, maybe from another thread
            self._closed = True
            raise StopIteration
        error = self._error(worker, src, at, kind, size)
        self._raise_next = error
        self.close()
        error, self._raise_next = self._raise_next, None
        # The traceback keeps this frame: let it keep neither the loader nor
        # the error itself (that would be a cycle).
        del self, pool, workers, worker, channel
        try:
            raise error
        finally:
            del error

    def _forked(self, pool: _pool.Pool) -> NoReturn:
        self._fault = (
            f"{self!r} belongs to process {pool.owner}, and this process is a child "
            f"forked from it: the parent's workers go on serving the parent (its loader is "
            f"untouched), and cannot be used here; make a new loader in the child"
        )
        raise P.LoaderError(self._fault)

    def _lost(self, worker: _pool.WorkerHandle, pos: int) -> NoReturn:
        if worker.closed and not worker.process.forked:
            # close() from another thread took the descriptor or the slot table
            # as we built the element: the end, as for any close meanwhile.
            self._closed = True
            raise StopIteration
        self._fault = (
            f"{self!r} lost element {pos}: the message from {worker.process.name} that "
            "carries it, or its slot's descriptor, is missing; the loader cannot go on "
            "in order"
        )
        self.close()
        raise P.LoaderError(self._fault)

    def _error(
        self, worker: _pool.WorkerHandle, src: memoryview, at: int, kind: int, size: int
    ) -> BaseException:
        where = f"{worker.process.name} of {self!r}"
        if kind == P.ERROR:
            start = at + P.HEAD.size
            return P.rebuild_error(bytes(src[start : start + size]), where)
        if kind == _channel.END:  # the worker's end: it died
            text, code = worker.process.exit_status()
            return P.WorkerError(
                f"{where} {text} before sending element {self._pos}", exitcode=code
            )
        return P.WorkerError(f"{where} sent message kind {kind} for element {self._pos}")


def _boots(blob: bytes, indices: Sequence[Any], start: int, count: int, window: int) -> list[bytes]:
    """Each worker's boot data: what it needs to look like this process, then
    ``fn``, ``worker_init_fn``, its share of ``indices`` from ``start``.

    Run on the spawner thread (see ``_pool.Pool``), never in the loader's.
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
    channel: _channel.Channel,
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
    if capacity and channel.attached != seq and not channel.attach(slot, capacity, seq):
        return None, None
    slots = channel.slots
    view = slots.segments[slot].view
    if kind == P.ARRAY:
        end = start + P.ARRAY_META.size + 8 * nbuf
        meta = bytes(inview[start:end])
        described = _DESCRIBED.get(meta)
        if described is None:
            described = _describe(meta, nbuf)
        dtype, shape, order = described
        # The element's only array views `base`, which views the slot.
        base: np.ndarray[Any, Any] = np.frombuffer(view, dtype, size // dtype.itemsize)
        lease = slots.lease(slot, seq, base)
        return base.reshape(shape, order=order), lease  # type: ignore[call-overload]
    lengths = struct.unpack_from(f"<{nbuf}q", view, P.lengths_offset(size))
    _, offsets, total = P.layout(size, lengths)
    # Every array of the element views `base` (numpy keeps the first non-owning
    # ndarray as the base of views), so `base` dies with the element's last array.
    base = np.frombuffer(view, np.uint8, total)
    lease = slots.lease(slot, seq, base)
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
