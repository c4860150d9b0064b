"""Tensor-parallel KV owners on torch.distributed: one resize agreed by every rank, or none.

Every rank of an engine must hold the same KV capacity. :class:`DistributedOwner` wraps each
rank's :class:`~kvvmm.owner.KvBufferOwner` and makes every change collective, in four phases:

1. **prepare** (local): the owner's own first step (``owner.prepare_finalize(n)`` and its
   kin, :mod:`kvvmm.owner.prepared`) checks the arguments and creates (or takes from the
   pool) the handles, mapping nothing;
2. **agree**: one ``all_reduce(MIN)`` of every rank's success (one slot per rank, so all
   learn which failed) and the op and its argument (as ``x`` and ``-x``: ranks that asked
   for different changes abort too). Any failure: every rank releases what it prepared;
3. **map**: ``PreparedBacking.map`` (it undoes itself if a map fails);
4. **confirm**: a second ``all_reduce(MIN)``. Any failure: every rank unmaps what it mapped
   (``PreparedBacking.undo``); else ``PreparedBacking.confirm``.

After a collective call either every rank holds the new backing, or every rank's bytes and
snapshot are as they were and every rank raises :class:`~kvvmm.errors.CollectiveError` (the
local failure is its ``__cause__``). The owner is the only way to the arena beneath it.

A collective waits at most ``timeout_s`` (default: the group's own). A rank that exits or
hangs breaks its peers' collective: they roll back and raise ``CollectiveError`` with the
phase that broke and ``failed_ranks=()``; the group is then unusable. On NCCL pass the
engine's CPU (gloo) group: NCCL's watchdog aborts the process rather than raising.

``shrink`` and ``decommit_pages`` give memory back, which cannot be undone: they agree on
the arguments before anything changes, and a rank whose own step fails is left as its owner
leaves it. ``commit_pages`` agrees on the page set (its count and a checksum). ``sleep`` and
``wake`` run the same four steps; a wake's undo is a sleep with the same backup.

Processes come from torchrun, or from :func:`~kvvmm.owner.spawn.spawn`
(``kvvmm.owner.distributed`` imports both).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

from kvvmm.arena.backup import Backup, DiskBackup, HostBackup, make_backup
from kvvmm.arena.sleep import SleepResult
from kvvmm.checks import int_arg, is_int, seconds_arg
from kvvmm.errors import (
    ArgumentError,
    ClosedError,
    CollectiveError,
    SleepRefusedError,
)
from kvvmm.owner.buffers import KvBufferOwner, _tokens
from kvvmm.owner.prepared import PreparedBacking
from kvvmm.snapshot import OwnerSnapshot, TpSnapshot

__all__ = ["DistributedOwner"]

#: Codes of the collective ops, agreed like the token count (ranks must run the same op).
_OPS = {"ensure_prefix": 1, "finalize": 2, "shrink": 3, "budget": 4, "commit_pages": 5,
        "decommit_pages": 6, "sleep": 7, "wake": 8}

#: A sleep's backup as the ranks agree on it (every rank keeps its bytes alike, or none).
_BACKUP_CODES = {None: 0, "host": 1, "disk": 2}


class _Broken(Exception):
    """A collective itself failed (a rank died, a timeout): carries torch's error."""


class DistributedOwner:
    """One rank's :class:`~kvvmm.owner.KvBufferOwner`, resized together with every other rank.

    Every rank wraps its own owner (same layout); each collective method must then be called
    by every rank, with the same arguments, in the same order.

    Args:
        owner: this rank's owner. The wrapper does not own it: close it yourself.
        group: the process group (default: the default group); a gloo group is the better
            choice (on NCCL the agreement tensors live on ``torch.cuda.current_device()``).
        timeout_s: longest wait of one collective, in seconds (default: the group's own
            timeout). Past it every rank rolls back and raises ``CollectiveError``.
        model: the model's name, shown in :meth:`gather_snapshot`'s ``TpSnapshot``.
    Raises:
        ArgumentError: no initialised process group, ``owner`` not an owner or closed, or a
            bad ``timeout_s``.
    """

    def __init__(self, owner: KvBufferOwner, *, group: Any = None,
                 timeout_s: float | None = None, model: str = "kv") -> None:
        import torch
        import torch.distributed as dist

        if not isinstance(owner, KvBufferOwner):
            raise ArgumentError("owner", owner, "a KvBufferOwner (this rank's)")
        if owner.closed:
            raise ArgumentError("owner", owner, "an open owner (it was closed)")
        if not (dist.is_available() and dist.is_initialized()):
            raise ArgumentError("group", group, "an initialised torch.distributed process "
                                                "group: call init_process_group first")
        if timeout_s is not None:  # None: the group's own timeout
            seconds_arg("timeout_s", timeout_s, zero=False)
        self.owner = owner
        self.group = group
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.model = str(model)
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)
        backend = str(dist.get_backend(group))
        # NCCL reduces CUDA tensors only; every other backend here takes CPU ones.
        self._device = (torch.device("cuda", torch.cuda.current_device())
                        if "nccl" in backend else torch.device("cpu"))

    def __repr__(self) -> str:
        return (f"DistributedOwner(rank {self.rank} of {self.world_size}, "
                f"{len(self.owner.descs)} buffers, final {self.owner.final_tokens})")

    # -- collectives ------------------------------------------------------------------------

    def _all_reduce_min(self, values: Sequence[int]) -> list[int]:
        """MIN over ranks of ``values``; raises _Broken when the collective fails or times out."""
        import torch
        import torch.distributed as dist

        try:
            t = torch.tensor(list(values), dtype=torch.int64, device=self._device)
            work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
            if work is None:  # pragma: no cover - async_op=True always gives a work handle
                raise RuntimeError("all_reduce gave no work handle")
            if self.timeout_s is None:
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=self.timeout_s))
            return [int(x) for x in t.cpu().tolist()]
        except Exception as e:  # gloo raises RuntimeError, NCCL DistBackendError, ...
            raise _Broken(f"{type(e).__name__}: {e}") from e

    def _agree_or_raise(self, what: str, code: int, n: int, local: BaseException | None, *,
                        key: int = 0) -> None:
        """Agree on the arguments of a change that cannot be undone once made (shrink,
        decommit_pages): raise CollectiveError on every rank unless every rank can go on."""
        try:
            failed, why = self._agree(code, n, ok=local is None, key=key)
        except _Broken as b:
            raise CollectiveError(what, "agree", f"the collective broke ({b})") from (
                local or b.__cause__)
        if failed or why:
            raise CollectiveError(what, "prepare", why or f"rank(s) {failed} refused",
                                  failed_ranks=tuple(failed)) from local

    def _agree(self, code: int, n: int, ok: bool, key: int = 0) -> tuple[list[int], str]:
        """One all_reduce: which ranks failed, and the reason ranks disagree ('' if they agree).

        ``n`` is the token count, or for page ops the number of pages, with ``key`` a
        checksum of the page ids (every op sends the slot, so every rank's vector has one
        length: ranks calling different ops must still meet in one all_reduce).
        """
        mine = [1] * self.world_size
        if not ok:
            mine[self.rank] = 0
        got = self._all_reduce_min([code, -code, n, -n, key, -key, *mine])
        failed = [r for r, s in enumerate(got[6:]) if s == 0]
        pages = code in (_OPS["commit_pages"], _OPS["decommit_pages"])
        why = ""
        if got[0] != -got[1]:
            names = {v: k for k, v in _OPS.items()}
            why = (f"ranks called different collectives ({names.get(got[0], got[0])} and "
                   f"{names.get(-got[1], -got[1])})")
        elif got[2] != -got[3] and code == _OPS["sleep"]:
            names = {v: repr(k) for k, v in _BACKUP_CODES.items()}
            why = (f"ranks asked for different backups ({names.get(got[2], 'a bad one')} "
                   f"and {names.get(-got[3], 'a bad one')})")
        elif got[2] != -got[3]:
            why = (f"ranks asked for different page sets, from {got[2]} to {-got[3]} pages"
                   if pages else
                   f"ranks asked for different token counts, from {got[2]} to {-got[3]}")
        elif got[4] != -got[5]:
            why = f"ranks asked for different page sets of {got[2]} pages (their ids differ)"
        return failed, why

    # -- the collective grow ----------------------------------------------------------------

    def _back_all(self, op: str, what: str, n_ok: int, key: int,
                  prepare: Callable[[], PreparedBacking]) -> int:
        """Prepare, agree, map, confirm: the owner's change ``prepare()`` makes (its own
        steps, :mod:`kvvmm.owner.prepared`), on every rank or none."""
        prepared: PreparedBacking | None = None
        try:
            prepared, local = self._prepare_step(op, prepare)
            self._agree_step(what, _OPS[op], n_ok, key, prepared, local)
            if prepared is None:  # pragma: no cover - every rank prepared, or the agree raised
                raise AssertionError("prepared")
            return self._map_step(what, _OPS[op], n_ok, key, prepared)
        except BaseException as e:
            if prepared is not None and not isinstance(e, Exception):
                prepared.undo(e)  # interrupted (Ctrl-C, SystemExit): undo what this call holds
            raise

    def _prepare_step(self, op: str, prepare: Callable[[], PreparedBacking]
                      ) -> tuple[PreparedBacking | None, BaseException | None]:
        """1. prepare: the owner checks and creates; nothing any tensor can reach changes."""
        try:
            if self.owner.closed:
                raise ClosedError(f"KvBufferOwner: {op} after close()")
            return prepare(), None
        except Exception as e:  # the owner released what it made
            return None, e

    def _agree_step(self, what: str, code: int, n_ok: int, key: int,
                    prepared: PreparedBacking | None, local: BaseException | None) -> None:
        """2. agree: every rank prepared the same change; else every rank undoes and raises."""
        try:
            failed, why = self._agree(code, n_ok, ok=local is None, key=key)
        except _Broken as b:
            err = CollectiveError(what, "agree", f"the collective broke ({b})",
                                  rolled_back=prepared is None or prepared.undo(None))
            raise err from (local or b.__cause__)
        if failed or why:
            clean = prepared is None or prepared.undo(local)
            reason = why or f"rank(s) {failed} failed to prepare"
            raise CollectiveError(what, "prepare", reason, failed_ranks=tuple(failed),
                                  rolled_back=clean) from local

    def _map_step(self, what: str, code: int, n_ok: int, key: int,
                  prepared: PreparedBacking) -> int:
        """3. map, 4. confirm: every rank mapped, the change is the owners'; else every rank
        gives back what it mapped."""
        local: BaseException | None = None
        try:
            prepared.map()
        except Exception as e:  # the owner undid this change
            local = e
        rolled = prepared.rolled_back
        try:
            failed, _ = self._agree(code, n_ok, ok=local is None, key=key)
        except _Broken as b:
            rolled = prepared.undo(b) and rolled
            err = CollectiveError(what, "confirm", f"the collective broke ({b})",
                                  rolled_back=rolled)
            for note in getattr(b, "__notes__", []):
                err.add_note(note)
            raise err from (local or b.__cause__)
        if failed:
            rolled = prepared.undo(local) and rolled
            err = CollectiveError(what, "map", f"rank(s) {failed} failed to map",
                                  failed_ranks=tuple(failed), rolled_back=rolled)
            for note in getattr(local, "__notes__", []):
                err.add_note(note)
            raise err from local
        prepared.confirm()
        return prepared.size_bytes

    # -- public collectives -----------------------------------------------------------------

    def finalize(self, n: int) -> int:
        """Collective :meth:`KvBufferOwner.finalize`: every rank backs its final span of ``n``.

        Args:
            n: tokens, the same on every rank, ``page_size <= n <= reserved_tokens``.
        Returns:
            Bytes newly backed on this rank.
        Raises:
            CollectiveError: on every rank, when any rank failed, the ranks disagree on
                ``n``, or a collective broke; every rank is as it was (``rolled_back``).
        """
        return self._back_all("finalize", f"finalize({n!r})", n if is_int(n) else -1, 0,
                              lambda: self.owner.prepare_finalize(n))

    def ensure_prefix(self, n: int) -> int:
        """Collective :meth:`KvBufferOwner.ensure_prefix` (the owner's growth policy sizes handles).

        Args:
            n: tokens, the same on every rank, in ``[0, max_prefix_tokens]`` (as the owner's).
        Returns:
            Bytes newly backed on this rank.
        Raises:
            CollectiveError: as :meth:`finalize`.
        """
        return self._back_all("ensure_prefix", f"ensure_prefix({n!r})",
                              n if is_int(n) else -1, 0,
                              lambda: self.owner.prepare_ensure_prefix(n))

    def shrink(self, n: int) -> int:
        """Collective :meth:`KvBufferOwner.shrink`: every rank gives back what lies beyond ``n``.

        The ranks agree on the arguments (every rank open, the same ``n``), then each
        shrinks. A shrink cannot be undone with its contents: a rank whose own shrink fails
        keeps its backing, the others' shrinks stand, and every rank caps its token counts
        at ``n``, so the capacities still agree.

        Returns:
            Bytes given back on this rank.
        Raises:
            CollectiveError: on every rank when the agreement failed (nothing changed,
                ``rolled_back`` True), or a rank's shrink failed or a collective broke after
                the shrinks (``phase`` "confirm", ``rolled_back`` False where it stood).
        """
        o = self.owner
        local: BaseException | None = None
        try:
            if o.closed:
                raise ClosedError("KvBufferOwner: shrink after close()")
            _tokens("n", n, lo=o.page_size, hi=o.reserved_tokens, what="page_size")
        except Exception as e:
            local = e

        def settle(err: BaseException) -> None:
            o._cap_tokens(n)

        return self._give_back_all(f"shrink({n!r})", "shrink", n if is_int(n) else -1, 0,
                                   local, lambda: o.shrink(n), settle,
                                   f"failed to shrink; the others' shrinks stand, every rank "
                                   f"serves at most {n} tokens")

    def _give_back_all(self, what: str, op: str, n_ok: int, key: int,
                       local: BaseException | None, step: Callable[[], int],
                       settle: Callable[[BaseException], None], failed_why: str) -> int:
        """Agree on the arguments, then give back on this rank (``step``); a rank whose step
        failed calls ``settle`` so that the ranks' records still agree, and every rank
        raises if any failed."""
        o = self.owner
        code = _OPS[op]
        self._agree_or_raise(what, code, n_ok, local, key=key)
        before = o.backed_bytes
        given = 0
        try:
            given = step()
        except Exception as e:
            local = e
            settle(e)
        try:
            failed, _ = self._agree(code, n_ok, ok=local is None, key=key)
        except _Broken as b:
            raise CollectiveError(what, "confirm", f"the collective broke ({b})",
                                  rolled_back=o.backed_bytes == before) from (local or b.__cause__)
        if failed:
            raise CollectiveError(what, "confirm", f"rank(s) {failed} {failed_why}",
                                  failed_ranks=tuple(failed),
                                  rolled_back=o.backed_bytes == before) from local
        return given

    # -- pages ------------------------------------------------------------------------------

    def _page_ids(self, op: str, pages: Iterable[int]) -> tuple[list[int], int, int,
                                                                 BaseException | None]:
        """Checked, sorted page ids; their count and checksum for the agreement (-1, 0: bad)."""
        o = self.owner
        try:
            if o.closed:
                raise ClosedError(f"KvBufferOwner: {op} after close()")
            # The owner's own check, so a page id is refused here exactly as it would be there.
            ids = o._check_pages(pages, "commit" if op == "commit_pages" else "decommit")
        except Exception as e:
            return [], -1, 0, e
        return ids, len(ids), _page_key(ids), None

    def commit_pages(self, pages: Iterable[int]) -> int:
        """Collective :meth:`KvBufferOwner.commit_pages`: every rank backs the pages, or none.

        The four phases over :meth:`KvBufferOwner.prepare_pages`; the ranks agree on the
        page set (its count and a checksum of the ids), and the pages join the owner's
        committed pages only at the confirm.

        Args:
            pages: page ids in ``[0, owner.pages)``, the same set on every rank.
        Returns:
            Bytes newly backed on this rank.
        Raises:
            CollectiveError: as :meth:`finalize` (a bad page id, a create or a map failed,
                the page sets differ, or a collective broke; the pages not committed).
        """
        ids, n_ok, key, bad = self._page_ids("commit_pages", pages)

        def prepare() -> PreparedBacking:
            if bad is not None:
                raise bad
            return self.owner.prepare_pages(ids)

        return self._back_all("commit_pages", f"commit_pages({n_ok} pages)", n_ok, key,
                              prepare)

    def decommit_pages(self, pages: Iterable[int]) -> int:
        """Collective :meth:`KvBufferOwner.decommit_pages`: every rank gives the pages back.

        As :meth:`shrink`, agreed on the page set: a rank whose own decommit fails keeps its
        bytes but forgets the pages as committed, like the others, so the next decommit of
        those pages frees them.

        Args:
            pages: page ids in ``[1, owner.pages)``, the same set on every rank.
        Returns:
            Bytes given back on this rank.
        Raises:
            CollectiveError: as :meth:`shrink`.
        """
        o = self.owner
        ids, n_ok, key, local = self._page_ids("decommit_pages", pages)

        def settle(err: BaseException) -> None:
            try:
                o.note_pages(ids, committed=False)
            except Exception as e2:
                err.add_note(f"rank {self.rank}: forgetting the pages also failed: {e2}")

        return self._give_back_all(f"decommit_pages({n_ok} pages)", "decommit_pages", n_ok,
                                   key, local, lambda: o.decommit_pages(ids), settle,
                                   "failed to decommit; the others' decommits stand, no rank "
                                   "keeps the pages committed")

    # -- sleep / wake -----------------------------------------------------------------------

    def sleep(self, backup: str | None = None, *, path: Any = None,
              keep_pool: bool = False) -> SleepResult:
        """Collective :meth:`KvBufferOwner.sleep`: every rank gives its memory back, or none.

        Prepare checks the arguments and what :meth:`Arena.sleep_refusal
        <kvvmm.arena.Arena.sleep_refusal>` refuses; the ranks agree (the same ``backup``
        kind); each sleeps; the ranks confirm, else the ranks that slept wake again: with a
        backup their bytes come back exactly, with ``backup=None`` as fresh memory.

        Args:
            backup: None, ``"host"`` or ``"disk"``, the same on every rank (a
                :class:`~kvvmm.arena.backup.Backup` object cannot be agreed on: refused).
            path: this rank's file for ``backup="disk"`` (must not exist).
            keep_pool: as for :meth:`KvBufferOwner.sleep`.
        Returns:
            This rank's :class:`~kvvmm.arena.SleepResult`.
        Raises:
            CollectiveError: on every rank when any rank refused or failed, the backups
                differ, or a collective broke: ``phase`` "prepare" (nothing changed),
                "sleep" (the ranks that slept woke again: ``rolled_back``; a rank whose wake
                failed is asleep with its backup, see the notes) or "agree"/"confirm" (this
                rank rolled back as for "sleep"). The local failure is the ``__cause__``.
        """
        o = self.owner
        what = f"sleep({backup!r})"
        code = _OPS["sleep"]
        store, local = self._prepare_sleep(backup, path)
        kind = _BACKUP_CODES.get(backup, -1) if isinstance(backup, (str, type(None))) else -1
        try:
            self._agree_or_raise(what, code, kind, local)
        except BaseException:
            if store is not None:
                store.drop()  # never opened: no file was made
            raise

        def undo(err: BaseException) -> bool:
            return self._undo(o.wake, err, "waking again (the undo of its sleep)",
                              "it is asleep, its backup intact")

        result: SleepResult = self._change_all(
            what, "sleep", kind, lambda: o.sleep(store, keep_pool=keep_pool),
            lambda: o.asleep, undo, "failed to sleep; the ranks that slept woke again")
        return result

    def _prepare_sleep(self, backup: object, path: Any
                       ) -> tuple[Backup | None, BaseException | None]:
        """The backup made (not opened) and this rank's refusal, if any (then no backup)."""
        o = self.owner
        store: Backup | None = None
        try:
            if o.closed:
                raise ClosedError("KvBufferOwner: sleep after close()")
            if not (backup is None or isinstance(backup, str)):
                raise ArgumentError("backup", backup, "None, 'host' or 'disk' (the same on "
                                                      "every rank)")
            store = make_backup(backup, path)
            why = o.arena.sleep_refusal("sleep")
            if why is not None:
                raise SleepRefusedError(why)
        except Exception as e:
            if store is not None:
                store.drop()
            return None, e
        return store, None

    def wake(self) -> int:
        """Collective :meth:`KvBufferOwner.wake`: every rank backs its memory again, or none.

        The same steps as :meth:`sleep`. When a rank's wake fails, the ranks that woke sleep
        again with the backup their sleep had, so every rank is asleep with its bytes and a
        later :meth:`wake` retries all of them.

        Returns:
            Bytes backed again on this rank.
        Raises:
            CollectiveError: on every rank when any rank refused or failed, or a collective
                broke: ``phase`` "prepare" (nothing changed) or "wake"/"confirm" (the ranks
                that woke slept again: ``rolled_back``; a rank whose sleep failed is awake
                with its bytes, see the notes). The local failure is the ``__cause__``.
        """
        o = self.owner
        local: BaseException | None = None
        again: tuple[Any, Any] = (None, None)
        try:
            if o.closed:
                raise ClosedError("KvBufferOwner: wake after close()")
            why = o.arena.sleep_refusal("wake")
            if why is not None:
                raise SleepRefusedError(why)
            again = _backup_of(o)
        except Exception as e:
            local = e
        self._agree_or_raise("wake()", _OPS["wake"], 0, local)

        def undo(err: BaseException) -> bool:
            return self._undo(lambda: o.sleep(again[0], path=again[1]), err,
                              "sleeping again (the undo of its wake)", "it is awake with its bytes")

        added: int = self._change_all("wake()", "wake", 0, o.wake, lambda: not o.asleep, undo,
                                      "failed to wake; the ranks that woke slept again")
        return added

    def _change_all(self, what: str, op: str, kind: int, step: Callable[[], Any],
                    changed: Callable[[], bool], undo: Callable[[BaseException], bool],
                    failed_why: str) -> Any:
        """Run ``step`` on this rank, then confirm every rank's; else ``undo`` where
        ``changed()`` says this call changed the owner (also when interrupted)."""
        code = _OPS[op]
        local: BaseException | None = None
        done = False
        try:
            result = None
            try:
                result = step()
            except Exception as e:
                local = e
            done = changed()  # a sleep's release failing past the unmaps: the sleep stands
            try:
                failed, _ = self._agree(code, kind, ok=local is None)
            except _Broken as b:
                rolled = not done or undo(b)
                done = False
                raise CollectiveError(what, "confirm", f"the collective broke ({b})",
                                      rolled_back=rolled) from (local or b.__cause__)
            if failed:
                err = CollectiveError(what, op, f"rank(s) {failed} {failed_why}",
                                      failed_ranks=tuple(failed), rolled_back=True)
                err.rolled_back = not done or undo(err)
                done = False
                raise err from local
            done = False  # confirmed: the change is the owner's now
            return result
        except BaseException as e:
            if done and not isinstance(e, Exception):  # interrupted: undo this call's change
                undo(e)
            raise

    def _undo(self, call: Callable[[], Any], err: BaseException, what: str, state: str) -> bool:
        """Run the undo ``call``; False (and a note on ``err``) if it failed."""
        try:
            call()
        except Exception as e:
            err.add_note(f"rank {self.rank}: {what} failed: {type(e).__name__}: {e}; {state}")
            return False
        return True

    # -- budget -----------------------------------------------------------------------------

    def budget_bytes(self, headroom_bytes: int = 0) -> int:
        """Bytes every rank can back: the least over ranks of ``free - headroom + backed``.

        ``free`` is the driver's ``mem_info()`` now; ``backed`` what this owner holds. As
        SGLang's ``get_available_gpu_memory(distributed=True)``: the smallest rank decides.

        Args:
            headroom_bytes: bytes to leave free on each rank, >= 0.
        Returns:
            The budget in bytes, the same on every rank.
        Raises:
            ArgumentError: bad ``headroom_bytes`` (on every rank: the call aborts on all).
            CollectiveError: the collective broke, or a rank refused its arguments.
        """
        local: BaseException | None = None
        mine = 0
        try:
            int_arg("headroom_bytes", headroom_bytes, lo=0, unit="bytes")
            free, _ = self.owner.arena.driver.mem_info()
            mine = max(0, free - headroom_bytes) + self.owner.backed_bytes
        except Exception as e:
            local = e
        ok = [1] * self.world_size
        if local is not None:
            ok[self.rank] = 0
        try:
            got = self._all_reduce_min([mine, *ok])
        except _Broken as b:
            raise CollectiveError("budget_bytes()", "agree",
                                  f"the collective broke ({b})") from (local or b.__cause__)
        failed = tuple(r for r, s in enumerate(got[1:]) if s == 0)
        if failed:
            raise CollectiveError("budget_bytes()", "prepare", f"rank(s) {list(failed)} failed",
                                  failed_ranks=failed) from local
        return got[0]

    def finalize_bytes(self, n: int) -> int:
        """Bytes this owner holds after ``finalize(n)`` (local, pure: nothing changes)."""
        return self.owner.finalize_bytes(n)

    def fit_tokens(self, budget_bytes: int) -> int:
        """The most tokens ``finalize`` can back within ``budget_bytes`` (local, pure).

        Raises:
            ArgumentError: not even ``page_size`` tokens fit.
        """
        o = self.owner
        lo, hi = o.page_size, o.reserved_tokens
        if self.finalize_bytes(lo) > budget_bytes:
            raise ArgumentError("budget_bytes", budget_bytes,
                                f">= {self.finalize_bytes(lo)} (what finalize(page_size="
                                f"{lo}) backs)")
        while lo < hi:  # finalize_bytes grows with n: the largest n that fits
            mid = (lo + hi + 1) // 2
            if self.finalize_bytes(mid) <= budget_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def finalize_to_budget(self, headroom_bytes: int = 0) -> int:
        """:meth:`budget_bytes`, :meth:`fit_tokens`, then :meth:`finalize`: all ranks alike.

        Returns:
            The token count every rank was finalized to.
        Raises:
            CollectiveError: as :meth:`finalize` (a budget too small for one page aborts
                every rank, naming the ranks, with the ArgumentError as cause).
        """
        budget = self.budget_bytes(headroom_bytes)
        try:
            n = self.fit_tokens(budget)
        except ArgumentError:
            n = self.owner.page_size - 1  # refused in prepare on every rank alike
        self.finalize(n)
        return n

    # -- snapshots --------------------------------------------------------------------------

    def snapshot(self) -> OwnerSnapshot:
        """This rank's owner snapshot (local)."""
        return self.owner.snapshot()

    def gather_snapshot(self, dst: int = 0) -> TpSnapshot | None:
        """Every rank's snapshot, gathered on rank ``dst`` of the group (collective).

        Returns:
            On ``dst``: a :class:`~kvvmm.snapshot.TpSnapshot` in rank order; elsewhere None.
        Raises:
            CollectiveError: the gather broke (a rank died, the group's timeout).
        """
        import torch.distributed as dist

        mine = (self.owner.arena.device, self.owner.snapshot())
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        try:
            target = dst if self.group is None else dist.get_global_rank(self.group, dst)
            dist.gather_object(mine, out, dst=target, group=self.group)
        except Exception as e:
            raise CollectiveError("gather_snapshot()", "gather",
                                  f"the collective broke ({type(e).__name__}: {e})") from e
        if out is None:
            return None
        return TpSnapshot(model=self.model, tp=self.world_size,
                          devices=tuple(int(d) for d, _ in out),
                          owners=tuple(s for _, s in out))


def _backup_of(owner: KvBufferOwner) -> tuple[Any, Any]:
    """``(backup, path)`` for ``sleep`` to sleep a sleeping owner again the way it slept: the
    same kind and file; a host backup with the same settings (a kept one is passed again, so
    the sleep copies into the memory it already holds)."""
    store = owner.arena.sleep_backup
    if store is None:
        return None, None
    if isinstance(store, DiskBackup):
        return "disk", store.path
    if isinstance(store, HostBackup):
        if store.keep:
            return store, None
        return HostBackup(store.memory, free_on_thread=store.free_on_thread,
                          chunk_bytes=store.chunk_bytes, workers=store.workers), None
    return store.kind, None


def _page_key(ids: Sequence[int]) -> int:
    """A checksum of a sorted page set, the same in every process (``hash`` is per process
    for some types, and a sum would let two different sets agree); 56 bits fit the int64
    all_reduce with room for its negation."""
    digest = hashlib.blake2b(",".join(map(str, ids)).encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big")
