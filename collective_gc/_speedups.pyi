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
