"""The budget rules, once: the ledger and the lab's arbiter ask the same tenants, in the same
order, for the same amounts, and serve or refuse the same charges."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvvmm.budget import Ledger
from kvvmm.budget.errors import BudgetExceededError
from kvvmm.budget.rules import Ask, TenantState, refusal, shed_plan
from kvvmm.workload.tenants import Rules, _Arbiter

MiB = 1 << 20


@dataclass(frozen=True)
class Holder:
    """A tenant already holding memory: ``booked`` MiB, of which ``idle`` it gives back."""

    name: str
    booked: int
    idle: int
    limit: int = 1 << 20


@dataclass(frozen=True)
class Scenario:
    holders: tuple[Holder, ...]
    asker_booked: int
    asker_limit: int
    need: int
    budget: int


SCENARIOS = {
    "idle_vs_big": Scenario((Holder("big", 40, 2), Holder("idler", 10, 10)), 0, 1 << 20,
                            12, 52),
    "tie_goes_to_the_earlier": Scenario((Holder("a", 20, 20), Holder("b", 20, 20)), 0,
                                        1 << 20, 30, 48),
    "asker_at_its_limit": Scenario((Holder("a", 30, 30),), 16, 16, 4, 48),
    "a_holder_at_its_limit": Scenario((Holder("full", 24, 24, 24), Holder("b", 16, 16)), 4,
                                      1 << 20, 30, 48),
    "fits_without_asking": Scenario((Holder("a", 10, 10),), 0, 1 << 20, 8, 32),
    "not_enough_idle": Scenario((Holder("a", 30, 1), Holder("b", 10, 1)), 0, 1 << 20, 20,
                                48),
}


def _ledger_side(path: Path, sc: Scenario) -> tuple[dict[str, int], bool]:
    """What the ledger asks of whom (posted at once: the order shows in who is asked for
    less than it books) and whether the charge was served; each holder answers by giving
    back what is idle, up to what it was asked."""
    budget = sc.budget * MiB
    with Ledger(path, budget_bytes=budget) as led:
        ts = {h.name: led.register(h.name, limit_bytes=h.limit * MiB) for h in sc.holders}
        for h in sc.holders:
            ts[h.name].charge(h.booked * MiB)
        asker = led.register("asker", limit_bytes=sc.asker_limit * MiB, shed_wait_s=0.5)
        if sc.asker_booked:
            asker.charge(sc.asker_booked * MiB)
        seen: list[tuple[str, int]] = []
        done = threading.Event()

        def answer() -> None:  # the holders, answering the first requests they see
            while not done.is_set():
                snap = led.snapshot(sweep=False)
                asked = {x.name: x.shed_bytes for x in snap.tenants if x.shed_bytes}
                if asked:
                    seen.extend(asked.items())
                    for h in sc.holders:
                        give = min(asked.get(h.name, 0), h.idle * MiB)
                        if give:
                            ts[h.name].credit(give)
                    return
                time.sleep(0.001)

        th = threading.Thread(target=answer)
        th.start()
        try:
            asker.charge(sc.need * MiB)
            served = True
        except BudgetExceededError:
            served = False
        finally:
            done.set()
            th.join()
        for t in (*ts.values(), asker):
            if t.backed_bytes:
                t.credit(t.backed_bytes)
            t.close()
    return dict(seen), served


class _Stand:
    """A lab tenant as the arbiter sees it, giving back its idle bytes when asked."""

    def __init__(self, name: str, index: int, booked: int, idle: int, limit: int,
                 log: list[tuple[str, int]]) -> None:
        self.spec = type("Spec", (), {"name": name, "answer": "shed",
                                      "strategy": "elastic"})()
        self.index, self.backed, self.limit = index, booked, limit
        self.idle = set(range(idle // MiB))  # idle granules, a MiB each
        self.pending_s = 0.0
        self.shed_bytes = self.asked = self.refused = 0
        self.log = log

    def _account(self) -> None:
        pass

    def ask_shed(self, asked: int, deadline_s: float) -> tuple[int, float]:
        """The arbiter's ask (what the ledger side sees asked), answered from idle bytes."""
        self.log.append((self.spec.name, asked))
        return self.give_back(asked), 0.0

    def give_back(self, want: int) -> int:
        given = min(want, len(self.idle) * MiB)
        for _ in range(-(-given // MiB)):
            self.idle.pop()
        self.backed -= given
        return given


def _lab_side(sc: Scenario) -> tuple[dict[str, int], bool]:
    arb = _Arbiter(Rules(budget_bytes=sc.budget * MiB))
    log: list[tuple[str, int]] = []
    stands = [_Stand(h.name, i, h.booked * MiB, h.idle * MiB, h.limit * MiB, log)
              for i, h in enumerate(sc.holders)]
    asker = _Stand("asker", len(stands), sc.asker_booked * MiB, 0, sc.asker_limit * MiB, log)
    arb.lives = [*stands, asker]  # type: ignore[list-item]
    served = arb.grant(asker, sc.need * MiB, 0.0)  # type: ignore[arg-type]
    assert len({n for n, _ in log}) == len(log)  # each asked once
    return dict(log), served


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_ledger_and_the_labs_arbiter_ask_the_same_tenants_in_the_same_order_for_the_same_bytes(
        tmp_path: Path, name: str) -> None:
    sc = SCENARIOS[name]
    lab = _lab_side(sc)
    shipped = _ledger_side(tmp_path / "ledger", sc)
    assert lab == shipped


def test_the_most_booked_is_asked_first_each_for_at_most_its_booking_less_what_it_is_asked(
        ) -> None:
    ts = [TenantState("a", 0, 100, 10), TenantState("b", 1, 100, 30, asked_bytes=25),
          TenantState("c", 2, 100, 30), TenantState("d", 3, 100, 0)]
    # b and c tie on bookings: b, the earlier, first, for what it is not already asked
    assert shed_plan(ts, 30) == (Ask("b", 1, 5), Ask("c", 2, 25))
    assert shed_plan(ts, 0) == ()
    assert shed_plan(ts, 1000) == (Ask("b", 1, 5), Ask("c", 2, 30), Ask("a", 0, 10))


def test_a_charge_past_its_limit_is_refused_before_the_budget_is_looked_at() -> None:
    t = TenantState("a", 0, 10, 8)
    assert refusal(t, 3, free_bytes=0) == "limit"
    assert refusal(t, 2, free_bytes=1) == "budget"
    assert refusal(t, 2, free_bytes=2) is None
