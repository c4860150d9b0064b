"""Tensor-parallel KV caches: one :class:`~kvvmm.owner.KvBufferOwner` per device.

With tensor parallelism of degree T each GPU keeps the KV buffers of its own heads: T owners
with the same layout (the presets shard with ``tp=T``). Two ways to build them:

- in one process, over drivers you pass (``TpOwners(drivers, model=...)``, or
  ``TpOwners.on_sim("llama-3.1-70b", tp=8)`` on one :class:`~kvvmm.driver.sim.SimNode`).
  Each rank's resize is its own transaction: when one rank fails, ranks before it keep what
  they did (the error names them). ``sleep`` and ``wake`` are one transaction over all ranks;
- one process per GPU, as engines run: each wraps its owner in a
  :class:`~kvvmm.owner.distributed.DistributedOwner`. :func:`spawn_tp_snapshots` and
  :func:`run_per_device` are thin conveniences over :func:`kvvmm.owner.distributed.spawn`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kvvmm.arena.backup import make_backup
from kvvmm.arena.sleep import SleepResult
from kvvmm.checks import int_arg, is_int, seconds_arg
from kvvmm.driver.base import Driver
from kvvmm.dtypes import dtype_name
from kvvmm.errors import ArgumentError, ClosedError, SleepRefusedError
from kvvmm.layout import KvBufferDesc, ModelLike, load_model, model_descs
from kvvmm.owner.buffers import KvBufferOwner
from kvvmm.owner.collective import DistributedOwner, _backup_of
from kvvmm.owner.spawn import TpWorkerError, _spawn
from kvvmm.policy import GrowthPolicy
from kvvmm.snapshot import OwnerSnapshot, TpSnapshot

if TYPE_CHECKING:
    from kvvmm.driver.sim import DeviceProfile, SimNode

__all__ = [
    "TpOwners",
    "TpSnapshot",
    "TpWorkerError",
    "run_per_device",
    "spawn_tp_snapshots",
    "tp_descs",
]

T = TypeVar("T")


def tp_descs(
    model: ModelLike,
    *,
    tp: int,
    reserved_tokens: int,
    page_size: int,
    dtype: object,
    layout: str = "token_major",
) -> list[KvBufferDesc]:
    """The KV buffers of one rank of ``model`` at tensor-parallel degree ``tp``.

    Every rank has the same layout, so one list serves all (hybrid sliding-window models
    are refused, as by :func:`~kvvmm.layout.model_descs`).

    Raises:
        ArgumentError: ``tp`` does not fit the model's KV heads, or bad sizes.
    """
    return model_descs(model, layout=layout, reserved_tokens=reserved_tokens,
                       page_size=page_size, dtype=dtype, tp=tp)


class TpOwners:
    """One KV owner per device, same layout, rank ``i`` on ``drivers[i]``.

    Args:
        drivers: one driver per rank; ``tp = len(drivers)``.
        model: the model (a shipped name, a config path or a ModelConfig).
        dtype, page_size, reserved_tokens, policy: as for :class:`KvBufferOwner`, per rank.
        layout: ``"token_major"`` or ``"page_major"``.
        name: arena name prefix; rank ``i``'s arena is ``f"{name}.tp{i}"``.
    Raises:
        ArgumentError: no drivers, two ranks on one device, or ``tp`` not fitting the model.
        DriverError: a rank could not be built; the ranks built before it are closed again.
    """

    def __init__(
        self,
        drivers: Sequence[Driver],
        *,
        model: ModelLike,
        dtype: Any,
        page_size: int,
        reserved_tokens: int,
        layout: str = "token_major",
        policy: GrowthPolicy | None = None,
        name: str = "kv",
    ) -> None:
        if isinstance(drivers, (str, bytes)) or not isinstance(drivers, Sequence) or not drivers:
            raise ArgumentError("drivers", drivers, "a non-empty sequence of drivers, one a rank")
        devices = tuple(d.device for d in drivers)
        if len(set(devices)) != len(devices):
            raise ArgumentError("drivers", list(devices),
                                "drivers of distinct devices (one rank per device)")
        self.model = load_model(model)
        self.tp = len(drivers)
        self.devices = devices
        self.descs = tp_descs(self.model, tp=self.tp, reserved_tokens=reserved_tokens,
                              page_size=page_size, dtype=dtype, layout=layout)
        self.owners: list[KvBufferOwner] = []
        try:
            for rank, drv in enumerate(drivers):
                self.owners.append(KvBufferOwner(
                    driver=drv, dtype=dtype, page_size=page_size,
                    reserved_tokens=reserved_tokens, descs=self.descs, policy=policy,
                    name=f"{name}.tp{rank}",
                ))
        except BaseException as e:
            e.add_note(f"TpOwners: rank {len(self.owners)} of {self.tp} failed; the ranks "
                       "before it were closed again")
            for o in self.owners:
                o.close()
            self.owners = []
            raise

    @classmethod
    def on_sim(
        cls,
        model: ModelLike,
        *,
        tp: int,
        profile: str | DeviceProfile = "h200",
        dtype: Any = "bfloat16",
        page_size: int = 16,
        reserved_tokens: int,
        layout: str = "token_major",
        policy: GrowthPolicy | None = None,
        node: SimNode | None = None,
        **node_options: Any,
    ) -> TpOwners:
        """``tp`` simulated GPUs of one :class:`SimNode` (made here unless given), one owner each.

        ``node_options`` go to :class:`SimNode` (``capacity_bytes``, ``no_peer``, ...).
        Addresses are deterministic: rank 0 reserves first, then rank 1, ...
        """
        from kvvmm.driver.sim import SimNode

        if node is None:
            node = SimNode(profile, devices=tp, **node_options)
        elif node_options:
            raise ArgumentError("node_options", sorted(node_options),
                                "none when a node is given (it is already made)")
        if not is_int(tp) or not 1 <= tp <= node.devices:
            raise ArgumentError("tp", tp, f"an int in [1, {node.devices}] (the node's devices)")
        return cls([node.driver(i) for i in range(tp)], model=model, dtype=dtype,
                   page_size=page_size, reserved_tokens=reserved_tokens, layout=layout,
                   policy=policy)

    def __repr__(self) -> str:
        return f"TpOwners({self.model.name!r}, tp={self.tp}, devices={list(self.devices)})"

    def __enter__(self) -> TpOwners:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _each(self, what: str, fn: Callable[[KvBufferOwner], int]) -> int:
        total = 0
        for rank, owner in enumerate(self.owners):
            try:
                total += fn(owner)
            except BaseException as e:
                if rank:
                    e.add_note(f"TpOwners.{what}: ranks 0..{rank - 1} already did it; rank "
                               f"{rank} is as it was, later ranks were not asked")
                raise
        return total

    def ensure_prefix(self, n: int) -> int:
        """``ensure_prefix(n)`` on every rank; returns bytes newly backed on all of them."""
        return self._each("ensure_prefix", lambda o: o.ensure_prefix(n))

    def finalize(self, n: int) -> int:
        """``finalize(n)`` on every rank (n tokens each); returns bytes newly backed."""
        return self._each("finalize", lambda o: o.finalize(n))

    def shrink(self, n: int) -> int:
        """``shrink(n)`` on every rank; returns bytes given back."""
        return self._each("shrink", lambda o: o.shrink(n))

    # -- sleep / wake: every rank or none --------------------------------------------------

    @property
    def asleep(self) -> bool:
        """True when every rank is asleep (a sleep and a wake here move all of them)."""
        return bool(self.owners) and all(o.asleep for o in self.owners)

    def sleep(self, backup: str | None = None, *, paths: Sequence[Any] | None = None,
              keep_pool: bool = False) -> tuple[SleepResult, ...]:
        """Every rank's :meth:`KvBufferOwner.sleep`, all of them or none.

        One transaction over the ranks: every rank's arguments and refusals are checked
        before any sleeps; when rank ``k``'s sleep fails, ranks ``0..k-1`` wake again (with
        ``backup=None``, on fresh memory).

        Args:
            backup: None, ``"host"`` or ``"disk"``, for every rank.
            paths: for ``"disk"``, one new file per rank, in rank order.
            keep_pool: as for :meth:`KvBufferOwner.sleep`.
        Returns:
            Each rank's :class:`~kvvmm.arena.sleep.SleepResult`, in rank order.
        Raises:
            ArgumentError: bad ``backup`` or ``paths`` (a path per rank for ``"disk"``, none
                otherwise); nothing changed.
            SleepRefusedError: a rank would refuse, named in the message; nothing changed.
            BackupError, DriverError: a rank's sleep failed: the ranks before it woke again
                (the notes name any whose wake failed).
            ClosedError: after ``close()``.
        """
        self._check_open("sleep")
        per_rank = self._sleep_paths(backup, paths)
        stores = [make_backup(backup, p) for p in per_rank]  # checks each path, makes none
        for rank, o in enumerate(self.owners):
            why = o.arena.sleep_refusal("sleep")
            if why is not None:
                raise SleepRefusedError(f"TpOwners.sleep: rank {rank}: {why}")
        results: list[SleepResult] = []
        for rank, (o, store) in enumerate(zip(self.owners, stores, strict=True)):
            try:
                results.append(o.sleep(store, keep_pool=keep_pool))
            except BaseException as e:
                for s in stores[rank + 1:]:
                    if s is not None:
                        s.drop()
                self._undo_ranks(list(range(rank + (1 if o.asleep else 0))),
                                 lambda r: self.owners[r].wake(), e,
                                 f"TpOwners.sleep: rank {rank} of {self.tp} failed",
                                 "that had slept woke again", "it is asleep, its backup intact")
                raise
        return tuple(results)

    def _sleep_paths(self, backup: object, paths: Sequence[Any] | None) -> list[Any]:
        """Each rank's backup file (None for every rank unless ``backup="disk"``), checked:
        one kind for every rank, one distinct path a rank for ``"disk"``."""
        if backup is not None and not isinstance(backup, str):
            raise ArgumentError("backup", backup, "None, 'host' or 'disk' (one kind for "
                                                  "every rank)")
        if backup == "disk":
            if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence) \
                    or len(paths) != self.tp:
                raise ArgumentError("paths", paths, f"{self.tp} file paths, one a rank, for "
                                                    f"backup='disk'")
            per_rank: list[Any] = list(paths)
        elif paths is not None:
            raise ArgumentError("paths", paths, "None unless backup='disk'")
        else:
            per_rank = [None] * self.tp
        if len({str(p) for p in per_rank if p is not None}) < sum(p is not None
                                                                  for p in per_rank):
            raise ArgumentError("paths", paths, "distinct files (one a rank)")
        return per_rank

    def _undo_ranks(self, ranks: Sequence[int], undo: Callable[[int], object],
                    e: BaseException, head: str, done: str, stuck_state: str) -> None:
        """The undo of a partial sleep or wake: ``undo(rank)`` for ``ranks`` in reverse,
        what it did (and any failure) in notes on ``e``."""
        stuck = []
        for r in reversed(ranks):
            try:
                undo(r)
            except Exception as e2:
                stuck.append(r)
                e.add_note(f"rank {r}: its undo also failed: {type(e2).__name__}: {e2}; "
                           f"{stuck_state}")
        e.add_note(f"{head}; {len(ranks) - len(stuck)} rank(s) {done}"
                   + (f", ranks {stuck} not" if stuck else ""))

    def wake(self) -> int:
        """Every rank's :meth:`KvBufferOwner.wake`, all of them or none.

        Every rank must be asleep (checked first). When rank ``k``'s wake fails, ranks
        ``0..k-1`` sleep again with the backup their sleep had, so a later :meth:`wake`
        retries them all.

        Returns:
            Bytes backed again on all ranks.
        Raises:
            SleepRefusedError: a rank is awake, or a capture is underway; nothing changed.
            DriverError, BackupError: a rank's wake failed: the ranks before it slept again
                (the notes name any whose sleep failed: awake with its bytes).
            ClosedError: after ``close()``.
        """
        self._check_open("wake")
        for rank, o in enumerate(self.owners):
            why = o.arena.sleep_refusal("wake")
            if why is not None:
                raise SleepRefusedError(f"TpOwners.wake: rank {rank}: {why}")
        again = [_backup_of(o) for o in self.owners]
        total = 0
        for rank, o in enumerate(self.owners):
            try:
                total += o.wake()
            except BaseException as e:
                self._undo_ranks(list(range(rank)),
                                 lambda r: self.owners[r].sleep(again[r][0], path=again[r][1]),
                                 e, f"TpOwners.wake: rank {rank} of {self.tp} failed",
                                 "that had woken slept again", "it is awake with its bytes")
                raise
        return total

    def _check_open(self, what: str) -> None:
        if not self.owners or any(o.closed for o in self.owners):
            raise ClosedError(f"TpOwners: {what} after close()")

    @property
    def backed_bytes(self) -> int:
        return sum(o.backed_bytes for o in self.owners)

    def snapshot(self) -> TpSnapshot:
        """Every rank's owner snapshot, in rank order."""
        return TpSnapshot(model=self.model.name, tp=self.tp, devices=self.devices,
                          owners=tuple(o.snapshot() for o in self.owners))

    def close(self) -> None:
        """Close every rank's owner (idempotent); the first failure is raised at the end."""
        first: BaseException | None = None
        for o in self.owners:
            try:
                o.close()
            except Exception as e:  # close the others anyway
                if first is None:
                    first = e
        if first is not None:
            raise first


# -- one process per device --------------------------------------------------------------


def _per_device(rank: int, world: int, fn: Callable[..., Any], devices: Sequence[int],
                args: tuple[Any, ...]) -> Any:
    return fn(rank, devices[rank], *args)


def run_per_device(
    fn: Callable[..., T],
    devices: Sequence[int],
    *args: Any,
    timeout_s: float = 600.0,
) -> list[T]:
    """Run ``fn(rank, device, *args)`` in one new process per device; return the results.

    A thin wrapper over :func:`kvvmm.owner.distributed.spawn` (a gloo group on loopback
    while ``fn`` runs). ``fn`` must be a module-level function, its arguments and result
    picklable.

    Args:
        fn: called as ``fn(rank, device, *args)`` in the child.
        devices: device ordinal of each rank.
        args: more arguments for ``fn``.
        timeout_s: wall-clock limit for all of them together.
    Returns:
        ``fn``'s results in rank order.
    Raises:
        TpWorkerError: a worker raised, died or ran out of time (each failed rank named).
    """
    devs = list(devices)
    if not devs:
        raise ArgumentError("devices", devices, "a non-empty sequence of device ordinals")
    seconds_arg("timeout_s", timeout_s, zero=False)
    return _spawn(_per_device, len(devs), (fn, devs, tuple(args)), backend="gloo",
                  timeout_s=float(timeout_s), group_timeout_s=min(float(timeout_s), 600.0),
                  label=lambda r: f"device {devs[r]}, ")


def _tp_rank(rank: int, device: int, kind: str, options: Mapping[str, Any],
             spec: Mapping[str, Any]) -> OwnerSnapshot:
    """One rank in its own process: open the driver, build the owner, finalize, snapshot."""
    from kvvmm.driver import driver_for

    drv = driver_for(kind, device=device, **options)
    try:
        owner = KvBufferOwner(driver=drv, dtype=spec["dtype"], page_size=spec["page_size"],
                              reserved_tokens=spec["reserved_tokens"], descs=spec["descs"],
                              policy=spec["policy"], name=f"{spec['name']}.tp{rank}")
        try:
            if spec["finalize_tokens"] is not None:  # every rank or none
                DistributedOwner(owner, model=spec["name"]).finalize(spec["finalize_tokens"])
            return owner.snapshot()
        finally:
            owner.close()
    finally:
        drv.close()


def spawn_tp_snapshots(
    kind: str,
    *,
    model: ModelLike,
    tp: int,
    dtype: Any = "bfloat16",
    page_size: int = 16,
    reserved_tokens: int,
    finalize_tokens: int | None = None,
    layout: str = "token_major",
    policy: GrowthPolicy | None = None,
    devices: Iterable[int] | None = None,
    driver_options: Mapping[str, Any] | None = None,
    name: str = "kv",
    timeout_s: float = 600.0,
) -> TpSnapshot:
    """Build one rank's owner per device, each in its own spawned process; return snapshots.

    Each process opens ``driver_for(kind, device=<its device>, **driver_options)``, builds
    its rank's :class:`KvBufferOwner`, finalizes it collectively to ``finalize_tokens``
    (when given), snapshots and closes it.

    Args:
        kind: ``"cuda"``, ``"host"``, ``"sim"`` or ``"auto"`` (see ``open_driver``).
        model, tp, dtype, page_size, reserved_tokens, layout, policy: the layout.
        finalize_tokens: tokens to finalize each rank to, or None (slot 0 only).
        devices: device of each rank (default ``0 .. tp-1``).
        driver_options: more options for :func:`~kvvmm.driver.driver_for`.
        name: arena name prefix.
        timeout_s: limit for all ranks together.
    Returns:
        A :class:`TpSnapshot` in rank order.
    Raises:
        ArgumentError: bad layout arguments (checked here, before any process starts).
        TpWorkerError: a rank failed in its process.
    """
    seconds_arg("timeout_s", timeout_s, zero=False)
    m = load_model(model)
    int_arg("tp", tp, lo=1, limit="an int >= 1 (tensor-parallel ranks)")
    devs = tuple(range(tp)) if devices is None else tuple(devices)
    if len(devs) != tp or len(set(devs)) != tp:
        raise ArgumentError("devices", list(devs), f"{tp} distinct device ordinals")
    descs = tp_descs(m, tp=tp, reserved_tokens=reserved_tokens, page_size=page_size,
                     dtype=dtype, layout=layout)
    spec = {"dtype": dtype_name(dtype), "page_size": page_size, "reserved_tokens": reserved_tokens,
            "descs": descs, "policy": policy, "finalize_tokens": finalize_tokens, "name": name}
    snaps = run_per_device(_tp_rank, devs, kind, dict(driver_options or {}), spec,
                           timeout_s=timeout_s)
    return TpSnapshot(model=m.name, tp=tp, devices=devs, owners=tuple(snaps))
