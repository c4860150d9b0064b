"""ArenaLab: drive one arena (or a KV owner) step by step and watch its VA map."""

from __future__ import annotations

import ipywidgets as widgets

from kvvmm.arena import Arena
from kvvmm.driver import DRIVER_KINDS, PROFILES, Driver
from kvvmm.errors import ArgumentError, StateError
from kvvmm.growth import growth_cost
from kvvmm.lab._panel import (
    _controls,
    _cost_line,
    _empty_snapshot,
    _field,
    _line,
    _open,
    _Panel,
    _policy_options,
    _pre,
)
from kvvmm.layout import KvBufferDesc, mha_token_major
from kvvmm.owner import KvBufferOwner
from kvvmm.record import Trace, TracingDriver
from kvvmm.snapshot import ArenaSnapshot, OwnerSnapshot
from kvvmm.units import MiB, fmt_bytes
from kvvmm.viz import describe, va_map

__all__ = ["ArenaLab"]


class ArenaLab(_Panel):
    """An arena (or a KV owner) to drive by hand, with its live VA map and driver-call log.

    Two ways in: **Reserve** makes a bare :class:`~kvvmm.arena.Arena` of ``reserve_mib``
    to ``allocate`` / ``commit`` / ``decommit`` by hand; **Reserve KV** makes a
    :class:`~kvvmm.owner.KvBufferOwner` (``layers`` K and V buffers, 8 KV heads of 128,
    bf16) to ``ensure_prefix`` / ``finalize`` / ``shrink`` by tokens. **Sleep** gives every
    physical byte of either back, keeping the reservation (the map says "asleep" and what a
    wake backs), its bytes kept or not as **backup** says (none, host memory, or a file in a
    temporary folder); **Wake** backs the same ranges at the same VA and copies them back.
    **Close** gives everything back. Every driver call goes through a
    :class:`~kvvmm.trace.TracingDriver`; ``trace`` holds them and ``log`` shows the last ones.

    Args:
        driver: ``"sim"``, ``"host"`` or ``"cuda"``, or a driver object to use as it is
            (a :class:`~kvvmm.driver.FaultyDriver`, say); the dropdown is then disabled.
        profile: the sim driver's device profile.
        reserve_mib, layers, reserved_tokens, page_size: initial control values.

    Raises:
        ArgumentError: a driver kind or a profile key the lab does not offer.

    A button pressed before the step it needs (Commit with no arena, Reserve with one open)
    shows a :class:`~kvvmm.errors.StateError` naming that step in the panel.
    """

    def __init__(self, driver: str | Driver = "sim", profile: str = "h200", *,
                 reserve_mib: int = 64, layers: int = 2, reserved_tokens: int = 4096,
                 page_size: int = 16) -> None:
        self._given: Driver | None = None if isinstance(driver, str) else driver
        kind = driver if isinstance(driver, str) else driver.kind
        if kind not in DRIVER_KINDS:
            raise ArgumentError("driver" if self._given is None else "driver.kind", kind,
                                f"one of {list(DRIVER_KINDS)}")
        if profile not in PROFILES:
            raise ArgumentError("profile", profile, f"one of {sorted(PROFILES)}")
        self.arena: Arena | None = None
        self.owner: KvBufferOwner | None = None
        self.trace = Trace()
        self._driver: Driver | None = None
        self._last: ArenaSnapshot | OwnerSnapshot | None = None
        self.driver = widgets.Dropdown(options=list(DRIVER_KINDS), value=kind, description="driver",
                                       disabled=self._given is not None, **_field())
        self.profile = widgets.Dropdown(options=sorted(PROFILES), value=profile,
                                        description="profile", **_field())
        # Bare arena.
        self.reserve_mib = widgets.IntText(value=reserve_mib, description="reserve MiB",
                                           **_field("180px"))
        self.reserve_button = widgets.Button(description="Reserve", button_style="primary")
        self.alloc_mib = widgets.IntText(value=16, description="allocate MiB",
                                         **_field("180px"))
        self.alloc_name = widgets.Text(value="", placeholder="name (optional)",
                                       layout=widgets.Layout(width="140px"))
        self.allocate_button = widgets.Button(description="Allocate")
        self.target = widgets.Dropdown(options=[], description="allocation", **_field())
        self.commit_mib = widgets.IntSlider(value=0, min=0, max=0, step=2,
                                            description="MiB", continuous_update=False)
        self.commit_button = widgets.Button(description="Commit")
        self.decommit_button = widgets.Button(description="Decommit to")
        # KV owner.
        self.layers = widgets.IntText(value=layers, description="layers", **_field("130px"))
        self.reserved_tokens = widgets.IntText(value=reserved_tokens,
                                               description="reserved tokens", **_field("210px"))
        self.page_size = widgets.IntText(value=page_size, description="page",
                                         **_field("120px"))
        self.policy = widgets.Dropdown(options=_policy_options(), description="policy",
                                       **_field())
        # What the chosen policy costs, next to where it is chosen: the default's chunks
        # back far more than a short prefix needs on a model with many buffers.
        self.policy_cost = widgets.HTML(value="")
        self.reserve_kv_button = widgets.Button(description="Reserve KV",
                                                button_style="primary")
        self.tokens = widgets.IntSlider(value=0, min=0, max=reserved_tokens,
                                        description="tokens", continuous_update=False)
        self.prefix_button = widgets.Button(description="Ensure prefix")
        self.finalize_button = widgets.Button(description="Finalize")
        self.shrink_button = widgets.Button(description="Shrink")
        self.backup = widgets.Dropdown(options=[("none", "none"), ("host", "host"),
                                                ("disk", "disk")], value="none",
                                       description="backup", **_field("170px"))
        self.sleep_button = widgets.Button(description="Sleep")
        self.wake_button = widgets.Button(description="Wake")
        self.sleep_status = widgets.HTML(value="")
        self._disk_dir: str | None = None  # a temporary folder for backup="disk", made once
        self._disk_files = 0
        self.close_button = widgets.Button(description="Close", button_style="warning")
        self.summary = widgets.HTML(value=_pre("nothing reserved yet"))
        self.log = widgets.HTML(value=_pre("no driver calls yet"),
                                layout={"max_height": "180px", "overflow": "auto"})
        super().__init__(va_map(_empty_snapshot(profile)))

        self.reserve_button.on_click(lambda _: self._run(self._reserve))
        self.reserve_kv_button.on_click(lambda _: self._run(self._reserve_kv))
        self.allocate_button.on_click(lambda _: self._run(self._allocate))
        self.commit_button.on_click(lambda _: self._run(self._commit))
        self.decommit_button.on_click(lambda _: self._run(self._decommit))
        self.prefix_button.on_click(lambda _: self._run(self._ensure_prefix))
        self.finalize_button.on_click(lambda _: self._run(self._finalize))
        self.shrink_button.on_click(lambda _: self._run(self._shrink))
        self.sleep_button.on_click(lambda _: self._run(self._sleep))
        self.wake_button.on_click(lambda _: self._run(self._wake))
        self.close_button.on_click(lambda _: self._run(self._close))
        self.target.observe(lambda _: self._fit_commit_slider(), names="value")

        for c in (self.policy, self.layers, self.reserved_tokens, self.page_size):
            c.observe(lambda _: self._show_policy_cost(), names="value")
        self._show_policy_cost()
        self.widget = widgets.VBox([
            _controls(self.driver, self.profile, self.close_button),
            _controls(self.reserve_mib, self.reserve_button, self.alloc_mib, self.alloc_name,
                      self.allocate_button),
            _controls(self.target, self.commit_mib, self.commit_button, self.decommit_button),
            _controls(self.layers, self.reserved_tokens, self.page_size, self.policy,
                      self.reserve_kv_button),
            self.policy_cost,
            _controls(self.tokens, self.prefix_button, self.finalize_button,
                      self.shrink_button),
            _controls(self.backup, self.sleep_button, self.wake_button, self.sleep_status),
            self.error, self.plot, self.summary, self.log,
        ], layout={"width": "100%"})
        self._add_dom_classes("arena-lab")

    # -- state -----------------------------------------------------------------------

    def policy_cost_text(self) -> str:
        """What the chosen policy backs beyond need, decoding the KV buffers to capacity."""
        descs = self._kv_descs()
        cost = growth_cost(self.policy.value, descs, page_size=self.page_size.value,
                           itemsize=2, tokens=self.reserved_tokens.value,
                           granularity_bytes=PROFILES[self.profile.value].granularity_bytes)
        return f"{cost.policy} on {cost.buffers} buffers: {_cost_line(cost)}"

    def _show_policy_cost(self) -> None:
        try:
            text = self.policy_cost_text()
        except Exception as e:  # a half-typed value: say why, the controls stay usable
            text = f"over-commit: - ({type(e).__name__}: {e})"
        self.policy_cost.value = _line(text)

    def _kv_descs(self) -> list[KvBufferDesc]:
        return mha_token_major(layers=self.layers.value, kv_heads=8, head_dim=128,
                               reserved_tokens=self.reserved_tokens.value,
                               page_size=self.page_size.value, dtype="bfloat16")

    def snapshot(self) -> ArenaSnapshot | OwnerSnapshot | None:
        """The owner's or arena's snapshot now (the last one after close), None before."""
        if self.owner is not None:
            return self.owner.snapshot()
        if self.arena is not None:
            return self.arena.snapshot()
        return self._last

    @property
    def driver_object(self) -> Driver | None:
        """The (tracing) driver the current arena runs on."""
        return self._driver

    def log_text(self, last: int = 12) -> str:
        """The last ``last`` driver calls, one a line (simulated cost on the sim driver)."""
        calls = self.trace.driver_calls()
        lines = [f"{len(calls)} driver calls"]
        for e in calls[-last:]:
            args = ", ".join(
                f"{k}={v:#x}" if k == "va" else f"{k}={fmt_bytes(v)}" if k == "size"
                else f"{k}={v}" for k, v in e.args.items())
            res = "" if e.result is None else (
                f" -> {e.result:#x}" if e.op == "reserve" else f" -> {e.result}")
            cost = f"{e.sim_us:.1f} µs sim" if e.sim_us else ""
            err = f"  FAILED {e.error}" if e.error else ""
            lines.append(f"#{e.seq} {e.op}({args}){res}  {cost}{err}".rstrip())
        return "\n".join(lines)

    def _after_error(self) -> None:
        self.log.value = _pre(self.log_text())

    def _refresh(self) -> None:
        snap = self.snapshot()
        names = [] if snap is None else [
            a.name for a in (snap.arena if isinstance(snap, OwnerSnapshot) else snap).allocations]
        current = self.target.value
        self.target.options = names
        if current in names:
            self.target.value = current
        self._fit_commit_slider()
        if self.owner is not None:
            self.tokens.max = self.owner.reserved_tokens
        self.summary.value = _pre("nothing reserved yet" if snap is None else describe(snap))
        self.log.value = _pre(self.log_text())
        self._show(va_map(snap if snap is not None else _empty_snapshot(self.profile.value)))

    def _fit_commit_slider(self) -> None:
        a = self._open_arena(required=False)
        if a is None or self.target.value is None:
            self.commit_mib.max = 0
            return
        snap = a.snapshot()
        alloc = snap.allocation(self.target.value)
        self.commit_mib.step = max(1, snap.granularity // MiB)
        self.commit_mib.max = alloc.size_bytes // MiB
        self.commit_mib.value = min(self.commit_mib.max, -(-alloc.backed_bytes // MiB))

    def _open_arena(self, required: bool = True) -> Arena | None:
        a = self.owner.arena if self.owner is not None else self.arena
        if a is None or a.closed:
            if required:
                raise StateError("no open arena: press Reserve or Reserve KV first")
            return None
        return a

    def _offset(self) -> int:
        a = self._open_arena()
        assert a is not None
        if self.target.value is None:
            raise StateError("no allocation chosen: allocate one first")
        return a.snapshot().allocation(self.target.value).offset

    def _new_driver(self) -> TracingDriver:
        if self._open_arena(required=False) is not None:
            raise StateError("an arena is open: press Close before reserving another")
        inner = self._given if self._given is not None else _open(self.driver.value,
                                                                   self.profile.value)
        return TracingDriver(inner, Trace())

    # -- actions ---------------------------------------------------------------------

    def _reserve(self) -> None:
        drv = self._new_driver()
        arena = Arena(drv, reserve_bytes=self.reserve_mib.value * MiB, name="arena",
                      trace=drv.trace)
        self._driver, self.trace, self.arena, self.owner = drv, drv.trace, arena, None
        self._refresh()

    def _reserve_kv(self) -> None:
        drv = self._new_driver()
        descs = self._kv_descs()
        owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=self.page_size.value,
                              reserved_tokens=self.reserved_tokens.value, descs=descs,
                              policy=self.policy.value, trace=drv.trace)
        self._driver, self.trace, self.owner, self.arena = drv, drv.trace, owner, owner.arena
        self.tokens.max = owner.reserved_tokens
        self._refresh()

    def _allocate(self) -> None:
        a = self._open_arena()
        assert a is not None
        name = self.alloc_name.value.strip() or None
        a.allocate(self.alloc_mib.value * MiB, name)
        self._refresh()
        self.target.value = a.snapshot().allocations[-1].name

    def _commit(self) -> None:
        a = self._open_arena()
        assert a is not None
        a.commit(self._offset(), self.commit_mib.value * MiB)
        self._refresh()

    def _decommit(self) -> None:
        a = self._open_arena()
        assert a is not None
        a.decommit(self._offset(), self.commit_mib.value * MiB)
        self._refresh()

    def _kv(self) -> KvBufferOwner:
        if self.owner is None or self.owner.closed:
            raise StateError("this needs KV buffers: press Reserve KV first")
        return self.owner

    def _ensure_prefix(self) -> None:
        self._kv().ensure_prefix(self.tokens.value)
        self._refresh()

    def _finalize(self) -> None:
        self._kv().finalize(self.tokens.value)
        self._refresh()

    def _shrink(self) -> None:
        self._kv().shrink(self.tokens.value)
        self._refresh()

    def _disk_path(self) -> str:
        """A new file in the lab's temporary folder (a disk backup never overwrites one)."""
        import os
        import tempfile

        if self._disk_dir is None:
            self._disk_dir = tempfile.mkdtemp(prefix="kvvmm-lab-sleep-")
        self._disk_files += 1
        return os.path.join(self._disk_dir, f"sleep-{self._disk_files}.bin")

    def _sleep(self) -> None:
        a = self._open_arena()
        assert a is not None
        kind = None if self.backup.value == "none" else self.backup.value
        path = self._disk_path() if kind == "disk" else None
        res = (self.owner.sleep(kind, path=path) if self.owner is not None
               else a.sleep(kind, path=path))
        self.sleep_status.value = _line(str(res))
        self._refresh()

    def _wake(self) -> None:
        a = self._open_arena()
        assert a is not None
        got = self.owner.wake() if self.owner is not None else a.wake()
        self.sleep_status.value = _line(f"wake: backed {fmt_bytes(got)} again at the same VA")
        self._refresh()

    def _close(self) -> None:
        if self.owner is not None:
            self.owner.close()
        elif self.arena is not None:
            self.arena.close()
        self._last = self.snapshot()
        self.owner = self.arena = None
        self._refresh()
