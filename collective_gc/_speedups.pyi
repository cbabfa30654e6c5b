from collections.abc import Callable
from typing import Any

def set_flags(flags: list[int], /) -> None: ...
def on_finalize(reg: Any, /) -> None: ...
def destroy_each(
    calls: list[tuple[Any, ...]],
    pos: int,
    fast_types: tuple[type, ...],
    getptr: int,
    destroy: int,
    seterr: int,
    /,
) -> list[tuple[int, BaseException]]: ...
def set_registration_type(cls: type, /) -> None: ...
def take_batch(
    regs: dict[int, Any],
    keys: list[int],
    state: int,
    batched: tuple[Any, ...],
    /,
) -> tuple[
    list[Any],
    list[Callable[..., object]],
    list[tuple[Any, ...]],
    list[tuple[int, int, int]] | None,
]: ...
def run_each(
    fns: list[Callable[..., object]], argss: list[tuple[Any, ...]], /
) -> list[tuple[int, BaseException]]: ...
def handlers_changed(
    getsignal: Callable[[int], object], signals: tuple[int, ...], expected: tuple[object, ...], /
) -> bool: ...
def region_setup(
    main_ident: int,
    depth: list[int],
    deferred: list[Any],
    signals: tuple[int, ...],
    guarded: list[tuple[object, ...]],
    getsignal: Callable[[int], object],
    guard: Callable[[], None],
    deliver: Callable[[bool], None],
    /,
) -> None: ...
def region_enter() -> bool: ...
def region_leave(entered: bool, /) -> None: ...
def set_registry_type(
    cls: type, track_origins: list[bool], callback: Callable[[Any], None], /
) -> None: ...
def add_plain(
    registry: Any,
    obj: object,
    destroy: Callable[..., object],
    args: tuple[Any, ...],
    name: str | None,
    /,
) -> Any: ...
