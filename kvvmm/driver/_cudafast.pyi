"""Type stub of the C extension kvvmm/driver/_cudafast.c (CudaDriver's hot calls)."""

from collections.abc import Callable
from typing import Any

ABI: int

class Handle:
    raw: int
    size: int
    maps: int
    live: bool
    imported: bool
    def __init__(self, raw: int, size: int, imported: bool = ...) -> None: ...

class Fast:
    hot_lo: int
    hot_hi: int
    next_handle: int
    physical_bytes: int
    capture_check: Callable[[], bool] | None
    def __init__(
        self,
        fns: tuple[int, ...],
        ctx: int,
        prop: int,
        acc: int,
        gran: int,
        handles: dict[int, Any],
        maps: dict[int, Any],
        driver: Any,
        handle_type: type[Handle],
    ) -> None: ...
    def map(self, va: int, size: int, handle: int) -> None: ...
    def unmap(self, va: int, size: int) -> None: ...
    def create(self, size: int) -> int: ...
    def release(self, handle: int) -> None: ...
    def set_access(self, va: int, size: int, devices: Any = ...) -> None: ...
