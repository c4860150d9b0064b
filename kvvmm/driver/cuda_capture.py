"""Waiting for the device before VA goes, for :class:`~kvvmm.driver.cuda.CudaDriver`.

An unmap (and, with the zero cover on, a map or a free) first synchronizes this device's
primary context: unmapping VA a running kernel still uses is an illegal-address fault that
kills the context. A synchronize during a CUDA graph capture fails *and invalidates the
capture*, so a capture is looked for first (torch's current stream of this device, blocking
streams) and the call refused without touching anything. The design is "Unmap, synchronize
and graph capture" in docs/CUDA_DRIVER.md; the C fast path does the same in C.

:class:`SynchronizeMixin` is one of ``CudaDriver``'s bases, not a driver of its own.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from kvvmm.driver.base import driver_error

__all__ = ["SynchronizeMixin"]


def _cuda() -> Any:
    """:mod:`kvvmm.driver.cuda` (which imports this module), read at call time: it holds
    cuda.bindings' driver module as ``_drv``, where the tests put a stand-in."""
    return sys.modules["kvvmm.driver.cuda"]


def _name(err: Any) -> str:
    name: str = _cuda()._name(err)
    return name


def _describe(err: Any) -> str:
    text: str = _cuda()._describe(err)
    return text


class SynchronizeMixin:
    """``CudaDriver``'s synchronize, refused while a capture is seen."""

    # What this uses of CudaDriver (set by its constructor; declared for the type checker).
    device: int
    _ok: Any
    _ctx: Any
    _ctx_int: int
    _b: Any  # the driver's counters: capture_check, torch's "capturing?" once seen
    _legacy: Any  # the legacy stream (its query sees blocking streams)
    _implicit: Any
    _capture_none: Any
    _cuCtxGetCurrent: Any
    _cuCtxSynchronize: Any
    _cuStreamIsCapturing: Any

    def _synchronize(self, call: str, va: int, size: int) -> None:
        """Wait for all work in this device's context; refuse while a capture is seen.

        Before an unmap, and (zero cover on) before a map or a free, which unmap zero pieces
        a kernel may be reading.
        """
        done, act = {"map": ("mapped", "Map"), "free": ("freed", "Free")}.get(
            call, ("unmapped", "Unmap"))
        err, cur = self._cuCtxGetCurrent()
        pushed = int(cur) != self._ctx_int
        if pushed:  # another context (or none) is current on this thread: sync ours
            drv = _cuda()._drv
            drv.cuCtxPushCurrent(self._ctx)
        try:
            capturing = self._capturing()
            if not capturing:
                (err,) = self._cuCtxSynchronize()
        finally:
            if pushed:
                drv.cuCtxPopCurrent()
        if capturing:
            raise driver_error(
                call, {"va": va, "size": size}, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
                f"a CUDA graph capture is underway ({capturing}); nothing was {done} and the "
                f"capture is untouched. {act} after the capture ends",
            )
        if err != self._ok:
            raise driver_error(
                call, {"va": va, "size": size}, _name(err),
                f"cuCtxSynchronize before the {call} returned it ({_describe(err)}); nothing "
                f"was {done}",
            )

    def _capturing(self) -> str:
        """Where a capture was seen ('' if none): torch's current stream, or a blocking one.

        Measured on an H200: ``cuCtxSynchronize`` while any stream of the context captures
        fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED *and invalidates the capture*, even
        with the thread's capture mode relaxed. So look first. torch captures on a non-blocking
        stream that it makes current; the legacy stream's query sees blocking streams only.
        A capture on another non-blocking stream is not seen and is invalidated by the sync.
        """
        fn = self._b.capture_check
        if fn is None:
            torch = sys.modules.get("torch")  # only if the process uses torch: never import
            if torch is not None and torch.cuda.is_initialized():
                # torch's current stream on *this driver's* device, as a raw pointer (torch's
                # own is_current_stream_capturing looks at its current device, which may be
                # another); the C fast path calls it too, once it is known.
                raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
                if raw is not None:
                    fn = functools.partial(raw, self.device)
                else:  # an older torch: its current device's stream, as a bool
                    fn = torch.cuda.is_current_stream_capturing
                self._b.capture_check = fn
        if fn is not None:
            got = fn()
            if isinstance(got, bool):
                if got:
                    return "on torch's current stream"
            elif self._stream_capturing(_cuda()._drv.CUstream(got)):
                return f"on torch's current stream of device {self.device}"
        if self._stream_capturing(self._legacy):
            return "on a blocking stream"
        return ""

    def _stream_capturing(self, stream: Any) -> bool:
        """``cuStreamIsCapturing`` says a capture is underway (or one on a blocking stream
        makes the legacy stream's query implicit); any other error: the synchronize
        reports it."""
        err, status = self._cuStreamIsCapturing(stream)
        return bool(err == self._implicit or (err == self._ok and status != self._capture_none))
