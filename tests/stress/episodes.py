"""The fault scenarios ("episodes") of one stress seed.

Each episode is collective over the world communicator, draws what every rank
must do alike from ``ctx.shared`` and what may differ per rank (drop order,
timing, thread interleaving) from ``ctx.mine``, and records defects in the
ledger (see :mod:`.ledger` for the classes). Sync points of an episode always
carry a deadline, so a hang inside the library becomes a ``CollectiveTimeoutError``
the harness can report and move past; the checkpoints that compare the ranks
have a deadline of their own, and the harness's watchdog is the last net.

What a correct library must do here (issue 11):

- a destroy raising ``KeyboardInterrupt``/``SystemExit`` on one rank: every rank
  leaves the sync point; the interrupt is re-raised where it happened; the
  family's next sync point raises ``DestroyError`` naming it on every rank
  (as for any failed destroy: a sync point's failures are agreed by the
  family's next collective); the one after works;
- a timeout on any rank makes the manager unusable on every rank
  (``CollectiveGCError`` on later syncs), and no rank reports OK for a sync
  point the others abandoned;
- nothing queued is lost, whatever a destroy calls (detach, pending, view,
  register, dropping other objects);
- registration from several threads on a size-1 communicator and rank-local
  (``comm=None``) is safe: unique keys, no lost or early destroy, and no
  refusal because another thread is running destroys; on a communicator of
  size > 1 two threads registering at once is erroneous, and may be refused
  (``RegistrationError`` naming both threads), never hang;
- diagnostics never change what a sync point sees (strict mode still raises),
  and never fail while other threads register: ``view`` from any thread, also
  with the PETSc adapter's hooks installed (which walk the live registrations'
  destroy arguments, data those other threads are changing).

Episodes: threads (defects 1, 11), interrupt (3), meddle (8), late (4),
freed (2), strict (9), args (10, 12), racing (the erroneous case of 1),
storm (issue 25: signal handlers raising anywhere in sync points, drains and
destroys; every rank runs every sync point and nothing is lost), sparse
(issue 25, defect 4: long-lived keys spread far wider than the agreement's
window, so that its fallback intersection runs).
``run_faults`` draws which of them a seed runs.
"""

from __future__ import annotations

import array
import functools
import gc
import hashlib
import random
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

import collective_gc as cgc

from .ledger import Holders, Ledger, Obj, exchange

INTERRUPTS = ("KeyboardInterrupt", "SystemExit")
_RAISABLE: dict[str, type[BaseException]] = {
    "KeyboardInterrupt": KeyboardInterrupt,
    "SystemExit": SystemExit,
    "RuntimeError": RuntimeError,
}


@dataclass
class Res:
    """How one rank left one sync point."""

    kind: str  # "ok", or the exception's type name
    text: str
    destroyed: int
    seconds: float


def sync(comm: MPI.Comm, timeout: float | None, generation: int | None = 2) -> Res:
    """``cgc.collect`` with everything it may raise caught and described."""
    t0 = time.monotonic()
    try:
        stats = cgc.collect(comm, generation=generation, timeout=timeout)
    except BaseException as exc:  # interrupts too: they are what is injected
        return Res(type(exc).__name__, str(exc)[:600], -1, time.monotonic() - t0)
    return Res("ok", "", stats.destroyed, time.monotonic() - t0)


class Ctx:
    """What the episodes of one seed share."""

    def __init__(
        self,
        world: MPI.Intracomm,
        seed: int,
        ledger: Ledger,
        hang_timeout: float,
        arm: Callable[[str, float], None],
        big: bool = True,
    ) -> None:
        self.world = world
        self.rank = world.Get_rank()
        self.size = world.Get_size()
        self.seed = seed
        self.ledger = ledger
        self.hang_timeout = hang_timeout
        # A checkpoint may wait for a rank that waits out a full sync deadline.
        self.ck_timeout = 2 * hang_timeout + 15
        self.arm = arm
        self.shared = random.Random(seed)
        self.mine = random.Random(seed * 7919 + self.rank + 1)
        self.ck = world.Dup()  # the harness's own traffic, never the library's
        # Whether episodes may run at the scale of a report (the sparse
        # episode's ~700k registrations, tens of seconds): off in make test.
        self.big = big

    def checkpoint(self, what: str, value: Any) -> list[Any]:
        self.arm(f"{self.ledger.episode}: checkpoint {what}", self.ck_timeout + 10)
        return exchange(self.ck, value, self.ck_timeout, f"{self.ledger.episode}: {what}")

    def close(self) -> None:
        self.ck.Free()


def judge(
    ctx: Ctx,
    what: str,
    res: Res,
    label: str,
    expect: Callable[[int, list[Any]], set[str]] | None = None,
    extra: Any = None,
    same_logs: bool = True,
    digest: bool = False,
) -> list[Any]:
    """Compare one sync point's outcome across ranks (a checkpoint); rank 0 records.

    ``expect(rank, gathered)`` gives the outcome kinds acceptable on ``rank``
    (default: only "ok"). The destroy logs and in-destroy events of ``label``
    must be equal on every rank (unless ``same_logs`` is False: the program
    itself was erroneous). ``digest``: the logs travel as their length and a
    hash (for the sparse episode's hundreds of thousands of destroys). Returns
    what every rank sent.
    """
    L = ctx.ledger
    log = L.log.get(label, [])
    sent: Any = _digest(log) if digest else list(log)
    mine = (res, sent, list(L.events.get(label, ())), extra)
    got = ctx.checkpoint(what, mine)
    if ctx.rank != 0:
        return got
    kinds = [g[0].kind for g in got]
    shown = ", ".join(
        f"r{q}={g[0].kind}" + (f"({g[0].seconds:.1f}s)" if g[0].seconds > 1 else "")
        for q, g in enumerate(got)
    )
    bad = [q for q in range(ctx.size) if kinds[q] not in (expect or _only_ok)(q, got)]
    if bad:
        timed_out = [q for q in bad if kinds[q] == "CollectiveTimeoutError"]
        detail = next((g[0].text for q, g in enumerate(got) if q in bad and g[0].text), "")
        if timed_out:
            L.defect("hang", f"{what}: rank(s) {timed_out} timed out [{shown}] {detail[:300]}")
        if len(set(kinds)) > 1:
            L.defect("disagree", f"{what}: [{shown}] {detail[:300]}")
        elif not timed_out:
            L.defect("error", f"{what}: unexpected on every rank [{shown}] {detail[:300]}")
    oks = {g[0].destroyed for g in got if g[0].kind == "ok"}
    if len(oks) > 1:
        L.defect("disagree", f"{what}: ranks report different destroy counts {sorted(oks)}")
    if same_logs and any(g[1] != got[0][1] for g in got):
        lens = [g[1][0] if digest else len(g[1]) for g in got]
        L.defect("disagree", f"{what}: destroy logs of {label} differ (lengths {lens})")
    if any(g[2] != got[0][2] for g in got):
        L.defect("disagree", f"{what}: actions inside destroys differ: {[g[2][-3:] for g in got]}")
    return got


def _digest(log: list[int]) -> tuple[int, str]:
    return len(log), hashlib.blake2b(array.array("q", log).tobytes(), digest_size=16).hexdigest()


def _only_ok(rank: int, got: list[Any]) -> set[str]:
    return {"ok"}


def _injected_only(text: str) -> bool:
    """Whether a DestroyError's text lists only failures this harness injected."""
    rows = [line for line in text.splitlines() if line.startswith("  rank ")]
    return bool(rows) and all("injected" in line for line in rows)


def _reports_injected(res: Res) -> bool:
    """A sync point that reported (on every rank) destroys the harness made
    fail at an earlier one: what a correct library does."""
    return res.kind == "DestroyError" and _injected_only(res.text)


def final_collects(ctx: Ctx, comm: MPI.Comm, label: str, what: str) -> bool:
    """Drop-everything epilogue: agreed collects until one destroys nothing.

    Destroys may free further managed objects, hence several rounds; the
    count destroyed is agreed, so every rank leaves the loop together.
    Returns False if a sync point failed (the lost check is then meaningless).
    """
    gc.collect()
    for round_ in range(8):
        res = sync(comm, ctx.hang_timeout)
        got = judge(ctx, f"{what} final collect {round_}", res, label)
        # Decided on what every rank sent, so that every rank leaves alike.
        if any(g[0].kind != "ok" for g in got):
            return False
        if max(g[0].destroyed for g in got) == 0:
            return True
    return True


class EpisodeAbandoned(Exception):
    """An episode cannot go on (its defect is recorded already)."""


def local_calls(ctx: Ctx, comm: MPI.Comm) -> None:
    """Calls documented as local, on some ranks only (issue 11, defect 10), on a
    communicator nothing was registered on yet: they must send no message
    (a hidden first-use duplicate would leave this rank waiting for the others)."""
    ctx.arm(f"{ctx.ledger.episode}: local calls on a fresh communicator", 30.0)
    if ctx.mine.random() < 0.5:
        cgc.pending(comm)
        cgc.current_scope(comm)
    # The program's own collective next, on every rank: a message those calls
    # sent on some ranks only would pair with it instead.
    req = comm.Ibarrier()
    deadline = time.monotonic() + ctx.hang_timeout
    while not req.Test():
        if time.monotonic() > deadline:
            ctx.ledger.defect(
                "hang",
                "a barrier of the program's own after pending()/current_scope() on some "
                f"ranks only did not complete in {ctx.hang_timeout} s: those local calls "
                "made a collective call",
            )
            raise EpisodeAbandoned  # the communicator's collectives are out of step
        time.sleep(1e-3)


def bad_args(ctx: Ctx) -> None:
    """``collect(timeout=...)`` with a bad value on every rank (issue 11, defect
    12): ValueError (or TypeError) before any collective, and the manager still
    works afterwards (its objects destroyed, none lost)."""
    L = ctx.ledger
    L.episode = "args"
    label = "args"
    ctx.arm("args", ctx.ck_timeout * 4)
    comm = ctx.world.Dup()
    local_calls(ctx, comm)
    holders = Holders(L.make(comm, label)[0] for _ in range(ctx.shared.randrange(1, 5)))
    _drop_some(holders, ctx.mine, 0.5)
    bad = ctx.shared.choice((-1.0, 0.0, float("nan")))
    res = sync(comm, bad)

    def refused(q: int, got: list[Any]) -> set[str]:
        return {"ValueError", "TypeError"}

    judge(ctx, f"collect(timeout={bad})", res, label, refused)
    res = sync(comm, ctx.hang_timeout)
    judge(ctx, f"the sync after collect(timeout={bad})", res, label)
    holders.clear()
    if final_collects(ctx, comm, label, "args"):
        check_lost_everywhere(ctx, label)
    else:
        L.exempt.update(L.tokens(label))
    comm.Free()


def _raiser(
    fired: list[str] | dict[int, list[str]], kind: str, label: str, token: int
) -> Callable[[], None]:
    """A destroy action raising ``kind``, noted in ``fired`` (per thread if a dict:
    in the threads episode any thread's sync point may run it)."""

    def fire() -> None:
        if isinstance(fired, dict):
            fired.setdefault(threading.get_ident(), []).append(kind)
        else:
            fired.append(kind)
        raise _RAISABLE[kind](f"injected {kind} in the destroy of {label}#{token}")

    return fire


def _diag_error(who: str, exc: Exception, where: str) -> str:
    at = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{who}: diagnostics{where}: {type(exc).__name__}: {exc} (at {at.filename}:{at.lineno})"


def _join_registrars(ctx: Ctx, workers: Iterable[threading.Thread]) -> None:
    # A registering thread still running after the hang timeout is a hang.
    for t in workers:
        t.join(ctx.hang_timeout)
        if t.is_alive():
            ctx.ledger.defect(
                "hang", f"a registering thread did not finish in {ctx.hang_timeout} s"
            )


def _find_cycles_of_one(holders: Iterable[Any]) -> None:
    # A function of its own: a local bound to a live object in the episode's
    # frame would keep it alive on this rank only, and its destroy would
    # rightly never run.
    for obj in holders:
        if obj is not None:
            cgc.find_cycles(obj, max_depth=4)
            return


def check_lost_everywhere(ctx: Ctx, *labels: str) -> None:
    """Collective objects: lost if dead on every rank and never destroyed.

    (One alive on some rank is rightly still pending elsewhere.)
    """
    got = ctx.checkpoint("lost check", ctx.ledger.lost_tokens(*labels))
    common = set(got[0]).intersection(*got[1:])
    if ctx.rank == 0:  # one report for every rank
        ctx.ledger.report_lost(sorted(common), " on any rank")


def _self_loops(holders: list[Any]) -> None:
    # A function of its own, so that no loop variable of the caller keeps an object alive.
    for obj in holders:
        obj.refs.append(obj)


def _drop_some(holders: list[Any], rng: random.Random, share: float) -> None:
    for j in range(len(holders)):
        if holders[j] is not None and rng.random() < share:
            holders[j] = None


def _link(holders: list[Any], rng: random.Random, cycles: int) -> None:
    """Random reference cycles between the objects (decided by ``rng``)."""
    n = len(holders)
    for _ in range(cycles):
        members = [holders[rng.randrange(n)] for _ in range(rng.randrange(1, 5))]
        for a, b in zip(members, members[1:] + members[:1]):
            a.refs.append(b)


# -- threads: registration and drops from several threads (issue 11, defect 1) --


def _petsc_hooks(ctx: Ctx) -> Any:
    """``collective_gc.petsc`` if this rank's threads episode is to install its
    hooks, else None (always None without petsc4py: pip-only stacks).

    The hooks make ``view`` walk, from every live registration's destroy and
    arguments (here the ledger, whose dicts other threads are changing), the
    paths to its owner: what a program using the PETSc adapter does when it
    calls ``view`` from several threads. Drawn from a generator of its own, so
    that every other draw of the seed stays what it was without this one.
    """
    if random.Random(f"threads/petsc-hooks/{ctx.seed}/{ctx.rank}").random() >= 0.5:
        return None
    try:
        import collective_gc.petsc as cgc_petsc
    except ImportError:
        return None
    return cgc_petsc


def threads(ctx: Ctx) -> None:
    """Worker threads register and drop on a size-1 communicator and rank-local,
    while the main thread runs sync points (some of whose destroys raise
    interrupts) and diagnostics on the same communicator. On a fresh duplicate,
    some seeds install the PETSc adapter's hooks there first (when petsc4py is
    installed), so that ``view`` also walks the live registrations' destroy
    arguments while the other threads change them."""
    L = ctx.ledger
    L.episode = "threads"
    ctx.arm("threads", ctx.hang_timeout * 3 + 30)
    # COMM_SELF itself (one manager for the whole run), or a fresh duplicate
    # (a fresh manager, whose first use comes from several threads at once).
    own = ctx.mine.random() < 0.7
    sc = MPI.COMM_SELF.Dup() if own else MPI.COMM_SELF
    # PETSc's hooks on that duplicate only: installed on COMM_SELF they would
    # stay for every later seed of the job (there is no uninstall), and a seed
    # would no longer do the same thing when run alone.
    hooks = _petsc_hooks(ctx) if own else None
    if hooks is not None:
        hooks.install(sc)
    where = " (PETSc hooks installed)" if hooks is not None else ""
    label, rl = "self", "reaper"
    nthreads = ctx.mine.randrange(2, 5)
    per = ctx.mine.randrange(40, 150)
    errors: list[str] = []

    def worker(w: int) -> None:
        rng = random.Random((ctx.seed * 64 + ctx.rank) * 8 + w)
        if rng.random() < 0.3:
            # A scope of this thread's own, overlapping the other threads' (defect
            # 11): the GC state must be restored whatever the order of exits.
            mode = rng.choice(("managed", "off", "auto"))
            try:
                with cgc.collective_scope(sc, gc=mode, exit_collect=None):
                    register(w, rng)
            except BaseException as exc:
                # Its exit sync point may run the main thread's destroys, and
                # re-raise an interrupt injected there: expected, on this thread.
                mine = fired_by.get(threading.get_ident(), [])
                reported = isinstance(exc, cgc.DestroyError) and _injected_only(str(exc))
                if not (mine and type(exc).__name__ == mine[0]) and not reported:
                    errors.append(f"thread {w}: scope: {type(exc).__name__}: {exc}")
        else:
            register(w, rng)

    def register(w: int, rng: random.Random) -> None:
        keep: list[Obj] = []
        for _ in range(per):
            local = rng.random() < 0.25
            try:
                obj = L.make(None if local else sc, rl if local else label, local=True)[0]
            except Exception as exc:  # a defect: registration here must succeed
                errors.append(f"thread {w}: register: {type(exc).__name__}: {exc}")
                continue
            keep.append(obj)
            if len(keep) > 1 and rng.random() < 0.2:
                other = keep[rng.randrange(len(keep) - 1)]
                obj.refs.append(other)
                other.refs.append(obj)
            del obj
            while keep and rng.random() < 0.5:
                keep.pop(rng.randrange(len(keep)))
            if rng.random() < 0.05:
                try:  # diagnostics while the main thread may be inside a sync point
                    cgc.pending(sc)
                    if rng.random() < 0.3:
                        cgc.view(sc, file=None)
                except Exception as exc:
                    errors.append(_diag_error(f"thread {w}", exc, where))
        keep.clear()

    def diagnostics(view: bool) -> None:
        # The main thread's, recorded like the workers' (an exception here
        # would end the episode with its workers still running).
        try:
            if view:
                cgc.view(sc, file=None)
            else:
                cgc.pending(sc)
        except Exception as exc:
            errors.append(_diag_error("main thread", exc, where))

    holders = Holders()
    fired_by: dict[int, list[str]] = {}
    fired = fired_by.setdefault(threading.get_ident(), [])  # the main thread's
    gc_was = gc.isenabled()
    old = sys.getswitchinterval()
    # Switch threads as often as possible: races show up in a few seeds, not thousands.
    sys.setswitchinterval(ctx.mine.choice((1e-6, 1e-5, 1e-4)))
    try:
        workers = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(nthreads)]
        for t in workers:
            t.start()
        while any(t.is_alive() for t in workers):
            op = ctx.mine.random()
            if op < 0.35:
                obj = L.make(sc, label, local=True)[0]
                holders.append(obj)
                if ctx.mine.random() < 0.08:
                    kind = ctx.mine.choice(INTERRUPTS)
                    L.actions[obj.token] = _raiser(fired_by, kind, label, obj.token)
                else:
                    # A destroy that gives the other threads the GIL.
                    L.actions[obj.token] = functools.partial(time.sleep, 0)
                del obj
                _drop_some(holders, ctx.mine, 0.3)
            elif op < 0.7:
                before = len(fired)
                res = sync(sc, ctx.hang_timeout, ctx.mine.choice((None, 0, 2)))
                want = fired[before] if len(fired) > before else "ok"
                if res.kind != want and not _reports_injected(res):
                    cls = "hang" if res.kind == "CollectiveTimeoutError" else "error"
                    L.defect(
                        cls, f"sync on COMM_SELF: {res.kind} (expected {want}) {res.text[:300]}"
                    )
            elif op < 0.85:
                diagnostics(view=False)
            elif op < 0.95:
                diagnostics(view=True)
            else:
                _find_cycles_of_one(holders)
        _join_registrars(ctx, workers)
    finally:
        sys.setswitchinterval(old)
    if errors:
        L.defect(
            "error",
            f"{len(errors)} call(s) refused on worker threads or diagnostics, first: {errors[0]}",
        )
    if gc.isenabled() != gc_was:
        L.defect("error", f"the collector is left {'en' if gc.isenabled() else 'dis'}abled")
        if gc_was:
            gc.enable()  # the next seeds must not inherit it
    holders.clear()
    gc.collect()
    ok = True
    for _ in range(12):
        before = len(fired)
        res = sync(sc, ctx.hang_timeout)
        if res.kind != "ok":
            if len(fired) > before and res.kind == fired[before]:
                continue  # an injected interrupt, re-raised as it should be: sync again
            if _reports_injected(res):
                continue  # the report of one, by the next sync point: sync again
            L.defect("error", f"final sync on COMM_SELF: {res.kind}: {res.text[:300]}")
            ok = False
            break
        if res.destroyed == 0:
            break
    L.wait_local((rl,), 5.0)
    L.check_keys(label)
    L.check_lost(*((label, rl) if ok else (rl,)))
    if own:
        sc.Free()


# -- interrupts raised inside destroys (issue 11, defect 3) ----------------------


def interrupt(ctx: Ctx) -> None:
    """One or two destroys raise KeyboardInterrupt, SystemExit or RuntimeError,
    each on one rank only; the user catches it and syncs again."""
    L = ctx.ledger
    L.episode = "interrupt"
    label = "intr"
    ctx.arm("interrupt", ctx.ck_timeout * 3)
    comm = ctx.world.Dup()
    sh = ctx.shared
    n = sh.randrange(3, 14)
    holders = Holders(L.make(comm, label)[0] for _ in range(n))
    fired: list[str] = []
    plan = []
    for _ in range(sh.choice((1, 1, 2))):
        q, i = sh.randrange(ctx.size), sh.randrange(n)
        kind = sh.choice(("KeyboardInterrupt", "KeyboardInterrupt", "SystemExit", "RuntimeError"))
        plan.append((q, i, kind))
        if q == ctx.rank and holders[i].token not in L.actions:
            L.actions[holders[i].token] = _raiser(fired, kind, label, holders[i].token)
    _link(holders, sh, sh.randrange(0, n))
    order = list(range(n))
    ctx.mine.shuffle(order)
    for j in order:
        holders[j] = None
    gc.collect()
    if sh.random() < 0.5:
        cgc.pending(comm)
    if sh.random() < 0.3:
        cgc.view(comm, file=None)  # collective: every rank, decided by the shared RNG

    def expect(q: int, got: list[Any]) -> set[str]:
        # The sync point that ran the destroys: an interrupt is re-raised on
        # its rank; what failed is kept for the next one.
        mine = got[q][3]
        interrupts = [k for k in mine if k in INTERRUPTS]
        return {interrupts[0]} if interrupts else {"ok"}

    def expect_report(q: int, got: list[Any]) -> set[str]:
        # The next sync point reports every failure, on every rank alike.
        return {"DestroyError"} if any(g[3] for g in got) else {"ok"}

    # Sometimes no deadline, as most programs run: a rank left waiting then
    # hangs (the watchdog ends the job). Both sync points run before the ranks
    # compare (as a program that catches the interrupt and carries on would),
    # so a rank's next sync point can pair with another's unfinished
    # collective (MPI_ERR_TRUNCATE, or a wrong OK).
    timeout = None if sh.random() < 0.3 else ctx.hang_timeout
    if timeout is None:
        ctx.arm("interrupt: sync points without a deadline", 30.0)
    first = sync(comm, timeout)
    fired_first = list(fired)
    second = sync(comm, timeout)  # the interrupt was caught: carry on
    judge(ctx, f"sync with injected {plan}", first, label, expect, fired_first)
    got = judge(ctx, "the sync after the interrupt", second, label, expect_report, fired_first)
    if ctx.rank == 0:
        # Each DestroyError must name what failed on every rank.
        for q, g in enumerate(got):
            if g[0].kind != "DestroyError":
                continue
            for p, other in enumerate(got):
                for k in other[3]:
                    if k not in g[0].text:
                        L.defect(
                            "disagree",
                            f"rank {q}'s DestroyError does not name rank {p}'s {k}: "
                            f"{g[0].text[:200]}",
                        )
    holders.clear()
    if final_collects(ctx, comm, label, "interrupt"):
        check_lost_everywhere(ctx, label)
    comm.Free()


# -- destroys that detach, diagnose, register and drop (issue 11, defect 8) ------


def _meddle(
    L: Ledger,
    label: str,
    hw: weakref.ref[Holders],
    regs: list[cgc.Registration],
    tokens: list[int],
    comm: MPI.Comm,
    steps: list[tuple[Any, ...]],
) -> None:
    # Runs inside a destroy, at the same point on every rank (destroys are agreed
    # and ordered): whatever it does, it does on every rank alike, so its
    # results are compared across ranks (L.event).
    for step in steps:
        op = step[0]
        try:
            if op == "detach":
                if regs[step[1]].detach():
                    L.detached.add(tokens[step[1]])
                    L.event(label, "detach", step[1], True)
                else:
                    L.event(label, "detach", step[1], False)
            elif op == "pending":
                cgc.pending(comm)
                cgc.pending(None)
            elif op == "drop":
                holders = hw()
                if holders is not None:
                    for j in step[1]:
                        holders[j] = None
            elif op == "register":
                holders = hw()
                local = step[1] == "local"
                obj = L.make(None if local else comm, "reaper" if local else label)[0]
                if holders is not None:
                    holders.append(obj)
                del obj
                L.event(label, "register", step[1], "ok")
            elif op == "cycles":
                _find_cycles_of_one(hw() or ())
            elif op == "view":
                cgc.view(comm, file=None)
                L.event(label, "view", "ok")
        except Exception as exc:  # compared across ranks: an error must be on all alike
            L.event(label, op, type(exc).__name__)


def meddle(ctx: Ctx) -> None:
    """Destroys that detach a sibling, call pending/view/find_cycles, register
    and drop other objects, at sync points with few or many keys pending."""
    L = ctx.ledger
    L.episode = "meddle"
    label = "med"
    ctx.arm("meddle", ctx.ck_timeout * 12)
    comm = ctx.world.Dup()
    sh = ctx.shared
    n = sh.randrange(6, 24)
    holders = Holders()
    regs: list[cgc.Registration] = []
    for _ in range(n):
        obj, reg = L.make(comm, label)
        holders.append(obj)
        regs.append(reg)
    del obj, reg
    tokens = [o.token for o in holders]
    hw = weakref.ref(holders)
    for i in range(n):
        if sh.random() < 0.5:
            steps: list[tuple[Any, ...]] = []
            if sh.random() < 0.5:
                # Drop siblings, detach one of them (dead now, queued, not agreed)
                # and look at what is pending: a drain in the middle of the sync
                # point, with a stale key and keys that died during its destroys.
                js = sh.sample(range(n), sh.randrange(1, 4))
                steps += [("drop", js), ("detach", js[0]), ("pending",)]
            elif sh.random() < 0.7:
                steps.append(("detach", sh.randrange(n)))
            if sh.random() < 0.7:
                steps.append(("pending",))
            if sh.random() < 0.5:
                steps.append(("drop", [sh.randrange(n) for _ in range(sh.randrange(1, 4))]))
            if sh.random() < 0.2:
                steps.append(("register", sh.choice(("local", "comm"))))
            if sh.random() < 0.2:
                steps.append(("cycles",))
            if sh.random() < 0.1:
                steps.append(("view",))
            if len(steps) < 3 or steps[0][0] != "drop":
                sh.shuffle(steps)
            L.actions[holders[i].token] = functools.partial(
                _meddle, L, label, hw, regs, tokens, comm, steps
            )
    _link(holders, sh, sh.randrange(0, n // 2 + 1))
    rounds = sh.randrange(2, 9)
    for r in range(rounds):
        if sh.random() < 0.6:
            # A few objects, the same on every rank: small agreed batches.
            for j in sh.sample(range(n), sh.randrange(1, 4)):
                holders[j] = None
        else:
            _drop_some(holders, ctx.mine, 1.0 / (rounds - r))
        if sh.random() < 0.5:
            cgc.pending(comm)
        if sh.random() < 0.2:
            cgc.view(comm, file=None)
        if sh.random() < 0.2:
            _find_cycles_of_one(holders)
        res = sync(comm, ctx.hang_timeout, sh.choice((None, 0, 2)))
        judge(ctx, f"meddling sync {r}", res, label)
    holders.clear()
    if final_collects(ctx, comm, label, "meddle"):
        check_lost_everywhere(ctx, label)
        L.wait_local(("reaper",), 5.0)
        L.check_lost("reaper")
    comm.Free()


# -- late ranks against deadlines (issue 11, defect 4) ----------------------------


def late(ctx: Ctx) -> None:
    """One rank arrives late at a sync point with a deadline: well within it
    (every rank must report OK), or well beyond it (no rank may report OK,
    and every rank's next sync point must refuse)."""
    L = ctx.ledger
    L.episode = "late"
    label = "late"
    sh = ctx.shared
    comm = ctx.world.Dup()
    first_use = sh.random() < 0.4  # the late sync point is the communicator's first use
    holders = Holders()
    child: MPI.Comm | None = None
    if not first_use:
        holders.extend(L.make(comm, label)[0] for _ in range(sh.randrange(1, 6)))
        if sh.random() < 0.5:
            # Something registered on a derived communicator: the parent's sync
            # point syncs it first, so the timeout happens inside the child's.
            child = cgc.dup(comm)
            holders.extend(L.make(child, label)[0] for _ in range(sh.randrange(1, 4)))
        res = sync(comm, ctx.hang_timeout)
        judge(ctx, "sync before the late one", res, label)
        _drop_some(holders, ctx.mine, 0.5)
    slow = sh.randrange(ctx.size)
    beyond = sh.random() < 0.5
    timeout = 0.3 if beyond else ctx.hang_timeout
    lateness = timeout + 1.5 if beyond else 0.05
    ctx.arm("late", ctx.ck_timeout * 3 + lateness)
    ctx.checkpoint("before the late sync", None)  # every rank starts from here
    if ctx.rank == slow:
        time.sleep(lateness)
    res = sync(comm, timeout, None)
    what = f"rank {slow} {lateness:.2f} s late at a sync point with timeout {timeout}" + (
        " (first use)" if first_use else " (with a derived communicator)" if child else ""
    )
    if not beyond:
        child = None
        judge(ctx, what, res, label)
    else:
        got = judge(
            ctx, what, res, label, lambda q, g: {"CollectiveTimeoutError", "CollectiveGCError"}
        )
        if ctx.rank == 0:
            for q, g in enumerate(got):
                if q != slow and g[0].seconds > timeout + 1.0:
                    L.defect(
                        "hang",
                        f"{what}: rank {q} left after {g[0].seconds:.2f} s ({g[0].kind}): "
                        "the deadline was not honoured",
                    )
        # The manager must now be unusable on every rank.
        res = sync(comm, 2.0, None)
        judge(ctx, "the sync after a timeout", res, label, _unusable)
        L.exempt.update(L.tokens(label))
    holders.clear()
    if not beyond:
        if final_collects(ctx, comm, label, "late"):
            check_lost_everywhere(ctx, label)
        comm.Free()
        return
    # A communicator whose manager timed out keeps abandoned requests on the
    # manager's duplicate: left alone, not freed. What it had queued can never
    # be agreed: detached (locally, on every rank), so that the exit does not
    # warn about destroys this episode leaked on purpose.
    gc.collect()
    if child is not None:
        for reg in cgc.pending(child):
            reg.detach()
        child = None
        gc.collect()
    for reg in cgc.pending(comm):
        reg.detach()


def _unusable(q: int, got: list[Any]) -> set[str]:
    return {"CollectiveGCError"}


# -- a communicator freed with destroys pending (issue 11, defect 2) -------------


def freed(ctx: Ctx) -> None:
    """The user frees a managed communicator with destroys pending, then touches
    what the documentation offers (Manager.comm, pending, collect, view)."""
    L = ctx.ledger
    L.episode = "freed"
    label = "freed"
    sh = ctx.shared
    ctx.arm("freed", ctx.ck_timeout * 4)
    comm = ctx.world.Dup()
    holders = Holders(L.make(comm, label)[0] for _ in range(sh.randrange(2, 10)))
    _drop_some(holders, ctx.mine, 0.5)
    res = sync(comm, ctx.hang_timeout)
    judge(ctx, "sync before the free", res, label)
    _drop_some(holders, ctx.mine, 0.5)
    gc.collect()
    mgr = cgc.manager(comm)
    L.exempt.update(L.tokens(label))  # pending destroys of a freed communicator: at exit, or leaked
    comm.Free()
    outcomes = []
    touches: list[tuple[str, Callable[[], object]]] = [
        ("repr", lambda: repr(mgr)),
        ("pending", lambda: cgc.pending(comm)),
        ("collect", lambda: cgc.collect(comm, timeout=2.0)),
        ("Manager.comm", lambda: mgr.comm.Get_size()),
    ]
    for name, touch in touches:
        if sh.random() < 0.6:
            try:
                touch()
                outcomes.append((name, "ok"))
            except (cgc.CollectiveGCError, ValueError, TypeError) as exc:
                outcomes.append((name, type(exc).__name__))
            except Exception as exc:
                outcomes.append((name, type(exc).__name__))
                L.defect("error", f"{name} after comm.Free(): {type(exc).__name__}: {exc}")
    got = ctx.checkpoint("after the free", outcomes)
    if ctx.rank == 0 and any(g != got[0] for g in got):
        L.defect("disagree", f"touching a freed communicator: {got}")
    holders.clear()
    gc.collect()


# -- two threads registering at once on a communicator of size > 1 (erroneous) ---


def racing(ctx: Ctx) -> None:
    """The expected-error scenario of defect 1: two threads register on a
    communicator of size > 1 at once. Erroneous (ranks would number the
    objects differently), so the library may refuse (``RegistrationError``
    naming both threads) or, where the calls did not overlap, accept; keys may
    then differ between ranks. Checked: no hang, no double or live destroy,
    no other error, and every rank leaves the next sync point alike."""
    L = ctx.ledger
    L.episode = "racing"
    label = "racing"
    ctx.arm("racing", ctx.ck_timeout * 10)
    comm = ctx.world.Dup()
    holders = Holders()
    errors: list[str] = []
    refused: list[str] = []

    def worker(w: int) -> None:
        for _ in range(ctx.mine.randrange(5, 40)):
            try:
                holders.append(L.make(comm, label, local=True)[0])
            except cgc.RegistrationError as exc:
                refused.append(str(exc))
            except Exception as exc:  # anything else is a defect
                errors.append(f"thread {w}: {type(exc).__name__}: {exc}")

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=worker, args=(w,), name=f"racer-{w}") for w in (0, 1)]
        for t in workers:
            t.start()
        _join_registrars(ctx, workers)
    finally:
        sys.setswitchinterval(old)
    if errors:
        L.defect("error", f"{len(errors)} unexpected error(s), first: {errors[0]}")
    unnamed = [m for m in refused if "racer-0" not in m or "racer-1" not in m]
    if unnamed:
        L.defect("error", f"a refusal does not name both threads: {unnamed[0][:300]}")
    L.exempt.update(L.tokens(label))  # erroneous program: no promise of destroys
    holders.clear()
    gc.collect()

    def mismatch_or_ok(q: int, got: list[Any]) -> set[str]:
        return {"ok", "CollectiveMismatchError"}

    res = sync(comm, ctx.hang_timeout)
    judge(ctx, "sync after racing registrations", res, label, mismatch_or_ok, same_logs=False)
    # An erroneous program's leftovers (a mismatch makes the manager unusable):
    # detached, so that the exit does not warn about them.
    for reg in cgc.pending(comm):
        reg.detach()


# -- strict mode against diagnostics (issue 11, defect 9) ------------------------


def strict(ctx: Ctx) -> None:
    """Managed objects die in the cyclic collector inside a strict scope; then
    (or not) diagnostics run before the scope's sync point, which must raise
    ``CyclicFinalizationError`` on every rank either way (and destroy them)."""
    L = ctx.ledger
    L.episode = "strict"
    label = "strict"
    sh = ctx.shared
    ctx.arm("strict", ctx.ck_timeout * 6)
    comm = ctx.world.Dup()
    diagnostics = [d for d in ("pending", "view", "find_cycles") if sh.random() < 0.5]
    res = Res("ok", "", 0, 0.0)
    try:
        with cgc.collective_scope(comm, strict=True, timeout=ctx.hang_timeout) as scope:
            holders = Holders(L.make(comm, label)[0] for _ in range(sh.randrange(2, 8)))
            _link(holders, sh, 2)
            _self_loops(holders)  # at least one cycle through every object
            holders.clear()
            gc.collect()  # on every rank: the managed objects die in the cyclic collector
            if "pending" in diagnostics:
                cgc.pending(comm)
            if "view" in diagnostics:
                cgc.view(comm, file=None)
            if "find_cycles" in diagnostics:
                cgc.find_cycles(scope)
            t0 = time.monotonic()
            try:
                stats = scope.sync()
                res = Res("ok", "", stats.destroyed, time.monotonic() - t0)
            except BaseException as exc:
                res = Res(type(exc).__name__, str(exc)[:600], -1, time.monotonic() - t0)
    except BaseException as exc:  # leaving the scope must not raise here
        L.defect("error", f"leaving a strict scope: {type(exc).__name__}: {exc}"[:400])

    def cyclic_error(q: int, got: list[Any]) -> set[str]:
        return {"CyclicFinalizationError"}

    judge(ctx, f"strict sync after diagnostics {diagnostics}", res, label, cyclic_error)
    if final_collects(ctx, comm, label, "strict"):
        check_lost_everywhere(ctx, label)
    comm.Free()


# -- signal handlers raising at random points of sync points (issue 25) ----------


def storm(ctx: Ctx) -> None:
    """A SIGALRM handler raising KeyboardInterrupt, SystemExit or RuntimeError
    every 50-400 us, on one rank of a duplicate of the world (or, on some seeds,
    on every rank, each on its own duplicate of COMM_SELF), during loops of
    sync points in which 20-200 managed objects die per step: it lands
    anywhere, in sync points, drains and destroys. The user catches it and
    runs the sync point again only if it did not run (its manager's
    sync_count), as a program that catches interrupts would. Checked: no hang,
    no other error, every rank runs every sync point, every destroy runs once
    and the same on every rank."""
    L = ctx.ledger
    L.episode = "storm"
    label = "storm"
    sh = ctx.shared
    ctx.arm("storm", ctx.ck_timeout * 4)
    on_self = sh.random() < 0.3
    comm = MPI.COMM_SELF.Dup() if on_self else ctx.world.Dup()
    stormed = on_self or ctx.rank == sh.randrange(ctx.size)
    kind = _RAISABLE[sh.choice(("KeyboardInterrupt", "SystemExit", "RuntimeError"))]
    timeout = None if sh.random() < 0.3 else ctx.hang_timeout
    mgr = cgc.manager(comm)
    rng = ctx.mine
    # Raises only while the budget lasts: set just before the sync point,
    # zeroed just after, so that nothing lands in the harness's own steps.
    state = {"budget": 0, "raised": 0, "on": True}

    def handler(signum: int, frame: Any) -> None:
        if state["on"]:
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(50e-6, 400e-6))
        if state["budget"] > 0:
            state["budget"] -= 1
            state["raised"] += 1
            raise kind("storm")

    errors: list[str] = []
    previous = signal.signal(signal.SIGALRM, handler) if stormed else None
    try:
        if stormed:
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(50e-6, 400e-6))
        for step in range(sh.randrange(5, 25)):
            holders = Holders(L.make(comm, label)[0] for _ in range(sh.randrange(20, 200)))
            holders.clear()
            want = mgr.sync_count + 1
            while mgr.sync_count < want and not errors:
                try:
                    state["budget"] = 3
                    cgc.collect(comm, generation=None, timeout=timeout)
                    state["budget"] = 0
                except BaseException as exc:  # the storm's, or a defect
                    state["budget"] = 0
                    if type(exc) is not kind or str(exc) != "storm":
                        errors.append(f"step {step}: {type(exc).__name__}: {exc}"[:400])
            if errors:
                break  # this rank's manager is unusable: a checkpoint says so
    finally:
        state["on"] = False
        if stormed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    got = ctx.checkpoint("storm outcome", (errors[:1], state["raised"]))
    if ctx.rank == 0:
        for q, (errs, _) in enumerate(got):
            if errs:
                L.defect("error", f"storm ({kind.__name__}) on rank {q}: {errs[0]}")
    if any(errs for errs, _ in got):
        comm.Free()
        raise EpisodeAbandoned
    if final_collects(ctx, comm, label, "storm"):
        check_lost_everywhere(ctx, label)
    comm.Free()


# -- sparse long-lived keys: the window and the fallback intersection (issue 25) --


def _paths(keys: list[int], nk: list[int], i: int) -> set[str]:
    """Which agreement path certainly agreed on some of ``keys``, destroyed at
    this episode's sync point ``i`` (``nk[j]``: ``Manager.next_key`` at sync
    point ``j``), from public state and the window docs/design.rst describes
    (the keys registered since the third sync point back, and room for at
    least 256 new ones): a key registered before the fifth sync point back is
    outside any such window, so only the fallback intersection can have
    agreed on it; one registered since the third back and fewer than 256 past
    the last one is inside every such window. The margins make the record
    hold whatever the window's exact bounds, at the cost of not classifying
    the keys in between."""
    out = set()
    if i >= 5 and any(k < nk[i - 5] for k in keys):
        out.add("fallback")
    if i >= 3 and any(nk[i - 3] <= k < nk[i - 1] + 256 for k in keys):
        out.add("window")
    return out


def sparse(ctx: Ctx) -> None:
    """Many registrations with seeded random lifetimes (defect 4 of issue 25):
    a small fraction, the same objects on every rank, live for many steps, so
    that their keys stay spread over a range much wider than the agreement's
    window while the rest die within a step or two; each rank drops in its
    own order and at its own times (its own lifetimes, and at one step its
    own share of the long-lived ones at once), so the ranks' queues differ at
    every sync point. The sizes vary with the seed (tens to thousands a step,
    bursts, 1 in 6 to 1 in 250 kept long), so that both the window and the
    fallback intersection (its bitmap and its broadcast form) run; on some
    seeds, unless ``ctx.big`` is off, the scale of the issue's report: ~700k
    registrations, 1 in 70 kept, each rank dropping its own 90% of those at
    once after 4 quiet steps (9k keys pending outside the window per rank,
    spread over 700k keys: the fallback's messages exceed 64 KiB, where Open
    MPI 4.1's libnbc takes its ring algorithm). On a duplicate of the
    world, or on some seeds of COMM_SELF (each rank alone: every dead
    object's destroy runs at the next sync point). Checked: every sync point
    ends alike on every rank, with the same destroys in the same order;
    nothing destroyed live or twice; nothing lost. Which paths certainly ran
    goes to the ledger's notes (the harness's ``--report``)."""
    L = ctx.ledger
    L.episode = "sparse"
    label = "sparse"
    sh = ctx.shared
    on_self = ctx.size == 1 or sh.random() < 0.25
    steps = sh.randrange(10, 21)
    # The huge class on ~1 in 14 (~40 s on 4 ranks of 2 cores, most of it registering).
    size = sh.choice(("small", "mid", "large", "larger") * 3 + ("mid", "huge"))
    if size == "huge" and (on_self or not ctx.big):
        size = "large"  # the fallback at that scale needs several ranks
    base, keep = {
        "small": (40, 1 / 6),
        "mid": (150, 1 / 25),
        "large": (600, 1 / 60),
        "larger": (1500, 1 / 250),
        "huge": (700_000 // (steps - 4), 1 / 70),
    }[size]
    huge = size == "huge"
    # Each rank drops its own share of the long-lived objects left at this step.
    purge = steps - 1 if huge else sh.randrange(steps // 2, steps)
    ctx.arm("sparse", ctx.ck_timeout * (12 if huge else 4))
    comm = MPI.COMM_SELF.Dup() if on_self else ctx.world.Dup()
    mgr = cgc.manager(comm)
    rng = ctx.mine
    share = 0.9 if huge else rng.uniform(0.5, 0.95)
    holders = Holders()
    dies: dict[int, list[int]] = {}  # step -> indices into holders this rank drops then
    longs: list[int] = []  # the long-lived ones, indices into holders
    key_of: dict[int, int] = {}  # token -> key
    nk: list[int] = []  # Manager.next_key at each sync point of the episode
    paths: set[str] = set()
    errors: list[str] = []
    what = f"sparse ({base}/step, keep 1/{round(1 / keep)}, {steps} steps)"
    for step in range(steps):
        if huge:
            # The last 4 steps register a few only: the agreement's window
            # then starts past every long-lived key, and all of them go
            # through the fallback at the purge.
            n = base if step < steps - 4 else 10
        else:
            n = base * (6 if sh.random() < 0.15 else 1) + sh.randrange(base)
        for _ in range(n):
            obj, reg = L.make(comm, label)
            key_of[obj.token] = reg.key
            # Long-lived on every rank alike (shared), but each rank its own
            # lifetime: the long-lived keys die at different steps per rank.
            if sh.random() < keep:
                longs.append(len(holders))
                life = steps + 4 if huge else rng.randrange(5, steps + 4)
            else:
                life = rng.choice((0, 0, 0, 1, 2))
            dies.setdefault(step + life, []).append(len(holders))
            holders.append(obj)
        del obj, reg
        doomed = dies.pop(step, [])
        if step == purge:
            doomed += [j for j in longs if holders[j] is not None and rng.random() < share]
        rng.shuffle(doomed)
        for j in doomed:
            holders[j] = None
        if not huge and sh.random() < 0.2:
            continue  # no sync point this step: more dies before the next
        before = len(L.log.get(label, ()))
        nk.append(mgr.next_key)
        res = sync(comm, ctx.hang_timeout, sh.choice((None, None, 0)))
        done = L.log.get(label, [])[before:]
        if on_self:
            # Alone, a sync point destroys every object dead before it.
            if res.kind != "ok":
                errors.append(f"sync {step}: {res.kind}: {res.text[:300]}")
                break
            lost = L.lost_tokens(label)
            if lost:
                L.report_lost(lost, f" at the sync point of step {step}")
                break
            continue
        got = judge(ctx, f"{what}: sync {step}", res, label, digest=True)
        if any(g[0].kind != "ok" for g in got):
            # Reported already; what is left is not comparable, and is
            # detached so that the exit does not warn about it.
            L.exempt.update(L.tokens(label))
            holders.clear()
            for reg in cgc.pending(comm):
                reg.detach()
            comm.Free()
            raise EpisodeAbandoned
        paths |= _paths([key_of[t] for t in done], nk, len(nk) - 1)
    holders.clear()
    dies.clear()
    if on_self:
        got = ctx.checkpoint("sparse on COMM_SELF", errors[:1])
        if ctx.rank == 0:
            for q, errs in enumerate(got):
                if errs:
                    L.defect("error", f"{what} on COMM_SELF, rank {q}: {errs[0]}")
        if not errors:
            res = sync(comm, ctx.hang_timeout)
            if res.kind != "ok":
                L.defect("error", f"{what}: the final sync: {res.kind}: {res.text[:300]}")
            L.check_lost(label)
        L.notes["sparse"] = ["self"]
    else:
        if final_collects(ctx, comm, label, "sparse"):
            check_lost_everywhere(ctx, label)
        L.notes["sparse"] = sorted(paths) + (["huge"] if huge else [])
    comm.Free()


EPISODES: dict[str, Callable[[Ctx], None]] = {
    "threads": threads,
    "interrupt": interrupt,
    "meddle": meddle,
    "late": late,
    "freed": freed,
    "racing": racing,
    "strict": strict,
    "args": bad_args,
    "storm": storm,
    "sparse": sparse,
}
# How often each episode runs (per seed, decided by the shared RNG).
WEIGHTS = {
    "threads": 0.5,
    "interrupt": 0.5,
    "meddle": 0.6,
    "late": 0.2,
    "freed": 0.2,
    "racing": 0.15,
    "strict": 0.3,
    "args": 0.15,
    "storm": 0.3,
    "sparse": 0.3,
}


def run_faults(
    world: MPI.Intracomm,
    seed: int,
    ledger: Ledger,
    hang_timeout: float,
    arm: Callable[[str, float], None],
    only: tuple[str, ...] = (),
    big: bool = True,
) -> list[str]:
    """Collective over ``world``: the fault episodes of one seed; returns their names.
    ``big``: see :class:`Ctx`."""
    ctx = Ctx(world, seed, ledger, hang_timeout, arm, big)
    pick = random.Random(seed ^ 0x5EED)
    draws = {name: pick.random() for name in EPISODES}
    chosen = [n for n in EPISODES if (n in only if only else draws[n] < WEIGHTS[n])]
    if ctx.size == 1:
        # No other rank to be late for, no numbering to differ between ranks.
        chosen = [n for n in chosen if n not in ("late", "racing")]
    try:
        for name in chosen:
            try:
                EPISODES[name](ctx)
            except EpisodeAbandoned:
                pass
            except Exception as exc:
                # The library refused a step that should work (on every rank
                # alike, if the next checkpoints pair up; if not, a checkpoint
                # deadline ends the job). Reported; the next episode goes on.
                ledger.defect("error", f"the episode stopped: {type(exc).__name__}: {exc}"[:500])
    finally:
        ledger.episode = "-"
    ctx.close()
    return chosen
