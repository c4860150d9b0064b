"""A world of processes on loopback for the lab and tests: :func:`spawn` runs a function in
``world_size`` spawned processes of one ``torch.distributed`` process group, as torchrun would
(engines launch with torchrun itself), and :class:`TpWorkerError` says which rank failed and
why. :func:`kvvmm.owner.tp.run_per_device` is the same with one process a device.

The collective owner these processes run is :mod:`kvvmm.owner.collective`.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from kvvmm.checks import int_arg, seconds_arg
from kvvmm.errors import KvvmmError

__all__ = ["TpWorkerError", "spawn"]

T = TypeVar("T")


class TpWorkerError(KvvmmError):
    """A spawned rank's process failed; the message carries its traceback (fix the cause
    there and run again). ``results``: rank -> what the ranks that finished returned;
    ``failures``: rank -> the reason of each failed rank."""

    def __init__(self, message: str, *, results: dict[int, Any] | None = None,
                 failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.results: dict[int, Any] = dict(results or {})
        self.failures: dict[int, str] = dict(failures or {})


def _free_port() -> int:
    # Free now; another process could take it before rank 0's store binds it (rare).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawned(rank: int, fn: Callable[..., Any], world: int, backend: str, port: int,
             group_timeout_s: float, args: tuple[Any, ...], results: Any) -> None:
    """One rank in its spawned process: join the group, run ``fn``, leave, report."""
    import torch.distributed as dist

    # What torchrun sets, so code written for torchrun runs here unchanged.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    try:
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=group_timeout_s))
        try:
            payload = pickle.dumps(fn(rank, world, *args))  # now, so a bad result is ours
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # everything goes back to the parent, as text
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    else:
        results.put((rank, "ok", payload))


def _spawn(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], *, backend: str,
           timeout_s: float, group_timeout_s: float, label: Callable[[int], str]) -> list[Any]:
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import start_processes

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = start_processes(  # type: ignore[no-untyped-call]  # torch leaves it untyped
        _spawned, args=(fn, world_size, backend, _free_port(), group_timeout_s, tuple(args),
                        results),
        nprocs=world_size, join=False, start_method="spawn").processes
    got: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    ended_at: float | None = None
    while len(got) < world_size:
        now = time.monotonic()
        if now >= deadline:
            break
        try:
            rank, status, payload = results.get(timeout=min(0.1, deadline - now))
            got[rank] = (status, payload)
            continue
        except queue.Empty:
            pass
        # All ended: give what they sent a moment to arrive, then stop waiting.
        if all(p.exitcode is not None for p in procs):
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at > 1.0:
                break
    stopped: set[int] = set()
    for rank, p in enumerate(procs):
        p.join(max(0.0, min(5.0, deadline - time.monotonic())))
        if p.is_alive():
            stopped.add(rank)
            p.terminate()
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()
    ok: dict[int, Any] = {}
    failures: dict[int, str] = {}
    for rank, p in enumerate(procs):
        status, payload = got.get(rank, ("error", None))
        if status == "ok":
            ok[rank] = pickle.loads(payload)
            continue
        if payload is None:
            payload = (f"no result in {timeout_s} s (stopped)" if rank in stopped
                       else "the process ended without sending a result (crashed?)")
        failures[rank] = f"rank {rank} ({label(rank)}exit code {p.exitcode}): {payload}"
    results.close()
    if failures:
        raise TpWorkerError(f"{len(failures)} of {world_size} workers failed:\n"
                            + "\n".join(failures[r] for r in sorted(failures)),
                            results=ok, failures=failures)
    return [ok[r] for r in range(world_size)]


def spawn(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    group_timeout_s: float = 60.0,
) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes of one process group.

    For the lab and tests (engines use torchrun). The processes are spawned, never forked
    (a fork after CUDA is initialised cannot use CUDA), set what torchrun sets, and join the
    group before ``fn``. ``fn`` must be a module-level function, its arguments and result
    picklable.

    Args:
        fn: called as ``fn(rank, world_size, *args)`` in each process.
        world_size: processes, >= 1.
        args: more arguments for ``fn``.
        backend: ``"gloo"`` (CPU, any machine) or ``"nccl"`` (one GPU a rank).
        timeout_s: wall-clock limit for all ranks together (the rest are terminated).
        group_timeout_s: the process group's own timeout.
    Returns:
        ``fn``'s results in rank order.
    Raises:
        ArgumentError: bad ``world_size`` or timeouts.
        TpWorkerError: a rank raised, died or ran out of time (``results`` has the others').
    """
    int_arg("world_size", world_size, lo=1, limit="an int >= 1 (processes)")
    for name, value in (("timeout_s", timeout_s), ("group_timeout_s", group_timeout_s)):
        seconds_arg(name, value, zero=False)
    return _spawn(fn, world_size, tuple(args), backend=backend, timeout_s=float(timeout_s),
                  group_timeout_s=float(group_timeout_s), label=lambda r: "")
