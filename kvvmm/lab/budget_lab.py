"""BudgetLab: two tenants sharing one GPU's budget through the real broker (kvvmm.budget)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import ipywidgets as widgets
import plotly.graph_objects as go

from kvvmm.budget import BudgetedDriver, Ledger, Tenant
from kvvmm.checks import int_arg
from kvvmm.driver import DRIVER_KINDS
from kvvmm.errors import ArgumentError, StateError
from kvvmm.lab._panel import _controls, _field, _open, _Panel, _pre
from kvvmm.layout import mha_token_major
from kvvmm.owner import KvBufferOwner
from kvvmm.policy import Exact
from kvvmm.units import MiB, fmt_bytes

__all__ = ["BudgetLab", "ledger_figure"]

#: The tenants' names, in the order the panel registers them.
TENANTS = ("llama", "qwen")
PAGE = 16
RESERVED_TOKENS = 16_384


def ledger_figure(labels: list[str], rows: list[dict[str, int]], budget_bytes: int, *,
                  title: str = "the ledger, step by step") -> go.Figure:
    """What a ledger booked after each step: the tenants' bytes stacked (what each is asked
    to shed written in its bar), each limit that drops below the budget, the budget.

    Args:
        labels: the steps' names.
        rows: per step, ``{name: backed, f"{name} limit": limit, f"{name} asked": shed asked,
            "free": free bytes}`` for every tenant name.
        budget_bytes: the GPU's budget (a dashed line).
    Returns:
        A plotly figure.
    """
    names = [k for k in (rows[0] if rows else {}) if k != "free" and " " not in k]
    fig = go.Figure()
    for name in names:
        fig.add_bar(x=labels, y=[r[name] / MiB for r in rows], name=f"{name} booked",
                    text=[f"asked<br>{fmt_bytes(r[f'{name} asked'])}"
                          if r[f"{name} asked"] else "" for r in rows],
                    textposition="inside", textangle=0)
    for name in names:  # a limit at the budget says nothing the budget line does not
        limits = [r[f"{name} limit"] for r in rows]
        if min(limits) < budget_bytes:
            fig.add_scatter(x=labels, y=[v / MiB for v in limits], name=f"{name}'s limit",
                            mode="lines+markers", line_dash="dot")
    fig.add_hline(y=budget_bytes / MiB, line_dash="dash", annotation_text="budget")
    fig.update_layout(barmode="stack", title=title, yaxis_title="MiB", height=420,
                      margin={"t": 80, "b": 140},
                      legend={"orientation": "h", "y": 1.02, "yanchor": "bottom",
                              "traceorder": "normal"})
    return fig


class BudgetLab(_Panel):
    """Two tenants of one ledger, each an owner on its own ``BudgetedDriver``.

    The panel makes a ledger in a temporary folder with ``budget MiB``, registers ``llama``
    and ``qwen`` (each through its own :class:`~kvvmm.budget.Ledger`, as two processes would;
    both refuse at once when the budget is full, ``shed_wait_s=0``) and gives each an owner of
    two layers (4 buffers of 2 KiB per token) growing under ``Exact()`` on the chosen driver.
    Pick a tenant and a token count, then **Grow** (``ensure_prefix``: refused past its limit
    or the free budget, with the broker's typed error shown and nothing changed), **Give
    back** (``release_beyond``), **Set limit** (``Ledger.set_limit``, live: below what the
    tenant books it is asked to shed) or **Shed** (what its engine does when it polls: give
    back the standing request's bytes in whole granules). The table and the figure show the
    ledger after every step.

    Args:
        budget_mib: the GPU's budget, MiB.
        driver: ``"sim"`` or ``"host"`` (real memory).
    Raises:
        ArgumentError: a bad budget or driver.
    """

    def __init__(self, budget_mib: int = 96, *, driver: str = "sim") -> None:
        int_arg("budget_mib", budget_mib, lo=8, hi=1 << 20, limit="an int in [8, 2^20] (MiB)")
        if driver not in DRIVER_KINDS:
            raise ArgumentError("driver", driver, f"one of {list(DRIVER_KINDS)}")
        self.tenant = widgets.Dropdown(options=list(TENANTS), value=TENANTS[0],
                                       description="tenant", **_field())
        self.tokens = widgets.IntSlider(value=4096, min=1024, max=RESERVED_TOKENS, step=1024,
                                        description="tokens", **_field("360px"))
        self.limit_mib = widgets.IntSlider(value=budget_mib, min=0, max=budget_mib, step=8,
                                           description="limit MiB", **_field("360px"))
        self.grow_button = widgets.Button(description="Grow")
        self.give_back_button = widgets.Button(description="Give back")
        self.set_limit_button = widgets.Button(description="Set limit")
        self.shed_button = widgets.Button(description="Shed")
        self.report = widgets.HTML(value="")
        self.labels: list[str] = []  #: each step's name
        self.rows: list[dict[str, int]] = []  #: the ledger after each step (bytes)
        self._folder = tempfile.TemporaryDirectory(prefix="kvvmm-budget-lab-")
        self.ledgers: dict[str, Ledger] = {}
        self.tenants: dict[str, Tenant] = {}
        self.owners: dict[str, KvBufferOwner] = {}
        descs = mha_token_major(layers=2, kv_heads=8, head_dim=128,
                                reserved_tokens=RESERVED_TOKENS, page_size=PAGE,
                                dtype="bfloat16")
        self._granule_bytes = sum(d.row_bytes for d in descs) * 1024  # 1,024 tokens
        try:  # a failure (an unavailable driver) gives back what was made before it
            path = Path(self._folder.name) / "ledger"
            for i, name in enumerate(TENANTS):
                led = Ledger(path, budget_bytes=budget_mib * MiB if i == 0 else None)
                self.ledgers[name] = led
                t = self.tenants[name] = led.register(name, shed_wait_s=0.0)
                drv = BudgetedDriver(_open(driver, "h200"), t)
                self.owners[name] = KvBufferOwner(
                    driver=drv, dtype="bfloat16", page_size=PAGE,
                    reserved_tokens=RESERVED_TOKENS, descs=descs, policy=Exact(), name=name)
        except BaseException:
            self.close()
            raise
        self._record("both owners made (slot 0)")
        super().__init__(ledger_figure(self.labels, self.rows, budget_mib * MiB))
        self.report.value = _pre(self.table())
        self.tenant.observe(lambda _: self._sync_limit(), names="value")
        self.grow_button.on_click(lambda _: self.grow())
        self.give_back_button.on_click(lambda _: self.give_back())
        self.set_limit_button.on_click(lambda _: self.set_limit())
        self.shed_button.on_click(lambda _: self.shed())
        self.widget = widgets.VBox([
            _controls(self.tenant, self.tokens, self.grow_button, self.give_back_button),
            _controls(self.limit_mib, self.set_limit_button, self.shed_button),
            self.error, self.report, self.plot,
        ], layout={"width": "100%"})
        self._add_dom_classes("budget-lab")

    # -- actions -------------------------------------------------------------------------

    def grow(self) -> bool:
        """The chosen tenant's owner backs the first ``tokens``, by 1,024-token decode steps
        (so that it can give back whole granules later); True if every step fit."""
        name, n = self.tenant.value, self.tokens.value
        owner = self.owners[name]

        def grow_by_steps() -> None:
            for m in [*range(owner.backed_tokens // 1024 * 1024 + 1024, n, 1024), n]:
                owner.ensure_prefix(m)  # a refused step leaves the steps before it

        return self._run(lambda: self._step(f"{name} grows to {n:,}", grow_by_steps))

    def give_back(self) -> bool:
        """The chosen tenant gives back everything past ``tokens``; True if it ran."""
        name, n = self.tenant.value, self.tokens.value
        return self._run(lambda: self._step(f"{name} gives back past {n:,}",
                                            lambda: self.owners[name].release_beyond(n)))

    def set_limit(self) -> bool:
        """Set the chosen tenant's limit to ``limit MiB``, live; True if it ran."""
        name, mib = self.tenant.value, self.limit_mib.value
        return self._run(lambda: self._step(
            f"{name}'s limit set to {mib} MiB",
            lambda: self.ledgers[name].set_limit(name, mib * MiB, shed_wait_s=60.0)))

    def shed(self) -> bool:
        """Answer the chosen tenant's standing shed request, as its engine would between
        decode steps: give back its tail in whole granules. True if it ran."""
        name = self.tenant.value

        def act() -> None:
            req = self.tenants[name].poll()
            if req is None:
                raise StateError(f"no shed request stands against {name!r}: lower its "
                                  f"limit below what it books first")
            owner = self.owners[name]
            give = -(-req.shed_bytes // self._granule_bytes) * 1024
            self._step(f"{name} asked {fmt_bytes(req.shed_bytes)}: sheds",
                       lambda: owner.release_beyond(max(owner.backed_tokens - give, PAGE)))

        return self._run(act)

    def close(self) -> None:
        """Close the owners (every release books back), the tenants and the ledgers."""
        for owner in self.owners.values():
            owner.close()
        for t in self.tenants.values():
            t.close()
        for led in self.ledgers.values():
            led.close()
        self._folder.cleanup()

    # -- wiring --------------------------------------------------------------------------

    def _sync_limit(self) -> None:
        self.limit_mib.value = self.tenants[self.tenant.value].limit_bytes // MiB

    def _step(self, label: str, action: Callable[[], object]) -> None:
        """Run ``action`` and book the ledger after it, refused or not."""
        try:
            action()
        except Exception:
            self._book(f"{label}: refused")
            raise
        self._book(label)

    def _book(self, label: str) -> None:
        """Record the ledger after ``label`` and show it."""
        self._record(label)
        self.report.value = _pre(self.table())
        self._show(ledger_figure(self.labels, self.rows, self.ledgers[TENANTS[0]].budget_bytes))

    def _record(self, label: str) -> None:
        snap = self.ledgers[TENANTS[0]].snapshot()
        row = {"free": snap.free_bytes}
        for t in snap.tenants:
            row |= {t.name: t.backed_bytes, f"{t.name} limit": t.limit_bytes,
                    f"{t.name} asked": t.shed_bytes}
        self.labels.append(label)
        self.rows.append(row)

    def table(self) -> str:
        """The ledger after each step, MiB, one line each (what the panel shows)."""
        cols = [f"{n}{s}" for n in TENANTS for s in ("", " limit", " asked")] + ["free"]
        heads = [c.split(" ")[-1] if " " in c else c for c in cols]
        lines = [f"{'MiB after':32s}" + "".join(f"{h:>8s}" for h in heads)]
        for label, row in zip(self.labels, self.rows, strict=True):
            lines.append(f"{label:32s}" + "".join(
                f"{row[c] / MiB:>8g}" if row[c] or c == "free" else f"{'-':>8s}"
                for c in cols))
        return "\n".join(lines)
