"""Recording: traces of driver calls and arena operations, and the wrapper that records calls.

:class:`Trace` (two typed lists, versioned JSON) and :class:`TracingDriver`. Replays live one
layer up, in :mod:`kvvmm.replay`, because rebuilding arenas needs the arena.
"""

from __future__ import annotations

from kvvmm.record.trace import ARENA_OPS, FORMAT, VERSION, ArenaOp, Trace, TraceEvent
from kvvmm.record.tracing import TracingDriver

__all__ = ["ARENA_OPS", "FORMAT", "VERSION", "ArenaOp", "Trace", "TraceEvent", "TracingDriver"]
