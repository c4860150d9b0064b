"""Sleep and wake: give every physical handle of an arena back, keep its VA, come back later.

``SleepMixin`` gives :class:`~kvvmm.arena.arena.Arena` :meth:`~SleepMixin.sleep` and
:meth:`~SleepMixin.wake`. A sleep remembers each mapping, optionally copies the bytes out
(:mod:`~kvvmm.arena.backup`), then unmaps and releases every handle; the reservation stays,
so tensors and captured graphs stay valid. A wake maps the same ranges at the same VA and
copies the bytes back: the snapshot is then exactly what it was before the sleep.

Both are transactions: a failed sleep leaves the arena awake with every byte, a failed wake
leaves it asleep with its backup intact. Past the point of no return, a release failing
after every unmap succeeded, the sleep stands and the handle is retried at the wake or at
``close()``.

While asleep, the VA reads as zeros on the host driver and on CUDA with ``zero_page``; on CUDA
without it any access faults. Commits, decommits, adopts and exports refuse with
:class:`~kvvmm.errors.AsleepError`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvvmm.arena.backup import Backup, bind_backup, check_backup, make_backup, unbind_backup
from kvvmm.arena.records import _Alloc, _Map, _runs, _Sleep
from kvvmm.arena.state import _ArenaState, _locked
from kvvmm.arena.transaction import Transaction
from kvvmm.checks import bool_arg
from kvvmm.driver.base import MemoryKind
from kvvmm.errors import ArgumentError, BackupError, KvvmmError, SleepRefusedError
from kvvmm.snapshot import MappingInfo
from kvvmm.units import fmt_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["SleepMixin", "SleepResult"]


@dataclass(frozen=True, slots=True)
class SleepResult:
    """What one :meth:`SleepMixin.sleep` did (a record: nothing live)."""

    backup: str | None  #: ``"host"``, ``"disk"``, another :class:`Backup`'s kind, or None
    given_bytes: int  #: physical bytes of the arena's mappings unmapped and released
    mappings: int  #: mappings given back (a wake makes as many)
    backup_bytes: int  #: bytes copied out (0 without a backup)
    pool_bytes: int  #: idle handles of the handle pool released too (0 with ``keep_pool``)
    #: seconds each step took (see :attr:`SleepMixin.last_phases`); {} where not measured
    phases: dict[str, float] = field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        kept = f", {fmt_bytes(self.backup_bytes)} kept in {self.backup}" if self.backup else ""
        pool = f", pool {fmt_bytes(self.pool_bytes)}" if self.pool_bytes else ""
        return (f"sleep: gave back {fmt_bytes(self.given_bytes)} in {self.mappings} "
                f"mappings{pool}{kept}")


class SleepMixin(_ArenaState):
    """Sleep and wake of an :class:`~kvvmm.arena.arena.Arena` (see the module docstring)."""

    @property
    def asleep(self) -> bool:
        """True between a :meth:`sleep` and the :meth:`wake` that ends it."""
        return self._sleeping is not None

    @property
    def asleep_bytes(self) -> int:
        """Bytes a :meth:`wake` backs again (0 when awake)."""
        s = self._sleeping
        return 0 if s is None else s.nbytes

    @property
    def sleep_backup(self) -> Backup | None:
        """The :class:`~kvvmm.arena.backup.Backup` a sleeping arena keeps its bytes in (None
        when awake, or asleep without a backup)."""
        s = self._sleeping
        return None if s is None else s.backup

    @property
    def last_phases(self) -> dict[str, dict[str, float]]:
        """Wall seconds per step of the last :meth:`sleep` and :meth:`wake` (a copy), keyed
        ``"sleep"`` / ``"wake"``: ``wait_inflight_s``, ``sync_s``, ``open_s``, ``copy_s``,
        ``flush_s``, ``give_back_s`` (sleep) or ``back_s`` (wake), ``total_s``, and the
        backup's own :attr:`Backup.phases` under ``backup.``."""
        return {k: dict(v) for k, v in self._phases_last.items()}

    _phases_last: dict[str, dict[str, float]] = {}  # noqa: RUF012 (replaced, never mutated)

    @_locked
    def sleep(self, backup: str | Backup | None = None, *, path: Any = None,
              keep_pool: bool = False) -> SleepResult:
        """Give back every handle the arena maps, keeping the reservation (so every
        tensor's pointer and captured graph stays valid). On CUDA the device is synchronized
        before anything is copied or unmapped.

        Args:
            backup: None (the bytes are dropped), ``"host"``, ``"disk"`` (a new file at
                ``path``), or a :class:`~kvvmm.arena.backup.Backup` no other sleep holds.
            path: the file for ``backup="disk"`` (must not exist; removed after the wake).
            keep_pool: keep the handle pool's idle handles (default: release them too).
        Returns:
            A :class:`SleepResult`.
        Raises:
            ArgumentError: a bad ``backup`` or ``path``, or a ``Backup`` held or spent;
                nothing changed.
            SleepRefusedError: asleep already, a capture is underway, or the arena maps
                adopted handles; nothing changed.
            BackupError: the copy-out failed: the arena is awake, every byte where it was.
            DriverError: an unmap failed (the arena is awake, every byte where it was), or a
                release failed after every unmap (the sleep stands; the handle is retried by
                :meth:`wake` or ``close()``).
            ClosedError: after ``close()``.
        """
        self._check_open("sleep")
        bool_arg("keep_pool", keep_pool)
        store = make_backup(backup, path)
        why = self.sleep_refusal("sleep")
        if why is not None:
            raise SleepRefusedError(why)
        if store is not None:  # refused if another sleep keeps its bytes there, or it is spent
            bind_backup(store, self, f"arena {self.name!r}")
        clock = _Clock()
        try:
            self._wait_inflight([(a, 0, a.size) for a in self._allocs])
            clock.lap("wait_inflight_s")
            plan = [(a, list(a.maps)) for a in self._allocs if a.maps]
            nbytes = sum(m.size for _, ms in plan for m in ms)
            self._sync_device()
            clock.lap("sync_s")
            if store is not None:
                self._copy(plan, store, "save", clock)
            given = self._give_back(plan, "sleep")  # a failed unmap maps all back, bytes intact
            clock.lap("give_back_s")
        except BaseException:
            self._keep_phases("sleep", clock, store)
            if store is not None:  # unbound again: the failed sleep changed nothing
                unbind_backup(store, self, "")
            raise
        self._sleeping = _Sleep(
            maps=[(a, [(m.offset, m.size, m.hid) for m in ms]) for a, ms in plan],
            backup=store, nbytes=nbytes)
        kind = None if store is None else store.kind
        self._note("sleep", backup=kind or "none", nbytes=nbytes)
        if self._work is not None:
            self._work("arena.sleep", sum(len(ms) for _, ms in plan))
        # Not the pool: a sleep gives the memory back to the device, not to the next commit.
        gone, self._gone = self._gone, []
        self._leftover += gone
        self._release_leftover("wake(), or close again, to retry")
        pool_bytes = 0
        pool = self._handle_pool
        if pool is not None and not keep_pool and pool.held_bytes:
            pool_bytes = pool.trim(pool.held_bytes)
        clock.lap("release_s")
        return SleepResult(backup=kind, given_bytes=sum(given.values()),
                           mappings=sum(len(ms) for _, ms in plan),
                           backup_bytes=nbytes if store is not None else 0,
                           pool_bytes=pool_bytes,
                           phases=self._keep_phases("sleep", clock, store))

    @_locked
    def wake(self) -> int:
        """Back every range the sleep gave back again (same sizes, same VA), copy it back.

        Each range gets one new handle; the snapshot is then exactly what it was before the
        sleep.

        Returns:
            Bytes backed again.
        Raises:
            SleepRefusedError: not asleep, or a CUDA graph capture is underway; nothing
                changed.
            DriverError: a create, map or set access failed: the arena is asleep, its backup
                intact.
            BackupError: the copy back failed: as for a DriverError.
            ClosedError: after ``close()``.
        """
        self._check_open("wake")
        why = self.sleep_refusal("wake")
        if why is not None:
            raise SleepRefusedError(why)
        s = self._sleeping
        assert s is not None  # sleep_refusal("wake") says so otherwise
        if s.backup is not None:  # only the bytes this arena's own sleep kept
            check_backup(s.backup, self)
        if self._leftover:  # a sleep's release that failed: the memory is needed now
            self._release_leftover("wake(), or close again, to retry")
        undo = Transaction()
        made: list[tuple[_Map, int]] = []
        clock = _Clock()
        try:
            for a, maps in s.maps:
                for off, size, hid in maps:
                    got: list[_Map] = []
                    self._back_gap(a, off - a.offset, off - a.offset + size, undo, got)
                    made.append((got[0], hid))
            clock.lap("back_s")
            if s.backup is not None:
                self._copy([(a, [m for m in a.maps]) for a, _ in s.maps], s.backup, "load",
                           clock)
        except BaseException as e:
            self._keep_phases("wake", clock, s.backup)
            undo.unwind(e)
            raise
        undo.commit()
        for m, hid in made:
            m.hid = hid
        self._sleeping = None
        self._keep_phases("wake", clock, s.backup)
        if s.backup is not None:  # a kept backup (HostBackup(keep=True)) stays for the next
            unbind_backup(s.backup, self, f"arena {self.name!r} woke from it", reuse=True)
        self._note("wake", nbytes=s.nbytes)
        if self._work is not None:
            self._work("arena.wake", len(made))
        return s.nbytes

    @_locked
    def sleep_refusal(self, what: str = "sleep") -> str | None:
        """Why :meth:`sleep` (or :meth:`wake`, ``what="wake"``) would be refused now, or None.

        What they would raise as :class:`~kvvmm.errors.SleepRefusedError`, asked without
        changing anything (a collective sleep's ranks agree on it first).

        Raises:
            ArgumentError: ``what`` is not ``"sleep"`` or ``"wake"``.
            ClosedError: after ``close()``.
        """
        self._check_open(what if what in ("sleep", "wake") else "sleep_refusal")
        if what == "wake":
            if self._sleeping is None:
                return f"arena {self.name!r}: wake() while awake (no sleep() to end)"
        elif what == "sleep":
            if self._sleeping is not None:
                return f"arena {self.name!r}: sleep() while asleep; wake() first"
            if self._adopted:
                return (f"arena {self.name!r}: sleep() with {len(self._adopted)} adopted "
                        f"handles mapped (memory another process shares: a wake could not "
                        f"bring it back); give those ranges back first")
        else:
            raise ArgumentError("what", what, "'sleep' or 'wake'")
        return self._capture_refusal(what)

    # -- helpers ------------------------------------------------------------------------

    def _keep_phases(self, what: str, clock: _Clock, store: Backup | None) -> dict[str, float]:
        """Record ``clock``'s laps (and ``store``'s phases) as the last ``what``'s."""
        got = dict(clock.laps)
        got["total_s"] = time.perf_counter() - clock.t0
        if store is not None:
            got.update({f"backup.{k}": v for k, v in store.phases.items()})
        self._phases_last = {**self._phases_last, what: got}
        return dict(got)

    def _copy(self, plan: list[tuple[_Alloc, list[_Map]]], store: Backup, how: str,
              clock: _Clock | None = None) -> None:
        """Copy each run of adjacent mappings out to ``store`` (``"save"``) or back from it
        (``"load"``), at consecutive positions; any failure is a :class:`BackupError`.
        ``clock`` gets the laps ``open_s`` (save only), ``copy_s`` and ``flush_s``."""
        clock = clock or _Clock()
        views: list[torch.Tensor] = []
        try:
            for _a, ms in plan:
                for run in _runs(ms):
                    start, end = run[0].offset, run[-1].offset + run[-1].size
                    views.append(self.tensor(start, (end - start,), "uint8"))  # type: ignore[attr-defined]
            if not views:
                if how == "save":
                    import torch

                    store.open(0, torch.empty(0, dtype=torch.uint8, device="meta"))
                return
            clock.lap("views_s")
            if how == "save":
                store.open(sum(v.numel() for v in views), views[0])
                clock.lap("open_s")
            pos = 0
            for i in range(len(views)):  # no loop variable: a traceback would keep it alive
                if how == "save":
                    store.save(pos, views[i])
                else:
                    store.load(pos, views[i])
                pos += views[i].numel()
            clock.lap("copy_s")
            store.flush(views[0].device)
            clock.lap("flush_s")
        except Exception as e:  # a failed save: the sleep drops the backup as it unbinds it
            if isinstance(e, KvvmmError):
                raise
            what = "copy-out to" if how == "save" else "copy back from"
            views.clear()
            # The cause's frames go: they hold tensors over the arena (the backup's
            # arguments), which would keep close() waiting for as long as the error lives.
            raise BackupError(f"arena {self.name!r}: the {what} the {store.kind} backup "
                              f"failed: {type(e).__name__}: {e}; the arena is "
                              + ("awake, every byte where it was" if how == "save" else
                                 "asleep, its backup intact")) from e.with_traceback(None)
        finally:
            views.clear()  # their leases end here, before any unmap

    def _torch_cuda(self) -> Any:
        """torch, when this arena's memory is CUDA's and the process has initialized CUDA."""
        if self.driver.memory is not MemoryKind.DEVICE:
            return None
        torch = sys.modules.get("torch")  # never import it just to ask
        if torch is None or not torch.cuda.is_initialized():
            return None
        return torch

    def _capture_refusal(self, what: str) -> str | None:
        torch = self._torch_cuda()
        if torch is None:
            return None
        with torch.cuda.device(self.device):
            capturing = torch.cuda.is_current_stream_capturing()
        if not capturing:
            return None
        return (f"arena {self.name!r}: {what}() during a CUDA graph capture on device "
                f"{self.device} (its synchronize and copies would break the capture); "
                f"nothing changed. Call it after the capture ends")

    def _sync_device(self) -> None:
        torch = self._torch_cuda()
        if torch is not None:
            torch.cuda.synchronize(self.device)

    def _asleep_mappings(self) -> tuple[MappingInfo, ...]:
        """For the snapshot: the mappings a wake makes again (() while awake)."""
        s = self._sleeping
        if s is None:
            return ()
        return tuple(MappingInfo(off, size, hid, a.name) for a, maps in s.maps
                     for off, size, hid in maps)

    def _drop_sleep(self) -> None:
        """At close: a sleeping arena's backup goes (nothing will wake it)."""
        s, self._sleeping = self._sleeping, None
        if s is not None and s.backup is not None:
            unbind_backup(s.backup, self, f"arena {self.name!r} closed asleep")


class _Clock:
    """Wall-clock laps of one sleep or wake: :meth:`lap` records the time since the last."""

    __slots__ = ("laps", "t", "t0")

    def __init__(self) -> None:
        self.t0 = self.t = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.t
        self.t = now
