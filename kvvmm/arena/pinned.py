"""Host memory for a backup, faulted in and pinned chunk by chunk while the copy runs.

Pinning a fresh buffer in one ``cudaHostRegister`` faults every page in, zeroes it, pins it
and describes it to the GPU before the first byte is copied (docs/SLEEP.md, "Where a sleep's
time goes"). :class:`HostMapping` splits that work: one mapping on a huge-page boundary, cut
into chunks; worker threads take the chunks in order, fault each in (``MADV_POPULATE_WRITE``,
without the GIL) and register it; the copy of chunk k is queued as soon as chunk k is
registered. Where the time went is kept in :attr:`HostMapping.phases`.

Off CUDA (the host driver) nothing is registered: the same chunks are faulted in by the same
threads, which is what tests exercise.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
import time
from typing import Any

__all__ = ["CHUNK_BYTES", "MAX_WORKERS", "HostMapping", "unpin", "unpin_later",
           "wait_unpinned"]

#: Transparent huge pages are 2 MiB on x86-64 and on arm64 with 4 KiB base pages: the
#: mapping starts on such a boundary and chunks are multiples of it.
HUGE = 2 << 20
#: The default chunk: small enough that the copy starts soon and the last chunk's copy is
#: short; large enough that a big backup is hundreds of registrations, not thousands.
CHUNK_BYTES = 256 << 20
#: Threads faulting in and pinning at most (zeroing is memory-bound well before this).
MAX_WORKERS = 8

_MADV_POPULATE_WRITE = 23  # Linux 5.14
_PAGE = mmap.PAGESIZE
_populate_ok = [True]  # False once the kernel refused MADV_POPULATE_WRITE


def _cudart() -> Any:
    import torch

    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _check_cuda(err: Any) -> None:
    import torch

    torch.cuda.check_error(err)


def _madvise(addr: int, n: int, advice: int) -> int:
    """``madvise`` through ctypes (the call releases the GIL, unlike ``mmap.madvise``);
    0 or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(addr, n, advice) == 0:
        return 0
    return ctypes.get_errno() or -1


class HostMapping:
    """``nbytes`` of host memory in one mapping on a huge-page boundary, made ready (faulted
    in, and registered with CUDA when ``pin``) chunk by chunk on worker threads. :meth:`wait`
    blocks until a chunk is ready; :meth:`close` stops the workers and gives everything back.

    Args:
        nbytes: the bytes, > 0.
        pin: register each chunk with the CUDA runtime (on ``device``).
        chunk_bytes: a multiple of 2 MiB.
        workers: threads, >= 1 (no more are started than there are chunks).
        device: the CUDA device index the registrations are made on (None: the thread's).
    Raises:
        OSError: the mapping failed (out of address space or memory).
    """

    def __init__(self, nbytes: int, *, pin: bool, chunk_bytes: int, workers: int,
                 device: int | None = None) -> None:
        import torch

        t0 = time.perf_counter()
        self.nbytes, self.pin, self.chunk_bytes, self.device = nbytes, pin, chunk_bytes, device
        self._map: mmap.mmap | None = mmap.mmap(-1, nbytes + HUGE,
                                                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            if hasattr(mmap, "MADV_HUGEPAGE"):
                with contextlib.suppress(OSError):  # THP off: 4 KiB pages, still pinned
                    self._map.madvise(mmap.MADV_HUGEPAGE)
            whole = torch.frombuffer(self._map, dtype=torch.uint8)
            skip = -whole.data_ptr() % HUGE
            self.buf: Any = whole[skip:skip + nbytes]
            del whole
        except BaseException:
            self._map.close()
            raise
        self.base = self.buf.data_ptr()
        #: (start, length) of each chunk, in order
        self.chunks = [(s, min(chunk_bytes, nbytes - s)) for s in range(0, nbytes, chunk_bytes)]
        self._ready = [False] * len(self.chunks)
        self._registered: list[int] = []  # chunk pointers registered, to unregister
        self._cond = threading.Condition()
        self._next = 0
        self._stop = False
        self._error: BaseException | None = None
        self._t0 = t0
        #: wall and thread seconds of each step (see :attr:`phases`)
        self._times = {"map_s": time.perf_counter() - t0, "fault_s": 0.0, "pin_s": 0.0,
                       "ready_s": 0.0, "wait_s": 0.0}
        self.workers = max(1, min(workers, len(self.chunks)))
        self._threads = [threading.Thread(target=self._work, name=f"kvvmm-pin-{i}",
                                          daemon=True) for i in range(self.workers)]
        for t in self._threads:
            t.start()

    @property
    def phases(self) -> dict[str, float]:
        """Seconds: ``map_s``, ``fault_s`` and ``pin_s`` (summed over the workers),
        ``ready_s`` (until the last chunk was ready), ``wait_s`` (the copy's wait for
        chunks); and ``chunks``, ``workers``."""
        with self._cond:
            return {**self._times, "chunks": float(len(self.chunks)),
                    "workers": float(self.workers)}

    def reset_times(self) -> None:
        """Zero the step times: a kept mapping serves another sleep (nothing to prepare)."""
        with self._cond:
            self._times.update(map_s=0.0, fault_s=0.0, pin_s=0.0, ready_s=0.0, wait_s=0.0)

    def _work(self) -> None:
        try:
            if self.pin and self.device is not None:
                import torch

                torch.cuda.set_device(self.device)  # this thread's registrations: its device
            while True:
                with self._cond:
                    if self._stop or self._next >= len(self.chunks):
                        return
                    i = self._next
                    self._next += 1
                start, n = self.chunks[i]
                t0 = time.perf_counter()
                self._fault_in(start, n)
                t1 = t2 = time.perf_counter()
                if self.pin:
                    self._register(self.base + start, n)
                    t2 = time.perf_counter()
                with self._cond:
                    self._times["fault_s"] += t1 - t0
                    self._times["pin_s"] += t2 - t1
                    self._ready[i] = True
                    if all(self._ready):
                        self._times["ready_s"] = t2 - self._t0
                    self._cond.notify_all()
        except BaseException as e:  # the copy's next wait raises it
            with self._cond:
                if self._error is None:
                    self._error = e
                self._stop = True
                self._cond.notify_all()

    def _fault_in(self, start: int, n: int) -> None:
        """Every page of ``[start, start + n)`` present and written (zeroed by the kernel)."""
        if _populate_ok[0]:
            err = _madvise(self.base + start, n, _MADV_POPULATE_WRITE)
            if err == 0:
                return
            if err not in (22, 95):  # EINVAL/EOPNOTSUPP: an older kernel; else out of memory
                raise OSError(err, f"madvise(MADV_POPULATE_WRITE) of {n} bytes failed")
            _populate_ok[0] = False
        self.buf[start:start + n][::_PAGE].fill_(0)  # one byte a page; torch drops the GIL

    def _register(self, ptr: int, n: int) -> None:
        _check_cuda(_cudart().cudaHostRegister(ptr, n, 0))
        with self._cond:
            self._registered.append(ptr)

    def wait(self, i: int) -> None:
        """Block until chunk ``i`` is ready; raise what a worker raised, if one failed."""
        if self._ready[i]:
            return
        t0 = time.perf_counter()
        with self._cond:
            while not self._ready[i]:
                if self._error is not None:
                    raise self._error
                self._cond.wait()
            self._times["wait_s"] += time.perf_counter() - t0

    def close(self, *, on_thread: bool) -> None:
        """Stop the workers (each ends the chunk it is on), then unregister every chunk
        registered and unmap: on a ``kvvmm-unpin`` thread with ``on_thread``. Idempotent.
        The caller has made sure no copy into the memory is still running."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()
        self._threads = []
        m, self._map = self._map, None
        if m is None:
            return
        self.buf = None  # a view of m: it must go before m.close()
        ptrs, self._registered = self._registered, []
        if on_thread and ptrs:
            unpin_later(m, ptrs)
        else:
            unpin(m, ptrs)


_unpinning: list[threading.Thread] = []


def unpin(m: mmap.mmap | None, ptrs: list[int]) -> None:
    """Give pinned host memory back: unregister each pointer and unmap ``m``; with no
    mapping (torch's pinned pieces), empty torch's pinned cache (a sleep's blocks are not
    wanted again soon)."""
    import torch

    if m is not None:
        for p in ptrs:
            _cudart().cudaHostUnregister(p)
        with contextlib.suppress(BufferError):  # a view still alive: unmapped when it goes
            m.close()
    else:
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()


def unpin_later(m: mmap.mmap | None, ptrs: list[int]) -> None:
    """:func:`unpin` on a daemon thread; :func:`wait_unpinned` joins them."""
    t = threading.Thread(target=unpin, args=(m, ptrs), name="kvvmm-unpin", daemon=True)
    _unpinning[:] = [u for u in _unpinning if u.is_alive()] + [t]
    t.start()


def wait_unpinned(timeout: float | None = None) -> bool:
    """Wait until every pinned backup dropped so far has gone back to the host; True when
    none is left (tests and benchmarks that measure host memory call it)."""
    for t in list(_unpinning):
        t.join(timeout)
    return not any(t.is_alive() for t in _unpinning)
