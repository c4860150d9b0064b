"""Tensor-parallel KV caches: one :class:`~kvvmm.owner.KvBufferOwner` per device.

With tensor parallelism of degree T a model's KV heads are split over T GPUs, and each GPU
keeps the KV buffers of its own heads: T owners with the same layout (the presets shard with
``tp=T``), one per device. Two ways to build them:

- in one process, over drivers you pass (``TpOwners(drivers, model=...)``); on the
  simulator ``TpOwners.on_sim("llama-3.1-70b", tp=8)`` lays out eight H200s on a laptop, on
  one :class:`~kvvmm.driver.sim.SimNode` (shared VA space, peers);
- one process per GPU, as serving engines run (``spawn_tp_snapshots("cuda", tp=8, ...)``):
  each process opens its own driver and owner and sends back a snapshot. Processes are
  started with multiprocessing's *spawn* method, never fork: a process that forks after CUDA
  is initialised hands its child a CUDA state that cannot be used.

Each rank is its own transaction: when one rank fails, ranks before it keep what they did
(in serving each rank is a process of its own that fails alone); the error names them.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kvvmm.driver.base import Driver
from kvvmm.dtypes import dtype_name
from kvvmm.errors import ArgumentError, KvvmmError
from kvvmm.layout import KvBufferDesc, ModelLike, load_model, model_descs
from kvvmm.owner import KvBufferOwner
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


class TpWorkerError(KvvmmError):
    """A per-device worker process failed; the message carries its traceback.

    Raised in the parent after every worker has ended (or was stopped on timeout): the
    reason is in the worker, so read its traceback, fix the cause, and run again.
    """


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

    Every rank has the same layout (its share of the KV heads; MLA latents whole on each
    rank), so one list serves all. Hybrid sliding-window models are refused here as by
    :func:`~kvvmm.layout.model_descs` (two pools per rank: use ``hybrid_swa_descs``).

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
        if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= node.devices:
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


def _worker(conn: Any, fn: Callable[..., Any], rank: int, device: int,
            args: tuple[Any, ...]) -> None:
    try:
        result = fn(rank, device, *args)
    except BaseException as e:  # everything goes back to the parent, as text
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    else:
        conn.send(("ok", result))
    finally:
        conn.close()


def run_per_device(
    fn: Callable[..., T],
    devices: Sequence[int],
    *args: Any,
    timeout_s: float = 600.0,
) -> list[T]:
    """Run ``fn(rank, device, *args)`` in one new process per device; return the results.

    The processes are *spawned* (a fresh interpreter each; never forked: a fork of a
    process that has initialised CUDA cannot use CUDA). ``fn`` must be importable by name
    (a module-level function), and its arguments and result picklable. They run at the same
    time, one per device, as tensor-parallel ranks do.

    Args:
        fn: called as ``fn(rank, device, *args)`` in the child.
        devices: device ordinal of each rank.
        args: more arguments for ``fn``.
        timeout_s: wall-clock limit for all of them together; workers still running then
            are terminated.
    Returns:
        ``fn``'s results in rank order.
    Raises:
        TpWorkerError: a worker raised, died without a result, or ran out of time (every
            failed rank is named, with its traceback).
    """
    devs = list(devices)
    if not devs:
        raise ArgumentError("devices", devices, "a non-empty sequence of device ordinals")
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank, dev in enumerate(devs):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, args=(child, fn, rank, dev, tuple(args)),
                        name=f"kvvmm-rank{rank}", daemon=True)
        p.start()
        child.close()
        procs.append((p, parent))
    deadline = time.monotonic() + timeout_s
    results: list[Any] = [None] * len(devs)
    problems: list[str] = []
    for rank, (p, conn) in enumerate(procs):
        left = max(0.0, deadline - time.monotonic())
        try:
            got = conn.recv() if conn.poll(left) else ("error", f"no result in {timeout_s} s")
        except EOFError:
            got = ("error", "the process ended without sending a result (crashed?)")
        conn.close()
        p.join(max(0.0, deadline - time.monotonic()) if got[0] == "ok" else 5.0)
        if p.is_alive():
            p.terminate()
            p.join(5.0)
        if got[0] == "ok":
            results[rank] = got[1]
        else:
            problems.append(f"rank {rank} (device {devs[rank]}, exit code {p.exitcode}): "
                            f"{got[1]}")
    if problems:
        raise TpWorkerError(f"{len(problems)} of {len(devs)} workers failed:\n"
                            + "\n".join(problems))
    return results


def _tp_rank(rank: int, device: int, kind: str, options: Mapping[str, Any],
             spec: Mapping[str, Any]) -> OwnerSnapshot:
    """One rank in its own process: open the driver, build the owner, snapshot, close."""
    from kvvmm.driver import open_driver

    drv = open_driver(kind, device=device, **options)
    try:
        owner = KvBufferOwner(driver=drv, dtype=spec["dtype"], page_size=spec["page_size"],
                              reserved_tokens=spec["reserved_tokens"], descs=spec["descs"],
                              policy=spec["policy"], name=f"{spec['name']}.tp{rank}")
        try:
            if spec["finalize_tokens"] is not None:
                owner.finalize(spec["finalize_tokens"])
            return owner.snapshot()
        finally:
            owner.close()
    finally:
        close = getattr(drv, "close", None)
        if callable(close):
            close()


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

    Each process opens ``open_driver(kind, device=<its device>, **driver_options)``, builds
    its rank's :class:`KvBufferOwner`, finalizes it to ``finalize_tokens`` (when given),
    snapshots and closes it. On ``"cuda"`` that is one process per GPU, as serving engines
    run tensor parallelism; on ``"host"`` and ``"sim"`` the same path runs without a GPU
    (the host driver reports the rank's device ordinal).

    Args:
        kind: ``"cuda"``, ``"host"``, ``"sim"`` or ``"auto"`` (see ``open_driver``).
        model, tp, dtype, page_size, reserved_tokens, layout, policy: the layout.
        finalize_tokens: tokens to finalize each rank to, or None (slot 0 only).
        devices: device of each rank (default ``0 .. tp-1``).
        driver_options: more options for ``open_driver``.
        name: arena name prefix.
        timeout_s: limit for all ranks together.
    Returns:
        A :class:`TpSnapshot` in rank order.
    Raises:
        ArgumentError: bad layout arguments (checked here, before any process starts).
        TpWorkerError: a rank failed in its process.
    """
    m = load_model(model)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ArgumentError("tp", tp, "an int >= 1 (tensor-parallel ranks)")
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
