"""The budget broker across real processes (spawned): nothing double-booked under concurrent
commits, a tenant killed mid-commit (or holding the ledger's lock) reclaimed, shedding served
and refused at the deadline, limits changed live from the command line.

Each child owns an arena on the host driver (real memory: memfds) through a BudgetedDriver;
the parent samples the ledger while they run.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import kvvmm
from kvvmm.budget import (
    BudgetedDriver,
    BudgetExceededError,
    FaultyLedger,
    Ledger,
    ShedRequest,
)
from kvvmm.budget.liveness import alive, start_ticks
from kvvmm.cli import main as cli_main
from kvvmm.driver.wrapper import DriverWrapper

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="host driver: Linux")

MiB = 1 << 20
G = 2 * MiB


# -- children (module level: a spawned process imports them by name) -------------------------


def _owner(path: str, name: str, **register: Any) -> tuple[Ledger, Any, kvvmm.Arena, list[int]]:
    led = Ledger(path)
    tenant = led.register(name, **register)
    arena = kvvmm.Arena(BudgetedDriver(kvvmm.open_driver("host"), tenant),
                        reserve_bytes=256 * MiB)
    offs = [arena.allocate(64 * MiB) for _ in range(3)]
    return led, tenant, arena, offs


def _churn(conn: Any, path: str, name: str, seed: int, seconds: float) -> None:
    """Commit and decommit at random; report what was refused and what each side books."""
    led, tenant, arena, offs = _owner(path, name)
    rng = random.Random(seed)
    refused = commits = 0
    conn.send(("ready", os.getpid()))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        o = rng.choice(offs)
        try:
            if rng.random() < 0.6:
                arena.commit(o, rng.randrange(0, 17) * G)
                commits += 1
            else:
                arena.decommit(o, rng.randrange(0, 9) * G)
        except BudgetExceededError:
            refused += 1
    drv = arena.driver
    assert isinstance(drv, BudgetedDriver)
    conn.send(("done", refused, commits, arena.backed_bytes, tenant.backed_bytes,
               drv.charged_bytes, drv.inner.stats().physical_bytes))
    arena.close()
    tenant.close()
    led.close()


class _DieInCreate(DriverWrapper):
    """Ends the process right after its nth create: charged and created, never mapped."""

    def __init__(self, inner: Any, nth: int) -> None:
        super().__init__(inner)
        self.left = nth

    def _call(self, call: str, fn: Callable[..., Any], *args: Any) -> Any:
        out = fn(*args)
        if call == "create":
            self.left -= 1
            if self.left == 0:
                os._exit(9)
        return out


def _die_mid_commit(conn: Any, path: str, name: str) -> None:
    led = Ledger(path)
    tenant = led.register(name)
    arena = kvvmm.Arena(BudgetedDriver(_DieInCreate(kvvmm.open_driver("host"), 3), tenant),
                        reserve_bytes=64 * MiB)
    conn.send(("ready", os.getpid()))
    offs = [arena.allocate(8 * MiB) for _ in range(3)]
    arena.commit_many([(o, 8 * MiB) for o in offs])  # dies in the third create


def _die_holding_the_lock(conn: Any, path: str, point: str, nth: int) -> None:
    led = FaultyLedger(path, die={point: nth})
    conn.send(("ready", os.getpid()))
    t = led.register("doomed")  # point "register": dies here
    t.charge(4 * MiB)  # point "charge": dies here


def _holder(conn: Any, path: str, hold: int, shed: bool) -> None:
    """Hold ``hold`` bytes; with ``shed``, give back what is asked, from the watcher."""
    led, tenant, arena, offs = _owner(path, "holder")
    for k in range(4 * MiB, hold + 1, 4 * MiB):  # 4 MiB handles: a decommit gives any of them
        arena.commit(offs[0], k)

    def give_back(req: ShedRequest) -> None:
        keep = max(arena.backed_bytes - req.shed_bytes, 0) // (4 * MiB) * (4 * MiB)
        arena.decommit(offs[0], keep)

    if shed:
        tenant.watch(give_back, interval_s=0.002)
    conn.send(("ready", os.getpid()))
    conn.recv()  # the parent says when
    conn.send(("done", tenant.backed_bytes, arena.backed_bytes))
    arena.close()
    tenant.close()
    led.close()


def _obeys_limits(conn: Any, path: str, seconds: float) -> None:
    """An engine loop: polls for shed requests between steps, grows when it may."""
    led, tenant, arena, offs = _owner(path, "engine")
    refused_limit = 0
    conn.send(("ready", os.getpid()))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        req = tenant.poll()
        if req is not None:
            keep = max(arena.backed_of(offs[0]) - req.shed_bytes, 0) // G * G
            arena.decommit(offs[0], keep)
        try:
            arena.commit(offs[0], min(arena.backed_of(offs[0]) + G, 32 * MiB))
        except BudgetExceededError as e:
            refused_limit += e.budget_reason == "limit"
        time.sleep(0.001)
    conn.send(("done", refused_limit, tenant.backed_bytes, tenant.limit_bytes))
    arena.close()
    tenant.close()
    led.close()


def _spawn(target: Callable[..., None], *args: Any) -> tuple[Any, Any]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(child, *args), daemon=True)
    p.start()
    child.close()
    return p, parent


def _recv(conn: Any, timeout: float = 60.0) -> Any:
    assert conn.poll(timeout), "the child said nothing in time"
    return conn.recv()


def _gone_within(led: Ledger, name: str, timeout: float = 10.0) -> float:
    """Sweep until ``name`` has left the ledger; return how long it took."""
    t0 = time.monotonic()
    while any(t.name == name for t in led.snapshot().tenants):
        assert time.monotonic() - t0 < timeout, f"{name} was not reclaimed"
        time.sleep(0.005)
    return time.monotonic() - t0


def _with_timeout(fn: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Run ``fn`` on a thread: a ledger lock left held would hang the test, not fail it."""
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    th.start()
    th.join(timeout)
    assert out, "the ledger's lock was never released"
    return out[0]


# -- tests ----------------------------------------------------------------------------------


def test_concurrent_commits_of_three_processes_never_book_past_the_budget(tmp_path: Path) -> None:
    path = str(tmp_path / "ledger")
    budget = 40 * MiB
    with Ledger(path, budget_bytes=budget) as led:
        kids = [_spawn(_churn, path, f"churn{i}", i, 1.0) for i in range(3)]
        for _, conn in kids:
            assert _recv(conn)[0] == "ready"
        samples: list[int] = []
        while any(p.is_alive() and not conn.poll() for p, conn in kids):
            samples.append(led.backed_bytes())
            time.sleep(0.0005)  # leave the children the CPU
        reports = [_recv(conn) for _, conn in kids]
        for p, _ in kids:
            p.join(30)
    assert len(samples) > 20 and max(samples) <= budget
    assert sum(r[1] for r in reports) > 0, "no commit was refused: nothing was contended"
    for _, _refused, commits, arena_b, booked, charged, physical in reports:
        assert commits > 0
        assert arena_b == booked == charged == physical  # each child books what it holds


def test_a_tenant_killed_mid_commit_is_reclaimed_and_the_others_keep_their_share(
        tmp_path: Path) -> None:
    path = str(tmp_path / "ledger")
    with Ledger(path, budget_bytes=64 * MiB) as led:
        mine = led.register("survivor")
        mine.charge(8 * MiB)
        p, conn = _spawn(_die_mid_commit, path, "victim")
        _recv(conn)
        p.join(60)
        assert p.exitcode == 9
        # the victim died charged (two handles mapped, a third created): never under-booked
        assert led.snapshot(sweep=False).backed_bytes == 8 * MiB + 24 * MiB
        assert _gone_within(led, "victim") < 1.0
        snap = led.snapshot()
        assert [(t.name, t.backed_bytes) for t in snap.tenants] == [("survivor", 8 * MiB)]
        mine.charge(56 * MiB)  # the whole reclaimed share is usable again
        mine.credit(64 * MiB)
        mine.close()


def test_a_tenant_killed_by_sigkill_while_committing_is_reclaimed_before_it_is_reaped(
        tmp_path: Path) -> None:
    path = str(tmp_path / "ledger")
    with Ledger(path, budget_bytes=48 * MiB) as led:
        p, conn = _spawn(_churn, path, "killed", 7, 30.0)
        _, pid = _recv(conn)
        ticks = start_ticks(pid)
        time.sleep(0.3)  # mid-churn
        os.kill(pid, signal.SIGKILL)
        while alive(pid, ticks):  # a zombie until joined: counts as gone
            time.sleep(0.002)
        assert _gone_within(led, "killed") < 1.0
        assert led.snapshot().backed_bytes == 0
        p.join(10)


@pytest.mark.parametrize(("point", "nth"), [("register", 3), ("register", 8), ("charge", 1)])
def test_a_tenant_that_dies_holding_the_ledgers_lock_mid_write_blocks_nobody(
        tmp_path: Path, point: str, nth: int) -> None:
    path = str(tmp_path / "ledger")
    with Ledger(path, budget_bytes=32 * MiB) as led:
        p, conn = _spawn(_die_holding_the_lock, path, point, nth)
        _recv(conn)
        p.join(60)
        assert p.exitcode == 3
        snap = _with_timeout(led.snapshot)  # the kernel dropped the dead holder's lock
        assert snap.tenants == () and snap.backed_bytes == 0
        t = _with_timeout(lambda: led.register("doomed"))  # the name and slot are free again
        t.charge(32 * MiB)
        t.credit(32 * MiB)
        t.close()


def test_a_short_budget_is_served_by_another_process_shedding_within_the_deadline(
        tmp_path: Path) -> None:
    path = str(tmp_path / "ledger")
    with Ledger(path, budget_bytes=64 * MiB) as led:
        p, conn = _spawn(_holder, path, 48 * MiB, True)
        _recv(conn)
        me = led.register("asker", shed_wait_s=10)
        t0 = time.monotonic()
        me.charge(32 * MiB)  # 16 free: 16 asked of the holder
        took = time.monotonic() - t0
        conn.send("stop")
        _, booked, backed = _recv(conn)
        p.join(30)
        assert took < 10
        assert booked == backed <= 32 * MiB
        assert led.snapshot().tenants[0].name == "asker"
        me.credit(32 * MiB)
        me.close()


def test_an_asker_is_refused_at_the_deadline_when_the_other_process_does_not_shed(
        tmp_path: Path) -> None:
    path = str(tmp_path / "ledger")
    with Ledger(path, budget_bytes=64 * MiB) as led:
        p, conn = _spawn(_holder, path, 48 * MiB, False)
        _recv(conn)
        me = led.register("asker", shed_wait_s=0.2)
        with pytest.raises(BudgetExceededError) as e:
            me.charge(32 * MiB)
        assert e.value.budget_reason == "deadline" and e.value.free_bytes == 16 * MiB
        holder = next(t for t in led.snapshot().tenants if t.name == "holder")
        assert holder.shed_bytes == 0  # the request was withdrawn
        conn.send("stop")
        _, booked, _ = _recv(conn)
        p.join(30)
        assert booked == 48 * MiB
        me.close()


def test_a_limit_lowered_live_from_the_command_line_is_obeyed_by_a_running_tenant(
        tmp_path: Path) -> None:
    path = str(tmp_path / "ledger")
    with Ledger(path, budget_bytes=64 * MiB) as led:
        p, conn = _spawn(_obeys_limits, path, 2.0)
        _recv(conn)
        t0 = time.monotonic()
        while led.backed_bytes() < 24 * MiB:  # it grows to its 32 MiB
            assert time.monotonic() - t0 < 30
            time.sleep(0.01)
        assert cli_main(["budget", "set", "engine", "8MiB", "--shed-wait", "5",
                         "--ledger", path]) == 0
        t0 = time.monotonic()
        while led.backed_bytes() > 8 * MiB:
            assert time.monotonic() - t0 < 5, "the tenant did not shed to its new limit"
            time.sleep(0.005)
        samples = []
        for _ in range(100):  # under its new limit from then on
            samples.append(led.backed_bytes())
            time.sleep(0.002)
        _, refused_limit, booked, limit = _recv(conn)
        p.join(30)
    assert max(samples) <= 8 * MiB and booked <= limit == 8 * MiB
    assert refused_limit > 0
