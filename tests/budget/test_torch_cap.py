"""torch's caching allocator capped by a tenant's share of the budget, on the sim and host
drivers: the torch call is injected, so each test sees the fraction asked of torch.

The cap leaves torch ``total - max(booked, min(limit, budget)) - headroom`` of the device
and follows the ledger: grants, sheds, live limits and budgets, close.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvvmm
from kvvmm import Arena
from kvvmm.arena.reclaim import TorchAllocatorCap, TorchCapError
from kvvmm.budget import BudgetedDriver, Ledger, Tenant
from kvvmm.budget.rules import kv_claim
from kvvmm.errors import ArgumentError, ClosedError, OutOfRangeError

MiB = 1 << 20
G = 2 * MiB  # the host and sim drivers' granularity
TOTAL = 256 * MiB  # the device torch's fraction is of
HEAD = 16 * MiB


class Torch:
    """Stands in for ``torch.cuda.set_per_process_memory_fraction``: records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, int]] = []
        self.refuse = False

    def __call__(self, fraction: float, device: int) -> None:
        if self.refuse:
            raise RuntimeError(f"invalid fraction {fraction}")
        self.calls.append((fraction, device))

    @property
    def leaves(self) -> int:
        """The KV bytes the last fraction leaves out of torch's reach."""
        return round(TOTAL - HEAD - self.calls[-1][0] * TOTAL)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "ledger"


@pytest.fixture
def ledgers(path: Path) -> Iterator[tuple[Ledger, Ledger]]:
    """The tenant's ledger and the operator's (another open file, as another process)."""
    with Ledger(path, budget_bytes=128 * MiB) as led, Ledger(path) as op:
        yield led, op


def _capped(led: Ledger, torch: Torch, limit: int = 64 * MiB) -> Tenant:
    t = led.register("llm", limit_bytes=limit)
    cap = t.cap_torch(3, headroom_bytes=HEAD, total_bytes=TOTAL, set_fraction=torch)
    assert t.torch_cap is cap and cap.device == 3
    return t


def test_the_claim_is_the_share_a_tenant_may_grow_to_or_its_booking_when_more() -> None:
    assert kv_claim(64, 10, 128) == 64  # its limit
    assert kv_claim(200, 10, 128) == 128  # its limit, within the GPU's budget
    assert kv_claim(16, 40, 128) == 40  # a lowered limit, not yet shed


@pytest.mark.parametrize("kind", ["sim", "host"])
def test_the_cap_follows_grants_a_live_limit_a_shed_and_a_budget_and_close_lifts_it(
        ledgers: tuple[Ledger, Ledger], kind: str) -> None:
    led, op = ledgers
    torch = Torch()
    t = _capped(led, torch)
    assert len(torch.calls) == 1 and torch.calls[0][1] == 3 and torch.leaves == 64 * MiB
    inner = kvvmm.open_driver("host") if kind == "host" else kvvmm.open_driver(
        "sim", profile="h200")
    arena = Arena(BudgetedDriver(inner, t), reserve_bytes=128 * MiB)
    a = arena.allocate(128 * MiB)
    arena.commit(a, 16 * MiB)
    arena.commit(a, 40 * MiB)  # granted within the share: torch's cap stays
    assert len(torch.calls) == 1
    op.set_limit("llm", 16 * MiB, shed_wait_s=5)  # the operator lowers the limit
    assert t.poll() is not None
    assert torch.leaves == 40 * MiB  # still mapped: torch must leave it until shed
    arena.decommit(a, 16 * MiB)  # shed: each release books back, the cap follows
    assert t.poll() is None and torch.leaves == 16 * MiB
    op.set_limit("llm", 200 * MiB)
    op.set_budget(96 * MiB)
    t.poll()
    assert torch.leaves == 96 * MiB  # the limit, within the GPU's budget
    arena.close()
    inner.close()
    n = len(torch.calls)
    t.close()
    assert torch.calls[n:] == [(1.0, 3)]  # lifted: what runs next is not capped
    assert t.torch_cap is None
    t.close()
    assert len(torch.calls) == n + 1


def test_a_watching_tenant_follows_a_limit_changed_elsewhere_within_its_interval(
        ledgers: tuple[Ledger, Ledger]) -> None:
    led, op = ledgers
    torch = Torch()
    t = _capped(led, torch)
    t.watch(lambda req: None, interval_s=0.002)
    op.set_limit("llm", 32 * MiB)
    end = time.monotonic() + 5
    while torch.leaves != 32 * MiB and time.monotonic() < end:
        time.sleep(0.002)
    assert torch.leaves == 32 * MiB
    t.close()
    assert torch.calls[-1] == (1.0, 3)


def test_a_claim_that_leaves_torch_nothing_is_refused_at_opt_in_and_logged_when_followed(
        ledgers: tuple[Ledger, Ledger]) -> None:
    led, op = ledgers
    torch = Torch()
    op.set_budget(TOTAL)
    t = led.register("llm", limit_bytes=TOTAL)
    with pytest.raises(OutOfRangeError, match="kv_bytes"):
        t.cap_torch(0, headroom_bytes=HEAD, total_bytes=TOTAL, set_fraction=torch)
    assert torch.calls == [] and t.torch_cap is None
    op.set_limit("llm", 64 * MiB)
    t.cap_torch(0, headroom_bytes=HEAD, total_bytes=TOTAL, set_fraction=torch)
    op.set_limit("llm", TOTAL)
    t.charge(G)  # follows after the charge: fails, never into the charge
    assert isinstance(t.torch_cap_error, OutOfRangeError)
    assert len(torch.calls) == 1 and torch.leaves == 64 * MiB  # the cap stays as it was
    op.set_limit("llm", 32 * MiB)
    t.credit(G)
    assert t.torch_cap_error is None and torch.leaves == 32 * MiB
    t.close()


def test_torch_refusing_the_fraction_is_typed_and_picklable_and_a_second_opt_in_refused(
        ledgers: tuple[Ledger, Ledger]) -> None:
    led, op = ledgers
    torch = Torch()
    torch.refuse = True
    t = led.register("llm", limit_bytes=64 * MiB)
    with pytest.raises(TorchCapError, match="invalid fraction") as e:
        t.cap_torch(1, total_bytes=TOTAL, set_fraction=torch)
    back = pickle.loads(pickle.dumps(e.value))
    assert (back.device, back.fraction, back.reason) == (
        1, e.value.fraction, e.value.reason) and str(back) == str(e.value)
    assert t.torch_cap is None
    torch.refuse = False
    t.cap_torch(1, total_bytes=TOTAL, set_fraction=torch)
    with pytest.raises(ArgumentError, match="one torch cap per tenant"):
        t.cap_torch(1, total_bytes=TOTAL, set_fraction=torch)
    torch.refuse = True
    op.set_limit("llm", 32 * MiB)
    t.poll()
    assert isinstance(t.torch_cap_error, TorchCapError)
    torch.refuse = False
    t.close()
    assert torch.calls[-1] == (1.0, 1)


def test_a_cap_closed_on_its_own_is_lifted_and_no_longer_followed(
        ledgers: tuple[Ledger, Ledger]) -> None:
    led, op = ledgers
    torch = Torch()
    t = _capped(led, torch)
    cap = t.torch_cap
    assert cap is not None
    cap.close()
    assert torch.calls[-1] == (1.0, 3) and cap.closed and cap.fraction is None
    op.set_limit("llm", 32 * MiB)
    t.poll()
    assert len(torch.calls) == 2 and t.torch_cap is None
    with pytest.raises(ClosedError):
        cap.follow(MiB)
    t.close()


def test_a_cpu_only_torch_says_it_cannot_cap_rather_than_capping_nothing(
        ledgers: tuple[Ledger, Ledger]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("torch has CUDA here: tests/gpu/test_gpu_torch_cap.py caps it")
    with pytest.raises(TorchCapError, match="no usable CUDA") as e:
        TorchAllocatorCap(0)
    assert e.value.device == 0 and e.value.fraction is None
    t = ledgers[0].register("llm", limit_bytes=64 * MiB)
    with pytest.raises(TorchCapError, match="no device cache to cap"):
        t.cap_torch(0)
    assert t.torch_cap is None
    t.close()
