"""kvvmm.viz at real-model and synthetic scale: the VA map stays readable from 1 to
1,000 buffers and 100,000 mappings, figures of plans draw, and figures save to files."""

from __future__ import annotations

import html
import time
from itertools import pairwise
from pathlib import Path

import pytest

pytest.importorskip("plotly")

import plotly.graph_objects as go

from kvvmm.driver import SimDriver
from kvvmm.errors import ArgumentError
from kvvmm.layout import load_model, model_descs, plan
from kvvmm.owner import KvBufferOwner
from kvvmm.snapshot import AllocationInfo, ArenaSnapshot, MappingInfo, OwnerSnapshot
from kvvmm.units import GiB, MiB
from kvvmm.viz import (
    MAX_ROWS,
    VA_MAP_GROUP_TRACES,
    VA_MAP_TRACES,
    bandwidth_by_handle_size,
    handles_by_policy,
    save_figure,
    tokens_by_tp,
    va_map,
    waste_by_model,
)
from kvvmm.viz.export import _browser

GRAN = 2 * MiB


@pytest.fixture(scope="module")
def llama70b_tp8() -> OwnerSnapshot:
    """llama-3.1-70b on one TP8 rank: 160 buffers (k0..k79, v0..v79), half backed."""
    descs = model_descs(load_model("llama-3.1-70b"), tp=8, reserved_tokens=1 << 20,
                        page_size=16, dtype="bfloat16")
    owner = KvBufferOwner(driver=SimDriver("h200"), dtype="bfloat16", page_size=16,
                          reserved_tokens=1 << 20, descs=descs)
    owner.ensure_prefix(300_000)
    return owner.snapshot()


def synthetic(buffers: int, handles_each: int, *, name: str = "kv{}") -> ArenaSnapshot:
    """An arena of ``buffers`` allocations alternately named k<i>/v<i>, each half backed by
    ``handles_each`` 2 MiB handles: built from the dataclasses, no driver (fast at 100k)."""
    allocs, maps = [], []
    off, hid, size = 0, 1, 2 * handles_each * GRAN
    for i in range(buffers):
        n = f"{'kv'[i % 2]}{i // 2}" if name == "kv{}" else name.format(i)
        maps += [MappingInfo(off + h * GRAN, GRAN, hid + h, n) for h in range(handles_each)]
        hid += handles_each
        allocs.append(AllocationInfo(n, off, size, size, handles_each * GRAN))
        off += size
    snap = ArenaSnapshot(name="synthetic", driver="sim", device_name="test", granularity=GRAN,
                         base=0x7F0000000000, reserved_bytes=off, cursor_bytes=off,
                         allocations=tuple(allocs), mappings=tuple(maps),
                         backed_bytes=len(maps) * GRAN, closed=False)
    snap.check()
    return snap


def test_the_real_model_map_labels_groups_not_160_overlapping_rows(
        llama70b_tp8: OwnerSnapshot) -> None:
    fig = va_map(llama70b_tp8)
    assert len(llama70b_tp8.buffers) == 160
    meta = fig.layout.meta
    assert meta["mode"] == "heatmap" and meta["groups"] == ["k", "v"]
    labels = list(fig.layout.yaxis.ticktext)
    assert len(labels) == 2 and labels[0].startswith("k0–k79")
    # Labels at least 14 px apart: what fits in the plot's height (the figure's height less
    # the margins, which hold the title above and the axis, legend and colour bar below).
    plot_px = fig.layout.meta["plot_px"]
    assert plot_px == fig.layout.height - fig.layout.margin.t - fig.layout.margin.b
    ticks = sorted(fig.layout.yaxis.tickvals)
    px_per_row = plot_px / 160
    assert all((b - a) * px_per_row >= 14 for a, b in pairwise(ticks))
    assert fig.layout.width is None and fig.layout.autosize  # fills its cell
    # Nothing at the top but the title: the legend and colour bar sit in the bottom margin.
    assert fig.layout.legend.yref == "container" and fig.layout.legend.y == 0
    bar = fig.data[0].colorbar
    assert bar.orientation == "h" and bar.yref == "container" and bar.y == 0
    # The summary's group labels have a right margin of their own; its backed fractions
    # stay inside its x range (never over the labels); a gap between the panels.
    assert fig.layout.margin.r >= 40
    assert fig.layout.xaxis2.range[1] > max(fig.data[-2].x)
    assert fig.layout.xaxis2.domain[0] - fig.layout.xaxis.domain[1] >= 0.05


def test_the_real_model_map_tells_backed_from_unbacked_by_colour_and_per_group(
        llama70b_tp8: OwnerSnapshot) -> None:
    fig = va_map(llama70b_tp8)
    heat = fig.data[0]
    z = [v for row in heat.z for v in row if v == v]  # NaN: past a row's end
    assert 0.0 in z and 1.0 in z  # both backed and unbacked cells
    low, high = heat.colorscale[0][1], heat.colorscale[-1][1]
    assert low != high
    assert list(heat.colorbar.ticktext) == ["unbacked", "50%", "backed"]
    names = [t.name for t in fig.data]
    assert names == [*VA_MAP_TRACES, *VA_MAP_GROUP_TRACES]
    reserved, backed = fig.data[-2], fig.data[-1]
    assert reserved.marker.color != backed.marker.color
    for group, text in zip("kv", backed.text, strict=True):  # a backed fraction per group
        bs = [b for b in llama70b_tp8.buffers if b.name.startswith(group)]
        pct = 100 * sum(b.backed_bytes for b in bs) / sum(b.aligned_bytes for b in bs)
        assert text == f"{pct:.0f}%"


def test_the_real_model_map_hover_gives_half_open_ranges(llama70b_tp8: OwnerSnapshot) -> None:
    fig = va_map(llama70b_tp8)
    first = fig.data[0].text[0][0]
    b = llama70b_tp8.buffers[0]
    base = llama70b_tp8.arena.base
    assert f"[{base + b.offset:#x}, " in first and ")" in first and "MiB" in first


def test_a_drill_down_draws_one_buffers_handles_as_bars(llama70b_tp8: OwnerSnapshot) -> None:
    fig = va_map(llama70b_tp8, buffer="k3")
    assert fig.layout.meta["mode"] == "buffer" and fig.layout.meta["rows"] == ["k3"]
    mine = [m for m in llama70b_tp8.arena.mappings if m.allocation == "k3"]
    assert len(fig.data[0].x) == len(mine) and set(fig.data[0].y) == {0}
    assert all("k3: handle #" in h for h in fig.data[0].hovertext)
    assert f"{len(mine)} handles" in fig.layout.title.text
    with pytest.raises(ArgumentError, match="buffer"):
        va_map(llama70b_tp8, buffer="nope")


def test_grouping_by_layer_orders_rows_k_then_v_per_layer(llama70b_tp8: OwnerSnapshot) -> None:
    fig = va_map(llama70b_tp8, group_by="layer")
    assert fig.layout.meta["rows"][:4] == ["k0", "v0", "k1", "v1"]
    assert len(fig.layout.meta["groups"]) == 80
    assert len(fig.layout.yaxis.ticktext) < 80  # thinned to what fits
    assert va_map(llama70b_tp8, group_by=lambda n: n[0]).layout.meta["groups"] == ["k", "v"]


def test_up_to_max_rows_buffers_draw_as_labelled_bars_from_each_start() -> None:
    snap = synthetic(MAX_ROWS, 5)
    fig = va_map(snap)
    assert fig.layout.meta["mode"] == "bars" and fig.layout.meta["align"] == "start"
    assert len(fig.layout.yaxis.ticktext) == MAX_ROWS  # arena-aligned would add slack
    assert fig.data[0].marker.colorscale[0][1] != fig.data[1].marker.color
    assert va_map(synthetic(MAX_ROWS + 1, 1)).layout.meta["mode"] == "heatmap"


def test_one_buffer_draws_as_one_band_at_its_arena_offset() -> None:
    fig = va_map(synthetic(1, 1))
    assert fig.layout.meta["mode"] == "bars" and fig.layout.meta["align"] == "arena"
    assert fig.layout.title.text.endswith("1 handle")  # never "1 handles"


def test_a_thousand_buffers_and_a_hundred_thousand_mappings_draw_fast() -> None:
    for buffers, each in ((1000, 10), (1000, 100), (40, 250)):
        snap = synthetic(buffers, each)
        t0 = time.perf_counter()
        fig = va_map(snap)
        took = time.perf_counter() - t0
        assert isinstance(fig, go.Figure)
        assert took < 1.5, (buffers, each, took)  # bench/viz/bench_viz.py holds the real target
    assert fig.layout.meta["mode"] == "bars"  # 40 x 250 = 10k mappings: still bars


def test_names_that_reach_html_are_escaped() -> None:
    snap = synthetic(3, 1, name="<b>x{}</b>")
    fig = va_map(snap)
    assert all("<b>x" not in h for h in fig.data[0].hovertext)
    assert html.escape("<b>x0</b>") in fig.data[0].hovertext[0]
    heat = va_map(snap, view="heatmap")
    assert "&lt;b&gt;x0" in heat.data[0].text[0][0]


def test_the_bandwidth_axis_starts_at_zero() -> None:
    fig = bandwidth_by_handle_size()
    assert fig.layout.yaxis.range[0] == 0
    assert all(t.endswith("×") for t in fig.data[0].text)  # ratio to cudaMalloc


def test_plan_figures_draw_tokens_waste_and_handles() -> None:
    tps = [plan(gpu="h200", model="llama-3.1-8b", tp=t) for t in (1, 2, 4, 8)]
    fig = tokens_by_tp(tps)
    assert list(fig.data[0].x) == ["TP 1", "TP 2", "TP 4", "TP 8"]
    assert list(fig.data[0].y) == [p.tokens for p in tps]
    models = [plan(gpu="h200", model=m, budget_bytes=40 * GiB)
              for m in ("llama-3.1-8b", "llama-3.1-70b")]
    waste = waste_by_model(models)
    unit = waste.layout.meta["unit_bytes"]
    assert [round(v * unit) for v in waste.data[0].y] == [
        p.granularity_waste_bytes for p in models]
    assert waste.layout.xaxis.tickangle == 0  # never rotated (and clipped)
    tp_models = [plan(gpu="h200", model=m, budget_bytes=40 * GiB, tp=t)
                 for m, t in (("llama-3.1-8b", 1), ("llama-3.1-70b", 2))]
    assert list(waste_by_model(tp_models).data[0].x) == ["llama-3.1-8b<br>TP1",
                                                         "llama-3.1-70b<br>TP2"]
    hs = handles_by_policy(models[0])
    assert [t.name for t in hs.data] == [h.policy for h in models[0].handles]
    with pytest.raises(ArgumentError):
        tokens_by_tp([])


def test_a_figure_saves_to_html_offline(tmp_path: Path) -> None:
    out = save_figure(va_map(synthetic(2, 1)), tmp_path / "map")
    assert out.suffix == ".html"
    text = out.read_text()
    assert "plotly" in text and "<script" in text and len(text) > 1_000_000  # plotly.js inside
    with pytest.raises(ArgumentError, match="ending in"):
        save_figure(go.Figure(), tmp_path / "map.jpgx")


def test_a_figure_saves_to_png_through_kaleido_and_chromium(tmp_path: Path) -> None:
    pytest.importorskip("kaleido", reason="kaleido not installed (pip install 'kaleido>=1.0')")
    if _browser() is None:
        pytest.skip("no Chrome/Chromium for kaleido (apt-get install chromium)")
    out = save_figure(va_map(synthetic(2, 1)), tmp_path / "map.png", width=640)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
