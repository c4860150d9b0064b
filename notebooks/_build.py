"""Write, run and clean the notebooks: the one way to change them and keep nbval green.

    .venv/bin/python notebooks/_build.py              # all five
    .venv/bin/python notebooks/_build.py 03_growth    # one

Each notebook is defined below as cells; this script writes it with nbformat, runs it with
nbclient in this Python (on the sim driver: ``KVVMM_DRIVER`` is removed from the
environment; notebook 05 picks CUDA or the host driver itself), strips it with ``_clean.py``
(no widget state, figures and widgets reduced to a text note) and saves it with its outputs
and execution counts, which nbval then compares. Edit the cells here, not in JupyterLab:
a notebook saved from JupyterLab carries widget state (``_clean.py`` strips it).

Tags: ``nbval-ignore-output`` on cells whose output is a figure, a widget or a fact of the
machine; every other cell's output is compared exactly (after ``sanitize.cfg``).
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _clean import clean  # noqa: E402  (a sibling script, not a package)

IGNORE = ["nbval-ignore-output"]


def md(text: str) -> Any:
    return nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip())


def code(src: str, tags: list[str] | None = None) -> Any:
    cell = nbformat.v4.new_code_cell(textwrap.dedent(src).strip())
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


SETUP = """
    import os
    from collections import Counter

    import kvvmm
    from kvvmm.units import GiB, MiB, fmt_bytes
    from kvvmm.viz import describe, describe_stats, va_map

    # `kvvmm lab` sets KVVMM_DRIVER (cuda on a GPU machine). Without it, and under nbval,
    # the notebooks run on the simulator, whose addresses and costs are deterministic.
    DRIVER = os.environ.get("KVVMM_DRIVER", "sim")


    def open_driver():
        \"\"\"A fresh driver of the chosen kind (the sim one simulates an H200).\"\"\"
        return kvvmm.open_driver(DRIVER, **({"profile": "h200"} if DRIVER == "sim" else {}))
"""

# -- 01 tour --------------------------------------------------------------------------------

TOUR = [
    md("""
    # 01 · A tour: reserve once, back later

    An LLM server keeps every token's keys and values (the **KV cache**) in a few large
    tensors, one or two per layer. Two constraints pull against each other:

    - **CUDA graphs** are captured once, early, and bake the tensors' *addresses* into the
      graph. The KV tensors must exist, at their final addresses, before capture.
    - The KV cache should take **whatever memory is left after capture** (weights,
      activations and the graphs themselves come first), and that is only known afterwards.

    With `cudaMalloc` you must pick the size before capture. CUDA's **virtual memory
    management** (VMM) splits an allocation in two: **reserve** a range of virtual addresses
    (VA, free: no memory behind it), then **create** physical *handles* and **map** them into
    the range as needed. So the KV tensors can be created at their upper-bound shape, graphs
    captured against them, and memory **backed** later, only as much as the budget allows
    (SGLang does exactly this). kvvmm is that idea as a library, and this notebook walks
    through it, drawing the VA map after each step.

    | word | meaning |
    |---|---|
    | reserve / free | take / give back a VA range (no memory) |
    | granularity | the driver's allocation unit (2 MiB on H100/H200) |
    | create / release, map / unmap | make / drop a physical handle; attach / detach it at a VA |
    | commit / decommit | create + map + set access / unmap + release |
    | backed | committed, physically present |

    Every code cell can be changed and re-run. Cells that draw figures or widgets are not
    compared by the tests; the printed summaries are.
    """),
    code(SETUP + """

    drv = kvvmm.TracingDriver(open_driver())  # records every driver call
    free_bytes, total_bytes = drv.mem_info()
    print(f"{drv.kind} driver on {drv.name}: granularity {fmt_bytes(drv.granularity())}, "
          f"{fmt_bytes(free_bytes)} free of {fmt_bytes(total_bytes)}")
    """),
    md("""
    ## 1. Describe the KV buffers

    A `KvBufferDesc` is one buffer: an upper-bound tensor whose leading dimension counts
    token rows. `mha_token_major` builds SGLang's layout: one K and one V buffer per layer,
    each `(reserved_tokens + page_size, kv_heads, head_dim)`. The extra page absorbs the dummy
    writes CUDA-graph capture sends to slot 0.
    """),
    code("""
    LAYERS, KV_HEADS, HEAD_DIM = 4, 8, 128  # a small Llama-like model: change them
    RESERVED_TOKENS, PAGE = 65_536, 16
    descs = kvvmm.mha_token_major(layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                  reserved_tokens=RESERVED_TOKENS, page_size=PAGE,
                                  dtype="bfloat16")
    print(descs[0])
    print(f"{len(descs)} buffers, each {fmt_bytes(descs[0].reserved_span_bytes(2))} at the "
          f"upper bound, {fmt_bytes(descs[0].row_bytes)} per token")
    """),
    md("""
    ## 2. Reserve, make the tensors, back slot 0

    `KvBufferOwner` does the pre-capture part in one go: it **reserves** one VA range for all
    buffers (each rounded up to the granularity), makes a tensor over each buffer's range,
    and **backs one page** of each (slot 0). Nothing else has memory yet.
    """),
    code("""
    owner = kvvmm.KvBufferOwner(driver=drv, dtype="bfloat16", page_size=PAGE,
                                reserved_tokens=RESERVED_TOKENS, descs=descs,
                                policy=kvvmm.Chunked(64 * MiB))
    print(describe(owner.snapshot()))
    """),
    md("""
    The map: one band per buffer across its reserved span. Green is backed (one shade per
    handle), grey unbacked, light orange the granularity padding past the tensor's bytes;
    the markers are the end of slot 0's page, the prefix, and (later) the final span. Hover
    for exact `[start, end)` addresses.
    """),
    code("va_map(owner.snapshot())", IGNORE),
    md("""
    ## 3. The tensors

    The tensors already have their full shape. On the simulator they are `meta` tensors
    (shape and dtype, no memory); on the host driver they alias host memory, on CUDA device
    memory, with no copy and no compiled extension. Their addresses are fixed for life.
    """),
    code("""
    for d, t in list(zip(descs, owner.tensors))[:3]:
        print(f"{d.name}: shape {tuple(t.shape)}, {t.dtype}, on {t.device.type}")
    snap = owner.snapshot()
    pointers = {b.name: snap.arena.base + b.offset for b in snap.buffers}
    print("offsets from the arena base:",
          ", ".join(f"{b.name} +{fmt_bytes(b.offset)}" for b in snap.buffers[:4]), "...")
    """),
    md("""
    ## 4. Capture

    On a GPU, this is where the server captures its CUDA graphs against `owner.tensors`.
    During capture every dummy KV write goes to slot 0, which is why slot 0's page is backed
    already; everything else may stay unbacked. The graph records the pointers above.

    The simulator has no GPU and so no capture: we only keep the pointers the graph would
    have baked in, and check at the end that nothing moved. (`05_gpu.ipynb` writes to the
    tensors over real memory.)
    """),
    code("""
    captured = dict(pointers)  # what a captured graph would hold
    slot0 = snap.buffers[0]
    print(f"slot 0 of each buffer: {fmt_bytes(slot0.page0_bytes)} of data, backed by a "
          f"{fmt_bytes(slot0.backed_bytes)} handle (the granularity)")
    """),
    md("""
    ## 5. Finalize: back what the budget allows

    After capture the server reads free memory and sizes the KV cache. `finalize(n)` backs
    each buffer's final span for `n` tokens (plus the padded page), exactly, with one handle
    per buffer.
    """),
    code("""
    budget_bytes = 512 * MiB  # say 512 MiB are left for KV after weights, activations, graphs
    bytes_per_token = sum(d.row_bytes for d in descs)  # token-major: one row per token
    capacity = budget_bytes // bytes_per_token // PAGE * PAGE
    print(f"{fmt_bytes(bytes_per_token)} per token -> capacity {capacity:,} tokens")
    owner.finalize(capacity)
    print(describe(owner.snapshot()))
    """),
    code("va_map(owner.snapshot())", IGNORE),
    md("""
    ## 6. Grow on demand, give back

    `ensure_prefix(n)` backs the first `n` token slots when they are needed; the growth
    policy (`Chunked(64 MiB)` here) decides the handle size. `shrink(n)` gives back whole
    mappings beyond `n` tokens: a handle that straddles the boundary stays, because maps are
    whole handles.
    """),
    code("""
    owner.ensure_prefix(40_000)
    print("after ensure_prefix(40_000):", fmt_bytes(owner.backed_bytes), "backed")
    owner.shrink(16_384)
    print("after shrink(16_384):      ", fmt_bytes(owner.backed_bytes), "backed")
    print(describe(owner.snapshot()))
    """),
    code("va_map(owner.snapshot())", IGNORE),
    md("""
    ## 7. What the driver did

    Every call went through the `TracingDriver`. On the simulator each call also advances a
    clock by the cost measured for it on an H200. A trace saves to JSON; `kvvmm map
    trace.json -o map.html` draws it anywhere.
    """),
    code("""
    calls = Counter(e.op for e in drv.trace.driver_calls())
    print(", ".join(f"{op} {n}" for op, n in sorted(calls.items())))
    if DRIVER == "sim":
        print(f"simulated driver time: {drv.clock_us / 1000:.3f} ms")
    """),
    code("""
    from kvvmm.viz import timeline

    timeline(drv.trace)
    """, IGNORE),
    md("""
    ## 8. Your turn: the arena lab

    The panel below drives the same library: **Reserve KV** makes an owner like the one
    above, the token slider with **Ensure prefix / Finalize / Shrink** backs and gives back,
    **Reserve** + **Allocate** + **Commit** work on a bare arena. Bad values show an error
    and change nothing. The cell after it clicks the buttons from code.
    """),
    code("""
    from kvvmm.lab import ArenaLab

    lab = ArenaLab(driver=DRIVER, layers=2, reserved_tokens=8192)
    lab
    """, IGNORE),
    code("""
    lab.reserve_kv_button.click()
    lab.tokens.value = 4096
    lab.finalize_button.click()
    print(lab.error_text or "finalize(4096): ok")
    lab.tokens.value = 8  # below one page: refused, nothing changes
    lab.finalize_button.click()
    print(lab.error_text)
    print(describe(lab.snapshot()))
    """),
    md("""
    ## 9. Close

    `close()` unmaps, frees the reservation and releases the handles; the driver then holds
    nothing. (If a tensor were still alive, the arena would wait for it: see `05_gpu`.)
    """),
    code("""
    owner.close()
    lab.close_button.click()
    print(describe_stats(drv.stats()))
    """),
    code("""
    # The tour's claims, checked.
    final = owner.snapshot()
    assert final.arena.closed and final.backed_bytes == 0
    assert drv.stats().clean, drv.stats()
    assert {b.name: final.arena.base + b.offset for b in final.buffers} == captured
    assert calls["create"] == calls["map"] == calls["set_access"]
    assert lab.owner is None and lab.last_error is None
    """),
]

# -- 02 layouts -----------------------------------------------------------------------------

LAYOUTS = [
    md("""
    # 02 · Layouts and capacity

    What an owner lays out depends on the model's attention geometry, the KV dtype, the page
    size and tensor parallelism (TP). This notebook goes from model configs to buffers to a
    capacity plan: how many tokens fit a GPU, how much VA to reserve, and what the
    granularity wastes. Everything here is arithmetic: no driver is needed.
    """),
    code(SETUP + """

    from kvvmm.layout import (kv_bytes_per_token, list_models, load_model, mha_token_major,
                              page_major)
    from kvvmm.plan import format_plan, plan
    """),
    md("""
    ## Model configs

    kvvmm ships a few public models' attention fields (from their Hugging Face configs). KV
    bytes per token: `2 (K and V) x layers x kv_heads x head_dim x itemsize` for MHA/GQA;
    MLA models (DeepSeek) keep one latent of `kv_lora_rank + qk_rope_head_dim` per layer.
    Sliding-window layers (gpt-oss, Gemma 3) go to a second, window-sized pool.
    """),
    code("""
    print(f"{'model':<15}{'layers':>7}{'kv heads':>9}{'head dim':>9}  {'kind':<10}"
          f"{'bf16 / token':>13}")
    for key in list_models():
        m = load_model(key)
        kind = "MLA" if m.is_mla else f"SWA {len(m.sliding_layers)}" if m.is_hybrid_swa else "GQA"
        print(f"{key:<15}{m.num_layers:>7}{m.num_kv_heads:>9}{m.head_dim:>9}  {kind:<10}"
              f"{fmt_bytes(kv_bytes_per_token(m, 'bfloat16')):>13}")
    """),
    md("""
    ## Spans: token-major and page-major

    A buffer's **prefix span** for `n` tokens is what must be backed to use the first `n`
    slots; its **final span** adds the padded page. Token-major buffers have one row per
    token; page-major (HND, as paged kernels read it) one row per page, so spans move in
    whole pages.
    """),
    code("""
    tm = mha_token_major(layers=1, kv_heads=8, head_dim=128, reserved_tokens=1024,
                         page_size=16, dtype="bfloat16")[0]
    pm = page_major(layers=1, kv_heads=8, head_dim=128, reserved_tokens=1024, page_size=16,
                    dtype="bfloat16")[0]
    for d in (tm, pm):
        print(f"{d.name} shape {d.shape}: row {fmt_bytes(d.row_bytes)} holds "
              f"{d.tokens_per_row} tokens; prefix(17) {d.prefix_span_bytes(17, 16):,} B, "
              f"final(17) {d.final_span_bytes(17, 16):,} B")
    """),
    md("""
    ## A plan

    `plan()` sizes the pool as SGLang does after capture: budget = free - headroom + backed,
    tokens = budget // bytes per token, in whole pages. It then reports the VA to reserve,
    what finalize backs, and how many handles each growth policy creates on the way.
    """),
    code("""
    p = plan(gpu="h200", model="llama-3.1-8b", dtype="bfloat16", page_size=16, tp=1)
    print(format_plan(p))
    """),
    md("""
    ## Tensor parallelism

    TP shards the KV heads: each rank stores `kv_heads / tp` heads, so the same GPU holds
    more tokens per rank. Past `tp = kv_heads` heads are replicated, and the gain stops.
    """),
    code("""
    for tp in (1, 2, 4, 8, 16):
        q = plan(gpu="h200", model="llama-3.1-70b", tp=tp)
        print(f"llama-3.1-70b tp {tp:>2}: {fmt_bytes(q.bytes_per_token):>9} per token per "
              f"rank -> {q.tokens:>9,} tokens, VA {fmt_bytes(q.va_reserve_bytes)}")
    """),
    md("""
    ## Every model on two GPUs, and the granularity's cost

    The granularity (2 MiB) rounds each buffer's backing up: a model with many small
    buffers wastes up to 2 MiB per buffer. The padded page costs one page per buffer.
    """),
    code("""
    for gpu in ("h200", "b200"):
        for key in list_models():
            q = plan(gpu=gpu, model=key, dtype="bfloat16")
            print(f"{gpu} {key:<14} {q.tokens:>10,} tokens in {q.num_buffers:>3} buffers, "
                  f"waste {fmt_bytes(q.granularity_waste_bytes):>9}, "
                  f"padding {fmt_bytes(q.padding_bytes):>9}")
    """),
    code("""
    for page in (1, 16, 64):
        q = plan(gpu="h200", model="mistral-7b", page_size=page, budget_bytes=40 * GiB)
        print(f"page {page:>2}: {q.tokens:,} tokens, padding {fmt_bytes(q.padding_bytes)}, "
              f"granularity waste {fmt_bytes(q.granularity_waste_bytes)}, "
              f"over budget {fmt_bytes(q.over_budget_bytes)}")
    """),
    md("""
    ## Explore

    The panel re-plans on every change and draws the finalized full-attention pool on the
    simulator of the chosen GPU. The cell after it sets the controls from code.
    """),
    code("""
    from kvvmm.lab import LayoutExplorer

    explorer = LayoutExplorer(model="llama-3.1-8b", gpu="h200")
    explorer
    """, IGNORE),
    code("""
    explorer.model.value = "deepseek-v3"
    explorer.tp.value = 8  # MLA: the latent is not sharded, every rank keeps it whole
    print("\\n".join(explorer.text.splitlines()[:7]))
    explorer.tp.value = 3  # refused for GQA models whose heads do not split; MLA ignores tp
    explorer.model.value = "llama-3.1-8b"
    print(explorer.error_text)
    """),
    code("""
    # The planner's invariants, checked on every shipped model.
    for key in list_models():
        q = plan(gpu="h200", model=key)
        full = q.pools[0]
        assert full.tokens % q.page_size == 0
        assert full.tokens * full.bytes_per_token <= full.budget_bytes
        assert full.budget_bytes < (full.tokens + q.page_size) * full.bytes_per_token
        assert q.va_reserve_bytes >= q.final_backed_bytes
        assert q.va_reserve_bytes % q.granularity_bytes == 0
    assert explorer.last_error is not None and explorer.plan.model == "deepseek-v3"
    """),
]

# -- 03 growth ------------------------------------------------------------------------------

GROWTH = [
    md("""
    # 03 · Growth policies and bandwidth

    When a KV buffer grows during decoding, each extension is a new handle. How big the
    handles are matters on a GPU: copying a 1 GiB tensor on an H200 ran at 4.22 TB/s over
    one handle but 3.61 TB/s over 2 MiB handles, and 3.49 when those handles were created
    interleaved with other buffers' handles, which is what growing many buffers step by
    step does. The seed implementation (one small handle per extension) left its KV tensors
    at 0.87x of `cudaMalloc` bandwidth.

    A **growth policy** trades handles for over-commit (memory backed before it is needed):
    `Exact()` backs exactly what is needed, `Chunked(min_bytes)` at least a chunk,
    `Geometric(factor, max_bytes)` a multiple of what is backed, capped.
    """),
    code(SETUP + """

    from kvvmm.lab import decode_growth, format_growth
    from kvvmm.policy import simulate_growth
    from kvvmm.viz import H200_BANDWIDTH, predicted_bandwidth_tb_s
    """),
    md("## The measurements"),
    code("""
    print(H200_BANDWIDTH.source)
    for pt in H200_BANDWIDTH.points:
        size = fmt_bytes(pt.handle_bytes) if pt.handle_bytes else "-"
        print(f"  {pt.label:<26} handle {size:>9}  {pt.tb_s:.3f} TB/s")
    """),
    code("""
    from kvvmm.viz import bandwidth_by_handle_size

    bandwidth_by_handle_size()
    """, IGNORE),
    md("""
    ## One buffer, three policies (pure simulation)

    `simulate_growth` replays a policy on a list of byte counts the buffer must reach. Here
    one Llama-8B K buffer (2 KiB per token) grows to 32k tokens, 256 tokens per step.
    """),
    code("""
    POLICIES = [kvvmm.Exact(), kvvmm.Chunked(64 * MiB), kvvmm.Geometric(2.0, 256 * MiB)]
    needs = [n * 2048 for n in range(256, 32_768 + 1, 256)]
    for policy in POLICIES:
        handles = simulate_growth(policy, needs, limit_bytes=66 * MiB, gran=2 * MiB)
        print(f"{policy!s:<24} {len(handles):>3} handle{'s' if len(handles) != 1 else ' '}: "
              + ", ".join(fmt_bytes(h) for h in handles[:6]) + (" ..." if len(handles) > 6 else ""))
    """),
    md("""
    ## Many buffers on a driver

    `decode_growth` runs the real thing: for each policy a fresh owner on the chosen driver
    grows all buffers of the first layers of a model, step by step, and every driver call is
    counted. The bandwidth column is *predicted* from the handle sizes with the H200 table
    (interleaved, since many buffers grow together), not measured: `kvvmm bench` measures.
    """),
    code("""
    results = decode_growth(POLICIES, driver=DRIVER, model="llama-3.1-8b", layers=8,
                            tokens=32_768, step_tokens=256)
    print(format_growth(results))
    """),
    code("""
    from kvvmm.viz import handle_sizes

    handle_sizes({r.policy: list(r.handle_bytes) for r in results})
    """, IGNORE),
    md("""
    ## Reading the table

    - `Exact()` makes a 2 MiB handle every 1024 tokens per buffer: the most driver calls,
      the least over-commit, and the seed's bandwidth penalty.
    - `Chunked(64 MiB)` (the owner's default) makes 64 MiB handles: predicted at the
      bandwidth of `cudaMalloc`, with at most one chunk over-committed per buffer.
    - `Geometric` starts small and doubles: few handles early, bounded over-commit late.

    `finalize` always backs exactly (the size is known, over-commit buys nothing), so
    policies only matter for on-demand growth.

    ## Explore

    Change the workload and policies and press **Run**.
    """),
    code("""
    from kvvmm.lab import GrowthLab

    growth_lab = GrowthLab(driver=DRIVER, layers=4, tokens=16_384)
    growth_lab.run()
    growth_lab
    """, IGNORE),
    code("""
    growth_lab.chunk_mib.value = 0  # not a chunk size: the error shows, results stay
    print(growth_lab.run(), growth_lab.error_text)
    print(len(growth_lab.results), "results kept")
    """),
    code("""
    exact, chunked, geometric = results
    malloc = H200_BANDWIDTH.reference_tb_s("plain")
    assert exact.handles > geometric.handles > chunked.handles
    assert exact.max_over_commit_bytes < chunked.max_over_commit_bytes
    assert all(r.backed_bytes >= r.needed_bytes for r in results)
    assert chunked.predicted_tb_s / malloc > 0.98 > 0.9 > exact.predicted_tb_s / malloc
    assert predicted_bandwidth_tb_s([64 * MiB]) > predicted_bandwidth_tb_s([2 * MiB])
    assert growth_lab.last_error is not None and len(growth_lab.results) == 3
    """),
]

# -- 04 failures ----------------------------------------------------------------------------

FAILURES = [
    md("""
    # 04 · Failures: fault injection, bad input, recovery

    Every multi-step change in kvvmm is a **transaction**: if any driver call fails, the
    calls before it are undone, nothing leaks, the snapshot is as it was, and the error is
    re-raised (with any failure of the undo attached as a note). Bad input is refused before
    any driver call. This notebook proves both with `FaultyDriver`, which fails chosen calls
    with chosen CUDA errors, and shows how to recover.
    """),
    code(SETUP + """

    from kvvmm.driver import Fault, FaultyDriver

    descs = kvvmm.mha_token_major(layers=2, kv_heads=8, head_dim=128, reserved_tokens=16_384,
                                  page_size=16, dtype="bfloat16")


    def make_owner(driver, policy=None):
        return kvvmm.KvBufferOwner(driver=driver, dtype="bfloat16", page_size=16,
                                   reserved_tokens=16_384, descs=descs,
                                   policy=policy or kvvmm.Exact())


    def show(e):
        print(f"{type(e).__name__}: {e}")
        for note in getattr(e, "__notes__", []):
            print("  note:", note)
    """),
    md("""
    ## A failure during construction

    The owner backs slot 0 of its 4 buffers while it is constructed: 4 creates. Make the
    3rd one run out of memory: construction fails, and the two handles already made, the
    tensors and the reservation are all given back.
    """),
    code("""
    faulty = FaultyDriver(open_driver(), fail={"create": 3})
    try:
        make_owner(faulty)
    except kvvmm.DriverError as e:
        show(e)
    print("calls:", " ".join(faulty.calls))
    print("driver holds:", describe_stats(faulty.stats()))
    """),
    md("""
    ## A failure while growing

    With the fault spent, construction works. Now fail the 2nd `map` of the next growth:
    `ensure_prefix` had created and mapped the first buffer's extension, so it unmaps and
    releases it again. The snapshot is exactly as before.
    """),
    code("""
    owner = make_owner(faulty)
    before = owner.snapshot()
    faulty.arm(Fault(call="map", nth=2, error="CUDA_ERROR_UNKNOWN"))
    try:
        owner.ensure_prefix(4096)
    except kvvmm.DriverError as e:
        show(e)
    print("snapshot unchanged:", owner.snapshot() == before)
    print(describe(owner.snapshot()))
    """),
    md("""
    ## Every position, every kind of call

    A small fault matrix: fail the n-th `create`, `map` or `set_access` of a 4-buffer
    growth and check that the snapshot and the driver's own accounting are unchanged.
    (`tests/` runs the full matrix on every operation.)
    """),
    code("""
    rows = []
    for call in ("create", "map", "set_access"):
        for nth in (1, 2, 4):
            faulty.disarm()
            faulty.arm(Fault(call=call, nth=nth, error="CUDA_ERROR_UNKNOWN"))
            snap0, stats0 = owner.snapshot(), faulty.stats()
            try:
                owner.ensure_prefix(8192)
                outcome = "no failure"
            except kvvmm.DriverError as e:
                outcome = e.cuda_error
            same = owner.snapshot() == snap0 and faulty.stats() == stats0
            rows.append(same)
            print(f"{call:<10} #{nth}: {outcome:<20} unchanged: {same}")
    faulty.disarm()
    """),
    md("""
    ## Bad input

    Wrong values are refused before any driver call, with a message that names the value,
    the limit and often the fix. kvvmm never clamps.
    """),
    code("""
    calls_before = len(faulty.calls)
    for attempt in (lambda: owner.finalize(10**9),
                    lambda: owner.ensure_prefix(-1),
                    lambda: owner.shrink(8),
                    lambda: make_owner(faulty, policy=kvvmm.Chunked(0)),
                    lambda: kvvmm.KvBufferOwner(driver=faulty, dtype="int4", page_size=16,
                                                reserved_tokens=1024, descs=descs)):
        try:
            attempt()
        except (kvvmm.KvvmmError, ValueError) as e:
            show(e)
    print("driver calls made by the bad input:", len(faulty.calls) - calls_before)
    """),
    md("""
    ## Out of memory, and recovering from it

    A simulated GPU with 64 MiB free: finalizing 16k tokens needs more, so `create` fails
    with `CUDA_ERROR_OUT_OF_MEMORY` and everything is undone. Finalizing to what fits works.
    """),
    code("""
    small = kvvmm.SimDriver("h200", capacity_bytes=64 * MiB)
    tight = make_owner(small)
    try:
        tight.finalize(16_384)
    except kvvmm.DriverOutOfMemoryError as e:
        show(e)
    print(describe_stats(small.stats()))
    free, _ = small.mem_info()
    fits = (free // (4 * 2048)) // 16 * 16 - 16  # per token: 4 buffers x 2 KiB; keep a page
    print(f"{fmt_bytes(free)} free -> finalize({fits})")
    tight.finalize(fits)
    print(describe(tight.snapshot()))
    tight.close()
    """),
    md("""
    ## The lab shows errors too

    An `ArenaLab` on a faulty driver: the failure appears in the panel, and the map and the
    summary stay as they were.
    """),
    code("""
    from kvvmm.lab import ArenaLab

    lab_driver = FaultyDriver(kvvmm.SimDriver("h200"))
    lab = ArenaLab(driver=lab_driver, layers=2, reserved_tokens=8192)
    lab.reserve_kv_button.click()
    lab_driver.arm(Fault(call="set_access", nth=1, error="CUDA_ERROR_UNKNOWN"))
    lab.tokens.value = 4096
    lab.finalize_button.click()
    lab
    """, IGNORE),
    code("""
    print(lab.error_text)
    print(describe(lab.snapshot()))
    lab_driver.disarm()
    lab.finalize_button.click()  # recovery: the same click works once the fault is gone
    print(lab.error_text or "finalize(4096): ok,", fmt_bytes(lab.snapshot().backed_bytes),
          "backed")
    """),
    code("""
    owner.finalize(8192)
    owner.close()
    lab.close_button.click()
    print(describe_stats(faulty.stats()), "|", describe_stats(lab_driver.stats()))
    """),
    code("""
    assert all(rows), rows
    assert faulty.stats().clean and small.stats().clean and lab_driver.stats().clean
    assert len(faulty.injected) >= 8
    assert lab.last_error is None
    """),
]

# -- 05 gpu ---------------------------------------------------------------------------------

GPU = [
    md("""
    # 05 · Real memory: CUDA, or the host driver

    The other notebooks run on the simulator. This one uses real memory: the CUDA driver
    when a GPU is usable (`open_driver("auto")`), otherwise the **host driver**, which
    implements the same calls over Linux host memory (`mmap` reservations, `memfd` handles)
    so that touching unbacked VA faults just as it does on a GPU.

    Cells that print facts of the machine (device name, addresses, free memory) are tagged
    so that nbval does not compare them; the others print what holds on any driver.
    """),
    code("""
    import os

    import kvvmm
    from kvvmm.units import MiB, fmt_bytes
    from kvvmm.viz import describe, describe_stats, va_map

    # This notebook wants real memory: "sim" (the tests' default) becomes "auto" here.
    kind = os.environ.get("KVVMM_DRIVER", "auto")
    drv = kvvmm.open_driver("auto" if kind == "sim" else kind)
    print(drv.kind, "driver on", drv.name, "granularity", fmt_bytes(drv.granularity()))
    free_bytes, total_bytes = drv.mem_info()
    print(f"{fmt_bytes(free_bytes)} free of {fmt_bytes(total_bytes)}")
    """, IGNORE),
    md("""
    ## An owner over real memory

    Two layers, 4096 tokens. Slot 0 is backed at construction, so writing token 0 works at
    once.
    """),
    code("""
    descs = kvvmm.mha_token_major(layers=2, kv_heads=8, head_dim=128, reserved_tokens=4096,
                                  page_size=16, dtype="bfloat16")
    owner = kvvmm.KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16,
                                reserved_tokens=4096, descs=descs)
    k0 = owner.tensors[0]
    k0[0].fill_(1.5)
    print(f"k0 {tuple(k0.shape)} {k0.dtype}: token 0 sums to {float(k0[0].float().sum())}")
    print(f"{len(owner.tensors)} buffers, {owner.snapshot().handles} handles, "
          f"{owner.backed_bytes // MiB} MiB backed")
    """),
    code("print(describe(owner.snapshot()))", IGNORE),
    md("""
    ## Finalize, then write the last token

    After `finalize(3000)` tokens 0..2999 are backed (and the padded page after them).
    Writing beyond the backed span would fault (a segfault on the host driver, an illegal
    address on a GPU), which is why kvvmm checks every span before it commits and never
    clamps.
    """),
    code("""
    owner.finalize(3000)
    k0[2999].fill_(2.0)
    print(f"tokens 0 and 2999 sum to {float(k0[:3000].float().sum())}; "
          f"{owner.backed_bytes // MiB} MiB backed in {owner.snapshot().handles} handles")
    """),
    code("va_map(owner.snapshot())", IGNORE),
    md("""
    ## Close never pulls memory from under a live tensor

    `close()` gives everything back, unless a tensor made over the arena is still alive: then
    the arena is marked closed and its memory goes when the last such tensor goes. (The seed
    aborted at exit with "invalid device pointer" for want of this.)
    """),
    code("""
    owner.close()
    print("closed:", owner.closed, "| memory given back:", owner.arena.released)
    print("k0 still reads", float(k0[0].float().sum()))
    del k0
    print("after del k0, memory given back:", owner.arena.released)
    print(describe_stats(drv.stats()))
    """),
    code("""
    assert owner.arena.released
    assert drv.stats().clean, drv.stats()
    """),
]

NOTEBOOKS = {
    "01_tour": TOUR,
    "02_layouts": LAYOUTS,
    "03_growth": GROWTH,
    "04_failures": FAILURES,
    "05_gpu": GPU,
}


def build(name: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = NOTEBOOKS[name]
    env_driver = os.environ.pop("KVVMM_DRIVER", None)  # sim, as nbval runs them
    try:
        client = NotebookClient(nb, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": str(HERE)}},
                                record_timing=False)
        client.execute()
    finally:
        if env_driver is not None:
            os.environ["KVVMM_DRIVER"] = env_driver
    clean(nb)
    for cell in nb.cells:  # nbformat ids are random: make them stable for small diffs
        if "id" in cell:
            cell["id"] = f"{name[:2]}-{nb.cells.index(cell):02d}"
    path = HERE / f"{name}.ipynb"
    path.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
    return path


def main(argv: list[str]) -> int:
    names = argv or list(NOTEBOOKS)
    for name in names:
        if name not in NOTEBOOKS:
            print(f"unknown notebook {name!r}: one of {list(NOTEBOOKS)}", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        path = build(name)
        print(f"{path.name}: {path.stat().st_size / 1024:.1f} KiB, "
              f"{time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
