"""Text reports: what notebooks print and nbval compares, and what the CLI prints.

Pure functions of snapshots, stats, plans and results. On the sim driver every figure in them
is deterministic; absolute addresses appear only as ``base 0x...`` so that a sanitizer can mask
them on real drivers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvvmm.driver.base import DriverStats
from kvvmm.errors import ArgumentError
from kvvmm.hardware import DeviceProfile
from kvvmm.hardware.bandwidth import BANDWIDTH_TARGET, BandwidthTable
from kvvmm.layout import KvBufferDesc, Plan
from kvvmm.snapshot import ArenaSnapshot, OwnerSnapshot
from kvvmm.units import fmt_bytes, fmt_range
from kvvmm.viz._common import Report, Table, _arena_of, _count, _table, profile_words

if TYPE_CHECKING:
    from kvvmm.growth import GrowthResult

__all__ = ["describe", "describe_descs", "describe_stats", "format_growth", "format_plan",
           "growth_report"]


def describe(snapshot: ArenaSnapshot | OwnerSnapshot) -> str:
    """A multi-line text summary of an arena or owner snapshot, for people and for nbval.

    Offsets are from the arena base and identical on every driver; the one absolute
    address is the ``base 0x...`` on the second line.

    Args:
        snapshot: ``arena.snapshot()`` or ``owner.snapshot()``.
    Returns:
        Lines: what the arena is, its reserved / backed / slack VA, then one line per
        allocation (for an owner: per buffer, with its slot-0, prefix and final spans).
    Raises:
        ArgumentError: ``snapshot`` is not a snapshot.
    """
    a = _arena_of(snapshot)
    handles = Counter(m.allocation for m in a.mappings)
    out = []
    if isinstance(snapshot, OwnerSnapshot):
        final = "-" if snapshot.final_tokens is None else f"{snapshot.final_tokens:,}"
        out.append(f"owner {a.name!r}: {len(snapshot.buffers)} buffers, {snapshot.dtype}, "
                   f"page {snapshot.page_size} tokens, policy {snapshot.policy}")
        out.append(f"tokens: reserved {snapshot.reserved_tokens:,}, prefix "
                   f"{snapshot.prefix_tokens:,}, final {final}")
    state = ", closed" if a.closed else ""
    if a.asleep_bytes:
        state += (f", asleep: {fmt_bytes(a.asleep_bytes)} in "
                  f"{len(a.asleep_mappings)} mappings to wake at the same VA")
    out.append(f"arena {a.name!r} on {a.driver} ({a.device_name}), granularity "
               f"{fmt_bytes(a.granularity)}{state}")
    pct = 100.0 * a.backed_bytes / a.reserved_bytes if a.reserved_bytes else 0.0
    out.append(f"reserved {fmt_bytes(a.reserved_bytes)} at base {a.base:#x}, cursor "
               f"{fmt_bytes(a.cursor_bytes)}, slack {fmt_bytes(a.slack_bytes)}")
    out.append(f"backed   {fmt_bytes(a.backed_bytes)} in {_count(len(a.mappings), 'handle')} "
               f"({pct:.1f}% of reserved), unbacked {fmt_bytes(a.unbacked_bytes)}")
    if isinstance(snapshot, OwnerSnapshot):
        header = ["buffer", "offsets", "span", "backed", "handles", "slot 0", "prefix", "final"]
        rows = [[b.name, fmt_range(b.offset, b.offset + b.aligned_bytes),
                 fmt_bytes(b.reserved_span_bytes), fmt_bytes(b.backed_bytes),
                 str(handles.get(b.name, 0)), fmt_bytes(b.page0_bytes),
                 fmt_bytes(b.prefix_bytes),
                 "-" if b.final_bytes is None else fmt_bytes(b.final_bytes)]
                for b in snapshot.buffers]
    else:
        header = ["allocation", "offsets", "size", "requested", "backed", "handles"]
        rows = [[x.name, fmt_range(x.offset, x.end), fmt_bytes(x.size_bytes),
                 fmt_bytes(x.requested_bytes), fmt_bytes(x.backed_bytes),
                 str(handles.get(x.name, 0))] for x in a.allocations]
    if rows:
        out += _table(header, rows)
    return "\n".join(out)


def describe_stats(stats: DriverStats, *, profile: str | DeviceProfile | None = None) -> str:
    """One line on what a driver holds (``driver.stats()``); says ``clean`` when nothing.

    Args:
        stats: a :class:`~kvvmm.driver.base.DriverStats`.
        profile: the sim's profile (``driver.profile``), named at the end so a simulated
            figure says what it predicts from; None: not named.
    Returns:
        ``"1 reservation (40.0 MiB), 4 handles, 4 mappings (8.0 MiB), physical 8.0 MiB"``
        or ``"clean: no reservation, handle, mapping or memory held"``, plus
        ``" (sim profile h200 (NVIDIA H200, 2026-12-01); costs: h200, measured on an H200;
        capacity: h200)"`` with a profile.
    """
    if not isinstance(stats, DriverStats):
        raise ArgumentError("stats", type(stats).__name__, "a DriverStats (driver.stats())")
    tail = "" if profile is None else f" (sim profile {profile_words(profile)})"
    if stats.clean:
        return "clean: no reservation, handle, mapping or memory held" + tail
    return (f"{_count(stats.reservations, 'reservation')} ({fmt_bytes(stats.reserved_bytes)}), "
            f"{_count(stats.handles, 'handle')}, {_count(stats.mappings, 'mapping')} "
            f"({fmt_bytes(stats.mapped_bytes)}), physical {fmt_bytes(stats.physical_bytes)}"
            + tail)


def describe_descs(descs: Sequence[KvBufferDesc], itemsize: int) -> str:
    """One line per distinct buffer shape: how many, shape, bytes per row and per buffer."""
    groups: dict[tuple[tuple[int, ...], int, int], int] = {}
    for d in descs:
        key = (d.shape, d.row_bytes, d.tokens_per_row)
        groups[key] = groups.get(key, 0) + 1
    lines = []
    for (shape, row, per_row), n in groups.items():
        span = itemsize
        for dim in shape:
            span *= dim
        unit = "token" if per_row == 1 else f"{per_row}-token page"
        lines.append(f"{n} buffers of shape {shape}: {fmt_bytes(row)} per {unit}, "
                     f"{fmt_bytes(span)} each")
    return "\n".join(lines)


def format_plan(p: Plan) -> str:
    """A plan as a plain-text report for people (sizes via :func:`kvvmm.units.fmt_bytes`).

    Args:
        p: a :class:`Plan`.
    Returns:
        Lines of text: the inputs, the budget, one row per pool, one row per policy.
    """
    out = [*_plan_head(p), "", *_pool_table(p), "",
           f"handles while growing by {p.decode_step_tokens:,}-token decode steps, then finalize",
           *_handles_table(p)]
    out += [f"warning: {w}" for w in p.warnings]
    return "\n".join(out)


def _plan_head(p: Plan) -> list[str]:
    """The plan's inputs, its budget term by term, and what it reserves and backs."""
    counted = "padding and granularity counted" if p.count_overhead else "token slots only"
    return [
        f"{p.model} on {p.gpu_name} ({p.gpu}): {p.dtype}, page {p.page_size}, tp {p.tp}, "
        f"{p.layout}",
        f"granularity     {fmt_bytes(p.granularity_bytes)}",
        *_budget_lines(p),
        f"budget          {fmt_bytes(p.budget_bytes)} ({_budget_how(p)}; {counted})",
        f"bytes per token {fmt_bytes(p.bytes_per_token)} ({p.bytes_per_token} B per rank)",
        f"tokens          {p.tokens:,}",
        f"VA to reserve   {fmt_bytes(p.va_reserve_bytes)} over {p.num_buffers} buffers",
        f"backed at final {fmt_bytes(p.final_backed_bytes)} (padding {fmt_bytes(p.padding_bytes)}"
        f", granularity waste {fmt_bytes(p.granularity_waste_bytes)}"
        f", over budget {fmt_bytes(p.over_budget_bytes)})",
        *_over_budget_lines(p),
    ]


def _pool_table(p: Plan) -> list[str]:
    """One row per pool (full attention, sliding window)."""
    rows = [[q.name, str(q.num_layers), str(q.num_buffers), fmt_bytes(q.bytes_per_token),
             f"{q.tokens:,}", fmt_bytes(q.budget_bytes), fmt_bytes(q.final_backed_bytes),
             fmt_bytes(q.granularity_waste_bytes), fmt_bytes(q.va_reserve_bytes)]
            for q in p.pools]
    return _table(["pool", "layers", "buffers", "per token", "tokens", "budget", "backed",
                   "gran waste", "VA"], rows)


def _handles_table(p: Plan) -> list[str]:
    """One row per growth policy: the handles it makes and what it backs."""
    return _table(["policy", "handles", "smallest", "largest", "backed"],
                  [[h.policy, f"{h.handles:,}", fmt_bytes(h.min_handle_bytes),
                    fmt_bytes(h.max_handle_bytes), fmt_bytes(h.backed_bytes)]
                   for h in p.handles])


def _over_budget_lines(p: Plan) -> list[str]:
    """Where backing past the budget comes from, and whether it is safe (two short lines)."""
    over = p.over_budget_bytes
    if over <= 0:
        return []
    pad = " " * 16
    why = f"{pad}over budget: each buffer's padded page and granule rounding, not budgeted;"
    if p.headroom_bytes is None:
        return [why, f"{pad}it comes on top of the explicit budget (--count-overhead counts it)"]
    if over <= p.headroom_bytes:
        return [why, f"{pad}safe: it comes out of the {fmt_bytes(p.headroom_bytes)} headroom"]
    return [why, f"{pad}NOT safe: more than the {fmt_bytes(p.headroom_bytes)} headroom; "
                 "pass --count-overhead"]


def _budget_lines(p: Plan) -> list[str]:
    # Each term of SGLang's post-capture formula on its own line, saying what it is, so a
    # reader can check the figure against what the engine logs.
    if p.weights_bytes is None:
        weights = "weights         unknown (the config lacks the sizes to count parameters)"
    else:
        weights = (f"weights         {fmt_bytes(p.weights_bytes)} per rank ({p.weights_dtype}, "
                   "parameters counted from the config / tp)")
    lines = [f"total           {fmt_bytes(p.capacity_bytes)} (device memory before weights)",
             weights]
    if p.free_bytes is None:
        return lines
    if p.engine == "vllm":
        head = f"vLLM's margin + peak {fmt_bytes(p.activation_peak_bytes or 0)}"
    elif p.mem_fraction_static is None:
        head = "given"
    else:
        head = f"total * (1 - mem_fraction_static {p.mem_fraction_static:g})"
    derived = p.weights_bytes is not None and p.free_bytes == p.capacity_bytes - p.weights_bytes
    lines += [
        f"headroom        {fmt_bytes(p.headroom_bytes or 0)} ({head}: activations, graphs,"
        " allocator)",
        f"free            {fmt_bytes(p.free_bytes)} ("
        + ("after weights: total - weights; graphs come out of the headroom)" if derived
           else "after weights and graphs, as measured and given)"),
        f"backed          {fmt_bytes(p.backed_bytes)} (KV already backed when free was read, "
        "added back)",
    ]
    return lines


def _budget_how(p: Plan) -> str:
    how = "explicit" if p.free_bytes is None else \
        "vLLM's extensible KV cache: free + backed - headroom" if p.engine == "vllm" else \
        "max(0, free - headroom) + backed"
    if p.max_total_tokens is None:
        return how + ", no token cap"
    return (f"{how} = {fmt_bytes(p.memory_budget_bytes)}, capped by token cap "
            f"{p.max_total_tokens:,}")


def format_growth(results: Sequence[GrowthResult], *,
                  profile: str | DeviceProfile | None = None,
                  predicted: Sequence[GrowthResult] | None = None) -> str:
    """A table of :func:`decode_growth` results (no wall times on the sim: deterministic).

    Then the bandwidth against the target: each policy's predicted ratio to cudaMalloc's
    (:func:`kvvmm.hardware.predicted_ratio`), the band of the H200 runs the curve is fitted
    to, and whether it keeps the target; and the policy that keeps it with the least
    over-commit (:func:`kvvmm.growth.least_over_commit`). Two tables, so each fits a
    notebook's width. :func:`growth_report` is the same as tables (HTML in the lab).

    Args:
        results: what ran (on the sim, its clock is the driver time shown).
        profile: the profile the sim's times come from, named under the table.
        predicted: on a real driver, the same growth on the sim (same policies, same
            order): its time is shown as predicted next to the measured wall time.
    """
    if not results:
        return "no results"
    return growth_report(results, profile=profile, predicted=predicted).text(width=None)


def growth_report(results: Sequence[GrowthResult], *,
                  profile: str | DeviceProfile | None = None,
                  predicted: Sequence[GrowthResult] | None = None) -> Report:
    """:func:`format_growth`'s tables and sentences as a :class:`~kvvmm.viz._common.Report`
    (``.html()`` for a notebook cell, ``.text()`` for a terminal); same arguments."""
    from kvvmm.growth import least_over_commit

    if not results:
        return Report(lead=("no results",), tables=())
    # No "smallest" column: every owner's smallest handle is its slot-0 page, whatever the
    # policy, and with it the table ran a few characters past a 1280 px panel.
    rows = [[r.policy, f"{r.handles:,}", f"{r.driver_calls:,}",
             fmt_bytes(r.max_handle_bytes), fmt_bytes(r.backed_bytes),
             fmt_bytes(r.max_over_commit_bytes), f"{r.predicted_ratio.mid:.3f}x",
             f"{r.sim_us / 1000:.1f} ms" if r.sim_us else "-"] for r in results]
    # No TB/s column: the ratio is what the target is stated in (the figure's hover has the
    # TB/s), and with it the table ran past a 1280 px panel, cutting "driver time".
    head = ["policy", "handles", "calls", "largest", "backed", "max over", "vs malloc",
            "driver time"]
    if predicted is not None:
        head = [*head[:-1], "measured", "predicted", "pred/meas"]
        for row, r, p in zip(rows, results, predicted, strict=True):
            wall_ms = r.wall_s * 1e3
            row[-1:] = [f"{wall_ms:.1f} ms", f"{p.sim_us / 1000:.1f} ms",
                        f"{p.sim_us / 1000 / wall_ms:.2f}" if wall_ms > 0 else "-"]
    r0 = results[0]
    lead = (f"{r0.buffers} buffers grown to {r0.tokens[-1]:,} tokens in {len(r0.tokens)} "
            f"steps on {r0.driver}; needed at the end {fmt_bytes(r0.needed_bytes)}",)
    target = f">= {BANDWIDTH_TARGET:g}x"
    ratios = Table(f"copy bandwidth predicted against the target ({target} cudaMalloc; band: "
                   "the H200 runs' lowest to highest, fitted):",
                   ("policy", "vs malloc", "band", target),
                   tuple((r.policy, f"{r.predicted_ratio.mid:.3f}x",
                          f"{r.predicted_ratio.low:.3f}-{r.predicted_ratio.high:.3f}",
                          "yes" if r.predicted_ratio.mid >= BANDWIDTH_TARGET else "no")
                         for r in results))
    best = least_over_commit(results)
    tail = [f"keeps {target} cudaMalloc (predicted) with the least over-commit: "
            + (f"{best.policy} (max over {fmt_bytes(best.max_over_commit_bytes)})"
               if best is not None else "none of these")]
    if profile is not None and (predicted is not None or any(r.sim_us for r in results)):
        what = "predicted" if predicted is not None else "driver time"
        tail.append(f"{what}: simulated with profile {profile_words(profile)}")
    return Report(lead=lead, tables=(Table("", tuple(head), tuple(tuple(r) for r in rows)),
                                     ratios), tail=tuple(tail))


def format_bandwidth_fit(table: BandwidthTable | None = None) -> str:
    """The growth runs a table's interleaved curve is fitted to, against the fit.

    One row per measured copy (each growth policy's runs, and the table's interleaved
    points): runs, their median and range, the fitted ratio with its band, and whether the
    runs' median and the fit keep the target.

    Args:
        table: the measurements (default :data:`~kvvmm.hardware.H200_BANDWIDTH`).
    Returns:
        Text; a line saying so when the table has no growth runs.
    """
    from kvvmm.hardware.bandwidth import H200_BANDWIDTH, growth_fit

    table = H200_BANDWIDTH if table is None else table
    fit = growth_fit(table)
    if fit is None:
        return f"{table.device}: no growth runs; the interleaved curve is the table's"
    target = f">= {BANDWIDTH_TARGET:g}x"
    rows = []
    for p in fit.points:
        b = fit.band(p.copied)
        rows.append([p.label, str(len(p.ratios)), f"{p.median:.4f}",
                     f"{p.low:.4f}-{p.high:.4f}", f"{b.mid:.4f}", f"{b.low:.4f}-{b.high:.4f}",
                     "yes" if p.median >= BANDWIDTH_TARGET else "no",
                     "yes" if b.mid >= BANDWIDTH_TARGET else "no"])
    head = ["copy", "runs", "median", "range", "fitted", "fitted band", f"runs {target}",
            f"fit {target}"]
    knots = ", ".join(f"{fmt_bytes(k)} {1 / u:.4f}x" for k, u in zip(fit.knots_bytes,
                                                                      fit.mid.ys, strict=True))
    return "\n".join([f"{table.device}: bandwidth over cudaMalloc's, measured and fitted",
                      *_table(head, rows), f"fitted curve (median): {knots}"])
