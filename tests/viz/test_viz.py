"""kvvmm.viz: the figures' data are the snapshot's spans; the text summaries are exact."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")

import kvvmm
from kvvmm.arena import Arena
from kvvmm.driver import SimDriver
from kvvmm.errors import ArgumentError
from kvvmm.hardware import H200_BANDWIDTH, BandwidthTable, predicted_bandwidth_tb_s
from kvvmm.owner import KvBufferOwner
from kvvmm.snapshot import ArenaSnapshot, OwnerSnapshot
from kvvmm.units import GiB, MiB, fmt_range
from kvvmm.viz import (
    HEATMAP_THRESHOLD,
    VA_MAP_TRACES,
    bandwidth_by_handle_size,
    describe,
    describe_stats,
    handle_sizes,
    timeline,
    va_map,
)


def _arena_snapshot() -> ArenaSnapshot:
    arena = Arena(SimDriver("h200"), reserve_bytes=100 * MiB, name="a")
    x = arena.allocate(10 * MiB, "x")
    arena.commit(x, 3 * MiB)  # one 4 MiB handle
    arena.commit(x, 6 * MiB)  # a second, 2 MiB
    arena.allocate(5 * MiB, "y")  # 6 MiB aligned: 1 MiB of padding, nothing backed
    return arena.snapshot()


def _owner_snapshot(final: int | None = 2000) -> OwnerSnapshot:
    descs = kvvmm.mha_token_major(layers=2, kv_heads=8, head_dim=128, reserved_tokens=4096,
                                  page_size=16, dtype="bfloat16")
    owner = KvBufferOwner(driver=SimDriver("h200"), dtype="bfloat16", page_size=16,
                          reserved_tokens=4096, descs=descs, policy=kvvmm.Exact())
    owner.ensure_prefix(100)
    if final is not None:
        owner.finalize(final)
    return owner.snapshot()


def _bars(trace: object) -> list[tuple[float, float, float]]:
    """(row, start, length) of each bar, in axis units."""
    t: object = trace
    return [(float(y), float(b), float(x))
            for y, b, x in zip(t.y, t.base, t.x, strict=True)]  # type: ignore[attr-defined]


def test_va_map_draws_its_categories_as_a_few_traces_in_a_fixed_order() -> None:
    fig = va_map(_arena_snapshot())
    assert tuple(t.name for t in fig.data) == VA_MAP_TRACES
    assert not fig.layout.shapes  # never a shape per mapping
    assert fig.layout.meta["mode"] == "bars"


def test_va_map_backed_bars_are_the_mappings_of_the_snapshot() -> None:
    snap = _arena_snapshot()
    fig = va_map(snap)
    unit = fig.layout.meta["unit_bytes"]
    rows = {a.name: i for i, a in enumerate(snap.allocations)}
    expected = [(rows[m.allocation], m.offset, m.size_bytes) for m in snap.mappings]
    got = [(int(r), round(b * unit), round(x * unit)) for r, b, x in _bars(fig.data[0])]
    assert got == expected


def test_va_map_unbacked_padding_and_slack_cover_the_rest_of_the_reservation() -> None:
    snap = _arena_snapshot()
    fig = va_map(snap)
    unit = fig.layout.meta["unit_bytes"]
    by_name = {t.name: t for t in fig.data}
    unbacked = [(round(b * unit), round(x * unit)) for _, b, x in _bars(by_name["unbacked"])]
    padding = [(round(b * unit), round(x * unit)) for _, b, x in _bars(by_name["padding"])]
    slack = [(round(b * unit), round(x * unit)) for _, b, x in _bars(by_name["slack"])]
    x, y = snap.allocations
    assert unbacked == [(x.offset + x.backed_bytes, x.size_bytes - x.backed_bytes),
                        (y.offset, y.requested_bytes)]
    assert padding == [(y.offset + y.requested_bytes, y.size_bytes - y.requested_bytes)]
    assert slack == [(snap.cursor_bytes, snap.reserved_bytes - snap.cursor_bytes)]
    pieces = [*unbacked, *padding, *slack, *((m.offset, m.size_bytes) for m in snap.mappings)]
    assert sum(n for _, n in pieces) == snap.reserved_bytes  # the whole reservation, once


def test_va_map_hover_gives_absolute_half_open_ranges() -> None:
    snap = _arena_snapshot()
    fig = va_map(snap)
    m = snap.mappings[0]
    hover = list(fig.data[0].hovertext)
    assert fmt_range(snap.base + m.offset, snap.base + m.end) in hover[0]
    assert "4.0 MiB" in hover[0] and "handle #1" in hover[0]
    assert "[0x" in fig.data[1].hovertext[0]


def test_va_map_of_an_owner_marks_slot_0_prefix_and_final_at_each_buffer() -> None:
    snap = _owner_snapshot()
    fig = va_map(snap)
    unit = fig.layout.meta["unit_bytes"]
    by_name = {t.name: t for t in fig.data}
    for label, attr in (("slot-0 page", "page0_bytes"), ("prefix", "prefix_bytes"),
                        ("final", "final_bytes")):
        xs = [round(x * unit) for x in by_name[label].x]
        assert xs == [b.offset + getattr(b, attr) for b in snap.buffers], label
        assert by_name[label].showlegend
    assert fig.layout.meta["rows"] == [b.name for b in snap.buffers]  # no slack row
    labels = list(fig.layout.yaxis.ticktext)
    assert [t.split()[0] for t in labels] == [b.name for b in snap.buffers]
    assert all(t.endswith("%</b>") for t in labels)  # each row says how much is backed


def test_va_map_keeps_the_legend_off_the_title() -> None:
    """The legend sits in a band of the bottom margin (the subtitle ran under it at the top
    right); the band grows a row when the entries would wrap in a narrow cell."""
    fig = va_map(_owner_snapshot())
    legend, margin = fig.layout.legend, fig.layout.margin
    assert legend.orientation == "h" and legend.yref == "container" and legend.y == 0
    assert legend.yanchor == "bottom"
    assert margin.b >= 54 + 22  # the x axis, then one legend row
    assert fig.layout.meta["plot_px"] == fig.layout.height - margin.t - margin.b


def test_va_map_of_an_arena_has_no_owner_marks_in_its_legend() -> None:
    fig = va_map(_arena_snapshot())
    by_name = {t.name: t for t in fig.data}
    assert by_name["final"].showlegend is False and len(by_name["final"].x) == 0


def test_va_map_draws_an_empty_reservation_as_one_slack_band() -> None:
    arena = Arena(SimDriver("h200"), reserve_bytes=64 * MiB)
    fig = va_map(arena.snapshot())
    assert list(fig.layout.yaxis.ticktext) == ["slack"]
    assert "0 handles" in fig.layout.title.text
    assert len(fig.data[0].x) == 0


def test_va_map_switches_to_a_heatmap_past_the_threshold() -> None:
    arena = Arena(SimDriver("h200"), reserve_bytes=4 * GiB, name="many")
    offs = [arena.allocate(GiB // 4, f"b{i}") for i in range(8)]
    for step in range(1, 21):
        arena.commit_many([(o, step * 2 * MiB) for o in offs])
    snap = arena.snapshot()
    assert len(snap.mappings) == 160
    assert va_map(snap).layout.meta["mode"] == "bars"
    fig = va_map(snap, heatmap=True, bins=64)
    assert fig.layout.meta["mode"] == "heatmap" and fig.data[0].type == "heatmap"
    z = [list(row) for row in fig.data[0].z]
    width = fig.layout.meta["column_bytes"]  # columns across each row, from its own start
    a0 = snap.allocations[0]
    full_cols = a0.backed_bytes // width
    assert full_cols > 0 and all(v == 1 for v in z[0][:full_cols])  # backed prefix
    assert z[0][a0.size_bytes // width - 1] == 0  # unbacked tail of the allocation
    assert [t.name for t in fig.data][:len(VA_MAP_TRACES)] == list(VA_MAP_TRACES)


def test_the_heatmap_threshold_is_about_ten_thousand_mappings() -> None:
    assert HEATMAP_THRESHOLD == 10_000


def test_va_map_refuses_what_is_not_a_snapshot() -> None:
    with pytest.raises(ArgumentError, match="ArenaSnapshot or OwnerSnapshot"):
        va_map("not a snapshot")  # type: ignore[arg-type]


def test_timeline_follows_backed_bytes_and_lists_calls_by_kind() -> None:
    drv = kvvmm.TracingDriver(SimDriver("h200"))
    arena = Arena(drv, reserve_bytes=64 * MiB)
    off = arena.allocate(32 * MiB)
    arena.commit(off, 8 * MiB)
    arena.commit(off, 16 * MiB)
    arena.decommit(off, 8 * MiB)
    fig = timeline(drv.trace)
    backed = fig.data[0]
    unit = fig.layout.meta["unit_bytes"]
    assert round(max(backed.y) * unit) == 16 * MiB
    assert round(backed.y[-1] * unit) == 8 * MiB
    names = {t.name for t in fig.data}
    assert {"create", "map", "set_access", "unmap", "release", "reserve"} <= names
    assert fig.layout.meta["simulated"] is True
    assert list(timeline(drv.trace, x="seq").data[0].x) == list(range(len(drv.trace)))


def test_timeline_marks_failed_calls() -> None:
    faulty = kvvmm.FaultyDriver(SimDriver("h200"))
    drv = kvvmm.TracingDriver(faulty)
    arena = Arena(drv, reserve_bytes=64 * MiB)
    off = arena.allocate(32 * MiB)
    faulty.arm({"map": 1})
    with pytest.raises(kvvmm.DriverError):
        arena.commit(off, 8 * MiB)
    failed = next(t for t in timeline(drv.trace).data if t.name == "failed")
    assert len(failed.x) == 1 and "CUDA_ERROR_OUT_OF_MEMORY" in failed.hovertext[0]


def test_handle_sizes_counts_handles_per_size_and_per_label() -> None:
    snap = _arena_snapshot()
    fig = handle_sizes(snap)
    assert list(fig.data[0].x) == ["2.0 MiB", "4.0 MiB"] and list(fig.data[0].y) == [1, 1]
    fig2 = handle_sizes({"a": [2 * MiB] * 3, "b": [64 * MiB]})
    assert [t.name for t in fig2.data] == ["a", "b"]
    assert list(fig2.data[0].y) == [3, 0] and list(fig2.data[1].y) == [0, 1]
    with pytest.raises(ArgumentError):
        handle_sizes([0])


def test_the_bandwidth_table_is_the_h200_measurement_with_its_source() -> None:
    assert "H200" in H200_BANDWIDTH.source
    by = {p.label: p for p in H200_BANDWIDTH.points}
    assert by["vmm_2MiB"].runs_tb_s == (3.607, 3.618) and by["vmm_2MiB"].handle_bytes == 2 * MiB
    assert by["vmm_1handle"].handle_bytes == GiB and by["plain"].handle_bytes is None
    assert by["vmm_8MiB_interleaved"].interleaved
    fig = bandwidth_by_handle_size()
    assert fig.layout.meta["source"] == H200_BANDWIDTH.source
    assert list(fig.data[0].x) == ["2.0 MiB", "8.0 MiB", "64.0 MiB", "512.0 MiB", "1.0 GiB"]


def test_predicted_bandwidth_follows_the_table_by_handle_size() -> None:
    assert predicted_bandwidth_tb_s([2 * MiB] * 8) == pytest.approx(3.6125)
    # Interleaved: the curve fitted to the growth runs, pinned at 2 MiB by the table's
    # interleaved runs (3.492 and 3.491 TB/s).
    assert 3.491 <= predicted_bandwidth_tb_s([2 * MiB] * 8, interleaved=True) <= 3.492
    assert predicted_bandwidth_tb_s([64 * MiB]) == pytest.approx(4.189)
    assert predicted_bandwidth_tb_s([4 * GiB]) == pytest.approx(4.217)  # flat past the end
    mixed = predicted_bandwidth_tb_s([2 * MiB, 64 * MiB])
    assert 3.6125 < mixed < 4.189
    assert predicted_bandwidth_tb_s([]) == 0.0


def test_a_bandwidth_table_reads_device_bw_keys() -> None:
    t = BandwidthTable.from_mapping({"vmm_4MiB": [1.0, 3.0], "plain": [2.0]}, device="x",
                                    source="test")
    assert t.points[0].handle_bytes == 4 * MiB and t.points[0].tb_s == 2.0
    assert t.reference_tb_s() == 2.0
    with pytest.raises(ArgumentError):
        BandwidthTable.from_mapping({"vmm_xMiB": [1.0]}, device="x", source="test")


def test_describe_an_arena_prints_offsets_sizes_and_handles() -> None:
    text = describe(_arena_snapshot())
    assert text.splitlines() == [
        "arena 'a' on sim (NVIDIA H200), granularity 2.0 MiB",
        "reserved 100.0 MiB at base 0x7f0000000000, cursor 16.0 MiB, slack 84.0 MiB",
        "backed   6.0 MiB in 2 handles (6.0% of reserved), unbacked 94.0 MiB",
        "allocation                offsets      size  requested   backed  handles",
        "x                 [0x0, 0xa00000)  10.0 MiB   10.0 MiB  6.0 MiB        2",
        "y           [0xa00000, 0x1000000)   6.0 MiB    5.0 MiB      0 B        0",
    ]


def test_describe_an_owner_adds_tokens_and_per_buffer_spans() -> None:
    lines = describe(_owner_snapshot()).splitlines()
    assert lines[0] == "owner 'kv': 4 buffers, bfloat16, page 16 tokens, policy Exact()"
    assert lines[1] == "tokens: reserved 4,096, prefix 100, final 2,000"
    assert lines[5].split() == ["buffer", "offsets", "span", "backed", "handles", "slot", "0",
                                "prefix", "final"]
    assert lines[6].split() == ["k0", "[0x0,", "0xa00000)", "8.0", "MiB", "4.0", "MiB", "2",
                                "32.0", "KiB", "200.0", "KiB", "3.9", "MiB"]
    assert describe(_owner_snapshot(final=None)).splitlines()[6].endswith("-")


def test_describe_is_the_same_for_equal_snapshots() -> None:
    assert describe(_owner_snapshot()) == describe(_owner_snapshot())


def test_describe_stats_says_clean_or_what_is_held() -> None:
    drv = SimDriver("h200")
    assert describe_stats(drv.stats()).startswith("clean")
    arena = Arena(drv, reserve_bytes=8 * MiB)
    arena.commit(arena.allocate(2 * MiB), 2 * MiB)
    assert describe_stats(drv.stats()) == (
        "1 reservation (8.0 MiB), 1 handle, 1 mapping (2.0 MiB), physical 2.0 MiB")
    with pytest.raises(ArgumentError):
        describe_stats("stats")  # type: ignore[arg-type]
