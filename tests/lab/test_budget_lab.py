"""BudgetLab, driven without a browser: the broker's ledger through clicks and control values."""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from kvvmm.driver import Driver
from kvvmm.errors import ArgumentError, DriverUnavailableError
from kvvmm.lab import BudgetLab
from kvvmm.lab.budget_lab import ledger_figure
from kvvmm.units import MiB


@pytest.fixture
def lab() -> Iterator[BudgetLab]:
    panel = BudgetLab(budget_mib=96)
    yield panel
    panel.close()


def _grow(lab: BudgetLab, tenant: str, tokens: int) -> bool:
    lab.tenant.value, lab.tokens.value = tenant, tokens
    return lab.grow_button.click() is None and lab.last_error is None


def _bars(lab: BudgetLab) -> dict[str, list[float]]:
    return {str(t.name): list(t.y) for t in lab.figure.data if t.type == "bar"}


def test_the_ledger_books_each_tenants_growth_and_the_table_and_figure_follow(
        lab: BudgetLab) -> None:
    assert _grow(lab, "llama", 8192) and _grow(lab, "qwen", 2048)
    row = lab.rows[-1]
    assert row["llama"] == lab.owners["llama"].backed_bytes == 64 * MiB
    assert row["qwen"] == lab.owners["qwen"].backed_bytes
    assert row["free"] == 96 * MiB - row["llama"] - row["qwen"]
    assert lab.labels[-2:] == ["llama grows to 8,192", "qwen grows to 2,048"]
    assert _bars(lab)["llama booked"][-1] == 64.0
    assert "qwen grows to 2,048" in lab.report.value


def test_a_growth_past_the_free_budget_shows_the_brokers_error_and_books_nothing(
        lab: BudgetLab) -> None:
    assert _grow(lab, "llama", 8192) and _grow(lab, "qwen", 4096)
    before = lab.owners["qwen"].snapshot()
    assert not _grow(lab, "qwen", 5120)
    assert lab.error_text.startswith("BudgetExceededError")
    assert "budget" in lab.error.value
    assert lab.owners["qwen"].snapshot() == before
    assert lab.labels[-1] == "qwen grows to 5,120: refused"
    assert lab.rows[-1] == lab.rows[-2]


def test_a_growth_past_the_tenants_limit_is_refused_for_the_limit(lab: BudgetLab) -> None:
    lab.limit_mib.value = 16
    lab.set_limit_button.click()
    assert not _grow(lab, "llama", 4096)
    assert lab.last_error is not None and lab.last_error.budget_reason == "limit"  # type: ignore[attr-defined]
    assert lab.rows[-1]["llama"] <= 16 * MiB


def test_a_lower_limit_asks_for_the_excess_and_shed_gives_it_back_in_whole_granules(
        lab: BudgetLab) -> None:
    assert _grow(lab, "llama", 8192)
    lab.limit_mib.value = 40
    lab.set_limit_button.click()
    assert lab.rows[-1]["llama limit"] == 40 * MiB
    assert lab.rows[-1]["llama asked"] == 24 * MiB
    lab.shed_button.click()
    assert lab.last_error is None
    assert lab.rows[-1]["llama"] == 40 * MiB == lab.owners["llama"].backed_bytes
    assert lab.rows[-1]["llama asked"] == 0 and lab.tenants["llama"].poll() is None


def test_shed_without_a_standing_request_says_so_and_changes_nothing(lab: BudgetLab) -> None:
    rows = len(lab.rows)
    lab.shed_button.click()
    assert lab.error_text.startswith("StateError") and "no shed request" in lab.error_text
    assert len(lab.rows) == rows


def test_give_back_releases_past_the_tokens_and_books_it_back(lab: BudgetLab) -> None:
    assert _grow(lab, "qwen", 8192)
    lab.tokens.value = 2048
    lab.give_back_button.click()
    assert lab.rows[-1]["qwen"] == lab.owners["qwen"].backed_bytes == 16 * MiB


def test_choosing_a_tenant_shows_its_limit_on_the_slider(lab: BudgetLab) -> None:
    lab.limit_mib.value = 24
    lab.set_limit_button.click()
    lab.tenant.value = "qwen"
    assert lab.limit_mib.value == 96
    lab.tenant.value = "llama"
    assert lab.limit_mib.value == 24


def test_the_budget_lab_works_on_the_host_driver() -> None:
    panel = BudgetLab(budget_mib=32, driver="host")
    try:
        assert _grow(panel, "llama", 2048)
        assert panel.rows[-1]["llama"] == panel.owners["llama"].backed_bytes == 16 * MiB
    finally:
        panel.close()
    assert all(o.closed for o in panel.owners.values())


@pytest.mark.parametrize(("kw", "name"), [({"budget_mib": 0}, "budget_mib"),
                                          ({"budget_mib": 2.5}, "budget_mib"),
                                          ({"driver": "tpu"}, "driver")])
def test_a_bad_budget_or_driver_is_an_argument_error_naming_it(kw: dict[str, object],
                                                              name: str) -> None:
    with pytest.raises(ArgumentError, match=name):
        BudgetLab(**kw)  # type: ignore[arg-type]


def test_the_ledger_figure_stacks_the_tenants_under_the_budget_line() -> None:
    rows = [{"a": 8 * MiB, "a limit": 32 * MiB, "a asked": 0, "b": 4 * MiB,
             "b limit": 64 * MiB, "b asked": 2 * MiB, "free": 52 * MiB}]
    fig = ledger_figure(["one"], rows, 64 * MiB)
    assert fig.layout.barmode == "stack"
    bars = {t.name: list(t.y) for t in fig.data if t.type == "bar"}
    assert bars == {"a booked": [8.0], "b booked": [4.0]}
    # b's limit is the budget: only a's is drawn
    assert [t.name for t in fig.data if t.type == "scatter"] == ["a's limit"]
    assert fig.layout.shapes[0].y0 == 64.0
    assert [t.text for t in fig.data if t.type == "bar"] == [("",), ("asked<br>2.0 MiB",)]


def test_a_driver_that_cannot_open_leaves_no_ledger_or_tenant_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvvmm.lab.budget_lab as budget_lab

    def unavailable(kind: str, profile: str) -> Driver:
        raise DriverUnavailableError(f"{kind}: not here")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(budget_lab, "_open", unavailable)
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(DriverUnavailableError):
        BudgetLab()
    gc.collect()
    assert set(os.listdir("/proc/self/fd")) <= fds  # the ledger's file closed
    assert list(tmp_path.iterdir()) == []  # and its folder gone
