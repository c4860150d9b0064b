"""Where a sleeping arena keeps its bytes: host memory, or a file through ``mmap``.

:meth:`Arena.sleep <kvvmm.arena.Arena.sleep>` copies every backed range out before it gives
the memory back; :meth:`Arena.wake <kvvmm.arena.Arena.wake>` copies it back into fresh handles
at the same VA. The copies are torch ``copy_`` calls between a tensor over the arena's VA
(:meth:`Arena.tensor <kvvmm.arena.Arena.tensor>`) and one over the backup, so this module
knows nothing of drivers.

- ``"host"`` (:class:`HostBackup`): on CUDA, pinned host memory (only pinned memory copies
  at the link's bandwidth), copied ``non_blocking`` with one synchronize at the end. Either
  ``memory="mmap"`` (default: one anonymous huge-page mapping, faulted in and registered in
  chunks on worker threads while each chunk's copy runs, :mod:`~kvvmm.arena.pinned`) or
  ``"torch"`` (torch's pinned allocator, in power-of-two pieces: :func:`pow2_pieces`). The
  driver's mapping of pinned memory costs 0.19% of its size on the device while it exists.
  Unpinning is slow, so :meth:`HostBackup.drop` unpins on a thread of its own. On the host
  driver a plain CPU tensor; on the simulator a ``meta`` tensor, nothing copied.
- ``"disk"`` (:class:`DiskBackup`): a new file, allocated up front (a full disk fails before
  anything is given back, not as a SIGBUS mid-copy), mapped and viewed as one CPU tensor;
  removed when the backup is dropped. Slower than ``"host"``: for when host memory is short.

Figures: docs/SLEEP.md. A backup that fails raises what its allocator raised; the arena
turns that into :class:`~kvvmm.errors.BackupError` after undoing its own steps.

A backup keeps one sleep's bytes, and they are that arena's: the sleep that first uses it
binds it until the wake (or ``close()``) that ends it. Passing it to another sleep meanwhile,
using it once spent (woken, closed or dropped) and dropping it while a sleep holds it are
refused with a typed error before anything changes; a failed sleep unbinds it for a retry.
A kept backup (``HostBackup(keep=True)``) is not spent by its wake: a later sleep (of any
arena) may bind it again.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from kvvmm.arena.pinned import (
    CHUNK_BYTES,
    HUGE,
    MAX_WORKERS,
    HostMapping,
    unpin,
    unpin_later,
    wait_unpinned,
)
from kvvmm.checks import bool_arg, int_arg
from kvvmm.errors import ArgumentError, BackupError, StateError

if TYPE_CHECKING:
    import torch

__all__ = ["BACKUPS", "HOST_MEMORY", "Backup", "DiskBackup", "HostBackup", "bind_backup",
           "check_backup", "make_backup", "pow2_pieces", "unbind_backup", "wait_unpinned"]

#: The ``backup=`` names :meth:`Arena.sleep <kvvmm.arena.Arena.sleep>` takes (None: no backup).
BACKUPS = ("host", "disk")

#: torch's pinned host blocks are powers of two; larger pieces than this buy nothing and a
#: single 64 GiB block is slow to pin in one call.
_MAX_PIECE = 1 << 30

#: How :class:`HostBackup` gets pinned memory on CUDA (see the module docstring).
HOST_MEMORY = ("mmap", "torch")

_HUGE = HUGE  # chunks are whole huge pages (see kvvmm.arena.pinned)

#: Guards every backup's binding: two arenas (two locks) may be handed one backup at once.
_binding = threading.Lock()


class Backup:
    """Bytes kept for a sleeping arena: :meth:`open` once, :meth:`save` each range at its
    position, :meth:`load` them back, :meth:`drop` at the end.

    Subclass it to keep the bytes elsewhere (tests subclass it to fail a step). Every method
    may raise: the arena undoes what it did and reports a :class:`~kvvmm.errors.BackupError`.
    :meth:`open`, :meth:`save` and :meth:`load` are the arena's to call; a subclass's
    :meth:`drop` calls ``super().drop()`` first (it refuses while a sleep holds the backup).
    One backup serves one sleep (see the module docstring).
    """

    kind = "backup"
    nbytes = 0  #: bytes the backup holds (set by :meth:`open`)
    # The binding, as class defaults so a subclass need not call an __init__:
    _holder: object = None  # the arena whose sleep keeps its bytes here; None: no sleep
    _holder_name = ""  # that arena, for messages
    _spent = ""  # why no sleep may use it again ("" while one may)

    @property
    def reusable(self) -> bool:
        """True when a wake leaves the backup for the next sleep instead of spending and
        dropping it (``HostBackup(keep=True)``); False here."""
        return False

    @property
    def phases(self) -> dict[str, float]:
        """Seconds the last :meth:`open` and its copies spent in each step, as far as the
        backup knows them ({} here); :meth:`Arena.sleep <kvvmm.arena.Arena.sleep>` reports
        them under ``backup.``."""
        return {}

    @property
    def holder(self) -> str | None:
        """The arena whose sleep keeps its bytes here (its description), or None."""
        return self._holder_name if self._holder is not None else None

    def __repr__(self) -> str:
        state = (f"holding {self._holder_name}'s sleep" if self._holder is not None
                 else f"spent: {self._spent}" if self._spent else "unused")
        return f"<{type(self).__name__} {self.kind!r}, {state}>"

    def open(self, nbytes: int, like: torch.Tensor) -> None:
        """Make room for ``nbytes``; ``like`` is a tensor over the arena (its device says
        where the bytes come from: ``meta`` means there are none)."""
        raise NotImplementedError

    def save(self, pos: int, src: torch.Tensor) -> None:
        """Copy ``src`` (uint8, 1-D, over the arena's VA) to ``[pos, pos + len(src))``."""
        raise NotImplementedError

    def load(self, pos: int, dst: torch.Tensor) -> None:
        """Copy ``[pos, pos + len(dst))`` back into ``dst`` (over the arena's VA)."""
        raise NotImplementedError

    def flush(self, device: torch.device) -> None:
        """Wait until every copy made so far has landed (a device synchronize on CUDA)."""
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)

    def drop(self) -> None:
        """Give the backup's memory (or file) back; idempotent. Afterwards no sleep may use it.

        Raises:
            StateError: a sleeping arena keeps its bytes here (its wake, or its ``close()``,
                drops the backup); nothing changed.
        """
        with _binding:
            if self._holder is not None:
                raise StateError(f"{self!r}: drop() while {self._holder_name} sleeps with its "
                                 f"bytes here (its wake() or close() drops it); nothing "
                                 f"changed")
            if not self._spent:
                self._spent = "dropped"


def bind_backup(store: Backup, holder: object, name: str) -> None:
    """Bind ``store`` to the sleep ``holder`` (an arena, described by ``name``) begins.

    Called before the sleep changes anything: :func:`unbind_backup` ends the binding.

    Raises:
        ArgumentError: ``store`` keeps another sleep's bytes (this arena's or another's), or
            is spent (a wake or close ended its sleep, or it was dropped); nothing changed.
    """
    with _binding:
        if store._holder is not None:
            raise ArgumentError("backup", store, "a Backup no sleep holds",
                                f"{store._holder_name}'s sleep keeps its bytes in it: a "
                                f"backup keeps one sleep's bytes; pass a new one")
        if store._spent:
            raise ArgumentError("backup", store, "a Backup no sleep has used",
                                f"it is spent ({store._spent}): a backup serves one sleep; "
                                f"pass a new one")
        store._holder, store._holder_name = holder, name


def unbind_backup(store: Backup, holder: object, spent: str, *, reuse: bool = False) -> None:
    """End ``holder``'s binding of ``store`` and drop it: the sleep failed (``spent=""``: the
    backup may serve a retry) or ended (``spent`` says how: no sleep may use it again).

    With ``reuse`` (a wake) and a :attr:`~Backup.reusable` backup, the binding ends but the
    backup is neither dropped nor spent: the next sleep may bind it again.

    Raises:
        BackupError: ``holder`` does not hold ``store`` (nothing changed); or what
            :meth:`Backup.drop` raised.
    """
    check_backup(store, holder)
    if reuse and store.reusable:
        with _binding:
            store._holder, store._holder_name = None, ""
        return
    with _binding:  # spent at once: no other sleep binds it while its bytes are dropped
        store._holder, store._holder_name = None, ""
        store._spent = spent or "a failed sleep is dropping it"
    try:
        store.drop()
    finally:
        store._spent = spent


def check_backup(store: Backup, holder: object) -> None:
    """Raise :class:`~kvvmm.errors.BackupError` unless ``holder``'s sleep holds ``store``
    (a wake reads only the bytes its own sleep kept)."""
    if store._holder is not holder:
        who = store._holder_name or "no sleep"
        raise BackupError(f"{store!r} holds {who}'s bytes, not this arena's: refused; "
                          f"nothing changed")


class HostBackup(Backup):
    """The bytes in host memory, pinned on CUDA (see the module docstring).

    Args:
        memory: ``"mmap"`` (default: :mod:`~kvvmm.arena.pinned`) or ``"torch"`` (torch's
            pinned host allocator). Only CUDA pins.
        free_on_thread: give pinned memory back on a thread of its own at :meth:`drop`
            (default), so a wake does not wait for the unpinning.
        chunk_bytes: ``"mmap"``: the bytes faulted in and registered at a time, a multiple
            of 2 MiB (default 256 MiB).
        workers: ``"mmap"``: threads faulting in and registering chunks (default: the CPU
            count, 8 at most).
        keep: keep the memory after the wake (default False), so the next sleep that passes
            it (of any arena) copies into memory already pinned. Meanwhile it holds its size
            in locked host memory and, on CUDA, 0.19% of it on the device; :meth:`drop`
            gives both back.
    Raises:
        ArgumentError: an unknown ``memory``, a non-bool ``free_on_thread`` or ``keep``, a
            ``chunk_bytes`` that is not a positive multiple of 2 MiB, a ``workers`` outside
            1..64.
    """

    kind = "host"

    def __init__(self, memory: str = "mmap", *, free_on_thread: bool = True,
                 chunk_bytes: int = CHUNK_BYTES, workers: int | None = None,
                 keep: bool = False) -> None:
        if memory not in HOST_MEMORY:
            raise ArgumentError("memory", memory, f"one of {list(HOST_MEMORY)}")
        bool_arg("free_on_thread", free_on_thread)
        bool_arg("keep", keep)
        int_arg("chunk_bytes", chunk_bytes, lo=_HUGE, limit="a positive multiple of 2 MiB")
        if chunk_bytes % _HUGE:
            raise ArgumentError("chunk_bytes", chunk_bytes, "a positive multiple of 2 MiB")
        if workers is None:
            workers = max(1, min(MAX_WORKERS, os.cpu_count() or 1))
        int_arg("workers", workers, lo=1, hi=64)
        self.memory = memory
        self.free_on_thread = free_on_thread
        self.chunk_bytes, self.workers, self.keep = chunk_bytes, workers, keep
        self._pieces: list[tuple[int, Any]] = []  # (start, tensor), in order
        self._host: HostMapping | None = None  # the "mmap" memory: piece i is its chunk i
        self._device: Any = None  # where the copies run (a device synchronize before unpinning)
        self._unflushed = False  # copies queued since the last flush
        self._phases: dict[str, float] = {}

    @property
    def reusable(self) -> bool:
        """``keep``: a wake leaves the memory for the next sleep (see the class docstring)."""
        return self.keep

    @property
    def phases(self) -> dict[str, float]:
        """Where the last :meth:`open` and its copies spent their time (seconds; see
        :attr:`HostMapping.phases <kvvmm.arena.pinned.HostMapping.phases>` for the
        ``"mmap"`` memory's own); ``reused`` is 1 when a kept backup's memory served the
        sleep; ``open_s`` the :meth:`open` call (torch's pinned allocator's whole time)."""
        got = dict(self._phases)
        if self._host is not None:
            got.update(self._host.phases)
        return got

    def open(self, nbytes: int, like: torch.Tensor) -> None:
        import torch

        t0 = time.perf_counter()
        kind = like.device.type
        host = self._host
        if host is not None and kind == self._device.type and host.nbytes >= nbytes:
            self.nbytes = nbytes  # a kept backup: its memory, pinned and ready, serves again
            self._pieces = [(s, host.buf[s:s + n]) for s, n in host.chunks if s < nbytes]
            host.reset_times()
            self._phases = {"reused": 1.0, "open_s": time.perf_counter() - t0}
            return
        if host is not None:  # kept, but too small (or another device's): a new one
            self._free()
        self.nbytes = nbytes
        self._device = like.device
        pieces: list[tuple[int, Any]] = []
        if kind == "meta":
            pieces.append((0, torch.empty(nbytes, dtype=torch.uint8, device="meta")))
        elif self.memory == "mmap" and nbytes > 0 and kind in ("cpu", "cuda"):
            cuda = kind == "cuda"
            host = HostMapping(nbytes, pin=cuda, chunk_bytes=self.chunk_bytes,
                               workers=self.workers,
                               device=getattr(like.device, "index", None) if cuda else None)
            self._host = host
            pieces = [(s, host.buf[s:s + n]) for s, n in host.chunks]
        elif kind != "cuda" or nbytes == 0:
            pieces.append((0, torch.empty(nbytes, dtype=torch.uint8)))
        else:
            pos = 0
            for size in pow2_pieces(nbytes):
                pieces.append((pos, torch.empty(size, dtype=torch.uint8, pin_memory=True)))
                pos += size
        self._pieces = pieces
        self._phases = {"reused": 0.0, "open_s": time.perf_counter() - t0}

    def _spans(self, pos: int, n: int) -> list[tuple[int, Any, int, int, int]]:
        """``(piece_index, piece, piece_offset, offset_in_range, length)`` covering
        ``[pos, pos + n)``."""
        out = []
        first = max(0, bisect.bisect_right(self._pieces, pos, key=lambda p: p[0]) - 1)
        for i in range(first, len(self._pieces)):
            start, t = self._pieces[i]
            if start >= pos + n:
                break
            lo, hi = max(pos, start), min(pos + n, start + t.numel())
            if lo < hi:
                out.append((i, t, lo - start, lo - pos, hi - lo))
        return out

    def save(self, pos: int, src: torch.Tensor) -> None:
        host = self._host
        for i, t, at, off, n in self._spans(pos, src.numel()):
            if host is not None:
                host.wait(i)  # this chunk pinned; the next ones are being pinned meanwhile
            self._unflushed = True
            t[at:at + n].copy_(src[off:off + n], non_blocking=True)

    def load(self, pos: int, dst: torch.Tensor) -> None:
        host = self._host
        for i, t, at, off, n in self._spans(pos, dst.numel()):
            if host is not None:
                host.wait(i)
            self._unflushed = True
            dst[off:off + n].copy_(t[at:at + n], non_blocking=True)

    def flush(self, device: torch.device) -> None:
        t0 = time.perf_counter()
        super().flush(device)
        self._unflushed = False
        self._phases["flush_s"] = time.perf_counter() - t0

    def drop(self) -> None:
        super().drop()
        self._free()

    def _free(self) -> None:
        """Give the memory back (pinned: on a thread with ``free_on_thread``), once any copy
        still queued into or out of it has landed."""
        if self._unflushed and self._device is not None and self._device.type == "cuda":
            import torch

            with contextlib.suppress(Exception):  # a broken context copies nothing more
                torch.cuda.synchronize(self._device)
        self._unflushed = False
        pinned = any(t.device.type == "cpu" and t.is_pinned() for _, t in self._pieces)
        self._pieces = []  # torch's pinned blocks go back to its cache (fast)
        host, self._host = self._host, None
        if host is not None:
            host.close(on_thread=self.free_on_thread)
        elif pinned:
            (unpin_later if self.free_on_thread else unpin)(None, [])


class DiskBackup(Backup):
    """The bytes in a new file at ``path``, through ``mmap`` (see the module docstring).

    Args:
        path: a file that does not exist yet (refused otherwise: a sleep never overwrites
            a file); removed when the backup is dropped.
    Raises:
        ArgumentError: ``path`` is not a str or path, or names an existing file.
    """

    kind = "disk"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise ArgumentError("path", path, "a file path (str or os.PathLike) for "
                                              "backup='disk'")
        self.path = os.fspath(path)
        if os.path.lexists(self.path):
            raise ArgumentError("path", self.path, "a file that does not exist yet (a sleep "
                                                   "never overwrites one)")
        self._fd = -1
        self._map: mmap.mmap | None = None
        self._buf: Any = None

    def open(self, nbytes: int, like: torch.Tensor) -> None:
        import torch

        self.nbytes = nbytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._fd = fd
        try:
            if like.device.type == "meta" or nbytes == 0:
                os.ftruncate(fd, nbytes)  # no bytes to keep: a sparse file of the right size
                self._buf = torch.empty(nbytes, dtype=torch.uint8, device="meta")
                return
            os.posix_fallocate(fd, 0, nbytes)  # ENOSPC here, not SIGBUS mid-copy
            self._map = mmap.mmap(fd, nbytes)
            self._buf = torch.frombuffer(self._map, dtype=torch.uint8)
        except BaseException:
            self.drop()
            raise

    def save(self, pos: int, src: torch.Tensor) -> None:
        self._buf[pos:pos + src.numel()].copy_(src)

    def load(self, pos: int, dst: torch.Tensor) -> None:
        dst.copy_(self._buf[pos:pos + dst.numel()])

    def drop(self) -> None:
        super().drop()
        self._buf = None  # the tensor exports the map's buffer: it must go before close
        if self._map is not None:
            m, self._map = self._map, None
            m.close()
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):  # removed by someone else: fine
                os.unlink(self.path)


def make_backup(backup: object, path: object) -> Backup | None:
    """The :class:`Backup` for ``sleep(backup=..., path=...)``; None for no backup.

    Raises:
        ArgumentError: an unknown ``backup``, a ``path`` without ``backup="disk"``, or a bad
            ``path``.
    """
    if isinstance(backup, Backup):
        if path is not None:
            raise ArgumentError("path", path, "None when backup is a Backup object")
        return backup
    if backup is None or backup == "host":
        if path is not None:
            raise ArgumentError("path", path, "None unless backup='disk'")
        return None if backup is None else HostBackup()
    if backup == "disk":
        if path is None:
            raise ArgumentError("path", path, "a file path: backup='disk' needs one")
        return DiskBackup(path)  # type: ignore[arg-type]
    raise ArgumentError("backup", backup, f"None, one of {list(BACKUPS)} or a Backup")


def pow2_pieces(nbytes: int) -> list[int]:
    """``nbytes`` as power-of-two sizes, largest first, none above 1 GiB: the pinned blocks a
    ``HostBackup(memory="torch")`` asks torch for (its pinned allocator rounds every block up
    to a power of two, so these sum to ``nbytes`` with nothing wasted).

    Args:
        nbytes: the bytes to cut, an int >= 0.
    Returns:
        The piece sizes, largest first; ``[]`` for 0.
    """
    big, rest = divmod(nbytes, _MAX_PIECE)
    return [_MAX_PIECE] * big + [1 << b for b in range(rest.bit_length() - 1, -1, -1)
                                 if rest >> b & 1]
