"""Recording: :class:`Trace` (driver calls and arena operations, versioned JSON) and the
:class:`TracingDriver` that records calls; replays are :mod:`kvvmm.replay`'s (they need the
arena)."""

from __future__ import annotations

from kvvmm.record.trace import ARENA_OPS, FORMAT, VERSION, ArenaOp, Trace, TraceEvent
from kvvmm.record.tracing import TracingDriver

__all__ = ["ARENA_OPS", "FORMAT", "VERSION", "ArenaOp", "Trace", "TraceEvent", "TracingDriver"]
