"""A vLLM engine and an SGLang engine sharing one GPU's budget, in two processes (host driver).

One process runs vLLM 0.34's own ExtensibleTensor through ``kvvmm.integrations.vllm`` over a
``BudgetedDriver``; the other runs kvvmm's SGLang adapter (``KvVmmBufferOwner``) over another,
both tenants of one ledger. The parent replays a seeded trace of their demands (growth and
release, each engine in turn) in lockstep and checks after every step that the two never
book more than the budget together and that each books exactly the memory its driver holds;
halfway, it lowers vLLM's limit live, and vLLM's very next commit past it is refused.
"""

from __future__ import annotations

import multiprocessing
import os
import random
from pathlib import Path
from typing import Any

import pytest
from integrations.test_vllm_reference import accelerator_stub, vllm_dir, vllm_loaded

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="host driver: Linux")

MiB = 1 << 20
G = 2 * MiB
BUDGET = 40 * MiB
POOL = 64 * MiB  # what each engine could take alone


def _host() -> Any:
    from kvvmm import open_driver

    return open_driver("host", granularity=G, capacity_bytes=4 * POOL)


def _vllm_engine(conn: Any, path: str) -> None:
    """vLLM's ExtensibleTensor through the adapter; commands: grow to n bytes, release."""
    from kvvmm.budget import BudgetedDriver, Ledger
    from kvvmm.integrations import vllm as kv

    ledger = Ledger(path)
    tenant = ledger.register("vllm")
    host = _host()
    with vllm_loaded(vllm_dir()) as v, accelerator_stub():
        kv.install(BudgetedDriver(host, tenant))
        et = v.extensible_tensor.ExtensibleTensor(POOL, "cuda:0")
        conn.send("ready")
        while (cmd := conn.recv())[0] != "stop":
            refused = ""
            try:
                if cmd[0] == "grow":
                    et.resize_per_segment_(max(cmd[1], et.bytes_per_segment))
                else:
                    et.release_physical()
            except RuntimeError as e:  # vLLM's driver error: kvvmm's type kept
                refused = getattr(e, "budget_reason", type(e).__name__)
            conn.send((refused, et.physical_bytes, host.stats().physical_bytes))
        et.free()
        kv.uninstall()
    conn.send(host.stats().clean)
    tenant.close()
    ledger.close()


def _sglang_engine(conn: Any, path: str) -> None:
    """kvvmm's SGLang adapter; commands: back the first n bytes' tokens, release beyond."""
    import torch

    from kvvmm.budget import BudgetedDriver, Ledger
    from kvvmm.integrations.sglang import KvBufferDesc, KvVmmBufferOwner

    ledger = Ledger(path)
    tenant = ledger.register("sglang")
    host = _host()
    row = 4096  # one token's bytes
    own = KvVmmBufferOwner(device="cpu", device_id=0, store_dtype=torch.uint8, page_size=1,
                           reserved_num_tokens=POOL // row - 1,
                           buffer_descs=[KvBufferDesc("kv", (POOL // row, row), row, 1)],
                           driver=BudgetedDriver(host, tenant))
    conn.send("ready")
    while (cmd := conn.recv())[0] != "stop":
        refused = ""
        try:
            if cmd[0] == "grow":
                own.ensure_prefix(min(cmd[1] // row, POOL // row - 1))
            else:
                own.release_beyond(1)
        except RuntimeError as e:
            refused = getattr(e, "budget_reason", type(e).__name__)
        conn.send((refused, own.backed_bytes, host.stats().physical_bytes))
    own.close()
    conn.send(host.stats().clean)
    tenant.close()
    ledger.close()


def _trace(seed: int, steps: int) -> list[tuple[str, str, int]]:
    """A seeded demand trace: (engine, "grow" | "release", bytes), engines alternating."""
    rng = random.Random(seed)
    out = []
    for i in range(steps):
        engine = ("vllm", "sglang")[i % 2]
        if rng.random() < 0.15:
            out.append((engine, "release", 0))
        else:
            out.append((engine, "grow", rng.randrange(1, 33) * MiB + rng.randrange(0, 4096)))
    return out


def test_a_vllm_and_an_sglang_process_never_book_more_than_the_budget_and_a_live_limit_holds(
        tmp_path: Path) -> None:
    vllm_dir()  # skip here, not in the child, when vLLM's files are absent
    from kvvmm.budget import Ledger

    path = str(tmp_path / "ledger")
    ledger = Ledger(path, budget_bytes=BUDGET)
    ctx = multiprocessing.get_context("spawn")
    engines: dict[str, tuple[Any, Any]] = {}
    try:
        for name, target in (("vllm", _vllm_engine), ("sglang", _sglang_engine)):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=target, args=(child, path), daemon=True)
            p.start()
            child.close()
            engines[name] = (p, parent)
        for name, (_, conn) in engines.items():  # both start at once
            assert conn.poll(120), f"{name} did not start"
            assert conn.recv() == "ready"

        def step(engine: str, op: str, n: int) -> str:
            conn = engines[engine][1]
            conn.send((op, n))
            assert conn.poll(60), f"{engine} did not answer {op}({n})"
            refused, engine_bytes, driver_bytes = conn.recv()
            snap = ledger.snapshot()
            booked = {t.name: t.backed_bytes for t in snap.tenants}
            assert sum(booked.values()) <= BUDGET, booked
            assert booked[engine] == engine_bytes == driver_bytes, (engine, booked)
            return str(refused)

        trace = _trace(seed=11, steps=40)
        refusals = [step(*s) for s in trace[:20]]
        assert "budget" in refusals and "" in refusals  # both engines met the budget
        # The operator lowers vLLM's limit to what it holds: its next commit is refused.
        held = next(t.backed_bytes for t in ledger.snapshot().tenants if t.name == "vllm")
        ledger.set_limit("vllm", held, shed_wait_s=0)
        assert step("vllm", "grow", held + 1) == "limit"
        ledger.set_limit("vllm", BUDGET, shed_wait_s=0)
        refusals += [step(*s) for s in trace[20:]]
        for name, (_, conn) in engines.items():
            conn.send(("stop", 0))
            assert conn.poll(60) and conn.recv() is True, f"{name} leaked memory"
        assert ledger.snapshot().backed_bytes == 0
    finally:
        for p, conn in engines.values():
            p.join(30)
            if p.is_alive():
                p.kill()
            conn.close()
        ledger.close()


def test_a_sleep_gives_its_bytes_back_to_the_budget_and_a_wake_past_the_limit_stays_asleep(
        tmp_path: Path, make_driver: Any) -> None:
    import torch

    from kvvmm.budget import BudgetedDriver, BudgetExceededError, Ledger
    from kvvmm.integrations import vllm as kv

    with vllm_loaded(vllm_dir()) as v, accelerator_stub(), \
            Ledger(tmp_path / "ledger", budget_bytes=BUDGET) as ledger:
        tenant = ledger.register("vllm")
        adapter = kv.install(BudgetedDriver(make_driver("host"), tenant))
        try:
            et = v.extensible_tensor.ExtensibleTensor(POOL, "cuda:0")
            et.resize_per_segment_(9 * MiB)
            et.segment_view(0).copy_(torch.arange(9 * MiB).to(torch.uint8))
            kept = et.segment_view(0).clone()
            adapter.sleep()
            assert tenant.backed_bytes == 0
            ledger.set_limit("vllm", 8 * MiB, shed_wait_s=0)  # lowered while it sleeps
            with pytest.raises(BudgetExceededError):
                adapter.wake()
            assert adapter.snapshot(et.base_ptr).asleep_bytes and tenant.backed_bytes == 0
            ledger.set_limit("vllm", BUDGET, shed_wait_s=0)
            adapter.wake()
            assert tenant.backed_bytes == et.physical_bytes == 10 * MiB
            assert torch.equal(et.segment_view(0), kept)
            et.free()
            assert tenant.backed_bytes == 0
        finally:
            kv.uninstall()
            tenant.close()
