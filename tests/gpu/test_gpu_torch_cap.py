"""On the GPU: torch's caching allocator capped by a tenant's share of the budget broker,
following a limit the operator changes live, and lifted when the tenant closes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvvmm import Arena
from kvvmm.budget import BudgetedDriver, Ledger
from kvvmm.driver.cuda import CudaDriver
from kvvmm.units import GiB, MiB


@pytest.fixture
def cd() -> Iterator[CudaDriver]:
    torch.empty(1, device="cuda")
    torch.cuda.empty_cache()
    d = CudaDriver()
    yield d
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    torch.cuda.empty_cache()
    assert d.stats().clean, d.stats()


def test_torch_is_kept_out_of_a_tenants_share_and_follows_its_limit_live(
        cd: CudaDriver, tmp_path: Path) -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    reserved = torch.cuda.memory_reserved(0)
    share = total - reserved - 512 * MiB  # torch may grow by about 512 MiB past what it holds
    with Ledger(tmp_path / "ledger", budget_bytes=total) as led, \
            Ledger(tmp_path / "ledger") as op:
        t = led.register("llm", limit_bytes=share)
        cap = t.cap_torch(0)
        assert cap.total_bytes == total and cap.kv_bytes == share
        arena = Arena(BudgetedDriver(cd, t), reserve_bytes=1 * GiB)
        a = arena.allocate(1 * GiB)
        arena.commit(a, 256 * MiB)  # granted within the share: the cap stays
        assert t.poll() is None and cap.kv_bytes == share
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(1 * GiB, dtype=torch.uint8, device="cuda")
        small = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
        del small
        op.set_limit("llm", 1 * GiB)  # the operator gives torch the rest, live
        t.poll()
        assert cap.kv_bytes == 1 * GiB and t.torch_cap_error is None
        big = torch.empty(1 * GiB, dtype=torch.uint8, device="cuda")
        del big
        arena.close()
        t.close()
        assert cap.closed and cap.fraction is None
        torch.cuda.empty_cache()
        # Lifted: torch may take what the share held from it.
        free, _ = torch.cuda.mem_get_info(0)
        if free > 2 * GiB:
            x = torch.empty(free - 1 * GiB, dtype=torch.uint8, device="cuda")
            del x
