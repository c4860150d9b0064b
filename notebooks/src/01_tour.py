# %% [markdown]
# # 01 · A tour: reserve once, back later
#
# An LLM server keeps every token's keys and values (the **KV cache**) in a few large
# tensors, one or two per layer. Two constraints pull against each other:
#
# - **CUDA graphs** are captured once, early, and bake the tensors' *addresses* into the
#   graph. The KV tensors must exist, at their final addresses, before capture.
# - The KV cache should take **whatever memory is left after capture** (weights,
#   activations and the graphs themselves come first), and that is only known afterwards.
#
# With `cudaMalloc` you must pick the size before capture. CUDA's **virtual memory
# management** (VMM) splits an allocation in two: **reserve** a range of virtual addresses
# (VA, free: no memory behind it), then **create** physical *handles* and **map** them into
# the range as needed. So the KV tensors can be created at their upper-bound shape, graphs
# captured against them, and memory **backed** later, only as much as the budget allows
# (SGLang does exactly this, in `kv_vmm_backing.py`: **the seed**, the implementation
# kvvmm follows and measures itself against). kvvmm is that idea as a library, and this
# notebook walks through it, drawing the VA map after each step.
#
# | word | meaning |
# |---|---|
# | reserve / free | take / give back a VA range (no memory) |
# | granularity | the driver's allocation unit (the first cell prints it for H100 and H200) |
# | create / release, map / unmap | make / drop a physical handle; attach / detach it at a VA |
# | commit / decommit | create + map + set access / unmap + release |
# | backed | committed, physically present |
# | prefix (of `n` tokens) | a buffer's bytes for its first `n` token slots: backed to use them |
# | final (span) | what `finalize(n)` backs: the prefix of `n` tokens plus one padded page |
# | slack | the granularity padding past a buffer's last byte (reserved, never used) |
# | cursor | the arena's allocation cursor: where the next allocation's VA would start |
#
# Every code cell can be changed and re-run. Cells that draw figures or widgets are not
# compared by the tests; the printed summaries are.
#
# You are editing a working copy: `kvvmm lab` opens the notebooks from `notebooks/.work/`
# (ignored by git), copied from `notebooks/` on first launch and never overwritten after,
# so your edits stay there across launches. Delete a copy to get the current version back.

# %%
import json
from collections import Counter
from pathlib import Path

import kvvmm
from kvvmm.driver import PROFILES
from kvvmm.units import MiB, fmt_bytes
from kvvmm.viz import describe, describe_stats, va_map

# `kvvmm lab` sets KVVMM_DRIVER (cuda on a GPU machine). Without it, and under nbval,
# the notebooks run on the simulator, whose addresses and costs are deterministic.
DRIVER = kvvmm.notebook_driver_kind()

drv = kvvmm.TracingDriver(kvvmm.driver_for(DRIVER, profile="h200"))  # records every call
free_bytes, total_bytes = drv.mem_info()
print(f"{drv.kind} driver on {drv.name}: granularity {fmt_bytes(drv.granularity())}, "
      f"{fmt_bytes(free_bytes)} free of {fmt_bytes(total_bytes)}")
print("granularity:", ", ".join(f"{PROFILES[k].name} {fmt_bytes(PROFILES[k].granularity_bytes)}"
                                for k in ("h100", "h200")))

# %% [markdown]
# ## 1. Describe the KV buffers
#
# A `KvBufferDesc` is one buffer: an upper-bound tensor whose leading dimension counts
# token rows. `mha_token_major` builds SGLang's layout: one K and one V buffer per layer,
# each `(reserved_tokens + page_size, kv_heads, head_dim)`. The extra page absorbs the dummy
# writes CUDA-graph capture sends to slot 0.

# %%
LAYERS, KV_HEADS, HEAD_DIM = 4, 8, 128  # a small Llama-like model: change them
RESERVED_TOKENS, PAGE = 65_536, 16
descs = kvvmm.mha_token_major(layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                              reserved_tokens=RESERVED_TOKENS, page_size=PAGE,
                              dtype="bfloat16")
print(descs[0])
print(f"{len(descs)} buffers, each {fmt_bytes(descs[0].reserved_span_bytes(2))} at the "
      f"upper bound, {fmt_bytes(descs[0].row_bytes)} per token")

# %% [markdown]
# ## 2. Reserve, make the tensors, back slot 0
#
# `KvBufferOwner` does the pre-capture part in one go: it **reserves** one VA range for all
# buffers (each rounded up to the granularity), makes a tensor over each buffer's range,
# and **backs one page** of each (slot 0). Nothing else has memory yet.

# %%
owner = kvvmm.KvBufferOwner(driver=drv, dtype="bfloat16", page_size=PAGE,
                            reserved_tokens=RESERVED_TOKENS, descs=descs,
                            policy=kvvmm.Chunked(64 * MiB))
print(describe(owner.snapshot()))

# %% [markdown]
# The map: one band per buffer across its reserved span. Green is backed (one shade per
# handle), grey unbacked, light orange the **slack** (granularity padding past the tensor's
# bytes); the dashed line is the **cursor** (the end of what the arena has allocated); the
# markers are the end of slot 0's page, the **prefix** (the token slots backed for use),
# and, after `finalize`, the **final** span. Hover for exact `[start, end)` addresses.

# %% tags=["nbval-ignore-output"]
va_map(owner.snapshot())

# %% [markdown]
# ## 3. The tensors
#
# The tensors already have their full shape. On the simulator they are `meta` tensors
# (shape and dtype, no memory); on the host driver they alias host memory, on CUDA device
# memory, with no copy and no compiled extension. Their addresses are fixed for life.

# %%
devices = {t.device.type for t in owner.tensors}
for d, t in list(zip(descs, owner.tensors, strict=True))[:3]:
    print(f"{d.name}: shape {tuple(t.shape)}, {t.dtype}, on {t.device.type}")
snap = owner.snapshot()
pointers = {b.name: snap.arena.base + b.offset for b in snap.buffers}
print("offsets from the arena base:",
      ", ".join(f"{b.name} +{fmt_bytes(b.offset)}" for b in snap.buffers[:4]), "...")

# %% [markdown]
# ## 4. Capture
#
# On a GPU, this is where the server captures its CUDA graphs against `owner.tensors`.
# During capture every dummy KV write goes to slot 0, which is why slot 0's page is backed
# already; everything else may stay unbacked. The graph records the pointers above.
#
# The simulator has no GPU and so no capture: we only keep the pointers the graph would
# have baked in, and check at the end that nothing moved. (`05_gpu.ipynb` writes to the
# tensors over real memory.)

# %%
captured = dict(pointers)  # what a captured graph would hold
slot0 = snap.buffers[0]
print(f"slot 0 of each buffer: {fmt_bytes(slot0.page0_bytes)} of data, backed by a "
      f"{fmt_bytes(slot0.backed_bytes)} handle (the granularity)")

# %% [markdown]
# ## 5. Finalize: back what the budget allows
#
# After capture the server reads free memory and sizes the KV cache. `finalize(n)` backs
# each buffer's final span for `n` tokens (plus the padded page), exactly, with one handle
# per buffer.

# %%
budget_bytes = 512 * MiB  # say: what is left for KV after weights, activations, graphs
bytes_per_token = sum(d.row_bytes for d in descs)  # token-major: one row per token
capacity = budget_bytes // bytes_per_token // PAGE * PAGE
print(f"{fmt_bytes(bytes_per_token)} per token -> capacity {capacity:,} tokens")
handles_before = len(owner.snapshot().arena.mappings)
owner.finalize(capacity)
owner_final = owner.snapshot()
print(describe(owner_final))

# %% tags=["nbval-ignore-output"]
va_map(owner.snapshot())

# %% [markdown]
# ## 6. Grow on demand, give back
#
# `ensure_prefix(n)` backs the first `n` token slots when they are needed; the owner's
# growth policy (the `Chunked` one it was given: `describe` names it) decides the handle
# size. `shrink(n)` gives back whole mappings beyond `n` tokens: a handle that straddles
# the boundary stays, because maps are whole handles.

# %%
owner.ensure_prefix(40_000)
print("after ensure_prefix(40_000):", fmt_bytes(owner.backed_bytes), "backed")
owner.shrink(16_384)
print("after shrink(16_384):      ", fmt_bytes(owner.backed_bytes), "backed")
shrunk = owner.snapshot()
print(describe(shrunk))

# %% tags=["nbval-ignore-output"]
va_map(owner.snapshot())

# %% [markdown]
# ## 7. What the driver did
#
# Every call went through the `TracingDriver`. On the simulator each call also advances a
# clock by the cost measured for it on an H200. A trace saves to JSON; `kvvmm map
# trace.json -o map.html` draws it anywhere.

# %%
calls = Counter(e.op for e in drv.trace.driver_calls())
print(", ".join(f"{op} {n}" for op, n in sorted(calls.items())))
if DRIVER == "sim":
    print(f"simulated driver time: {drv.clock_us / 1000:.3f} ms")

# %% tags=["nbval-ignore-output"]
from kvvmm.viz import timeline

timeline(drv.trace)

# %% [markdown]
# ## 8. Sleep and wake
#
# A server that idles can give the GPU its KV memory back without rebuilding anything:
# `sleep()` unmaps and releases every handle but keeps the reservation, so the tensors keep
# their pointers and a captured graph stays valid; `wake()` backs the same ranges at the same
# VA. With `backup="host"` (pinned host memory) or `"disk"` (a file) the bytes are copied out
# first and back after; with none, a wake gives fresh memory. Both are transactions: a
# failure leaves the owner awake with its bytes or asleep with its backup. (On the simulator
# there are no bytes to copy: the tensors are meta tensors.) The ArenaLab below has **Sleep**
# and **Wake** buttons too; docs/SLEEP.md has the contract for every owner kind.

# %%
awake = owner.snapshot()
slept = owner.sleep("host")
print(slept)
asleep_line = next(ln for ln in describe(owner.snapshot()).splitlines() if "asleep" in ln)
print(asleep_line)
asleep_backed = owner.backed_bytes
owner.wake()
woke_same = owner.snapshot() == awake
print("after wake the snapshot is the one before the sleep:", woke_same)


def repo_file(rel: str) -> Path | None:
    """``rel`` in this checkout: looked for above the notebook's folder (kvvmm lab runs a
    working copy in notebooks/.work/); None where the notebook runs without the repository."""
    for folder in (Path.cwd(), *Path.cwd().parents):
        if (folder / rel).is_file():
            return folder / rel
    return None


SLEEP = repo_file("bench/results/h200-sleep.json")
if SLEEP is not None:  # what a 60 GiB pool measured on an H200, beside torch_memory_saver
    m = json.loads(SLEEP.read_text())
    runs, t = m["kvvmm"]["runs"], m["targets"]
    tms = m["torch_memory_saver"]["runs"]["cpu_backup"]
    print(f"{m['card']}, a {m['pool']['gib']:.0f} GiB {m['pool']['model']} TP{m['pool']['tp']} "
          f"pool: host-backed sleep {runs['host-mmap']['sleep_s']['median']:.1f} s, wake "
          f"{runs['host-mmap']['wake_s']['median']:.2f} s "
          f"({t['wake_with_contents']['ratio']:.2f}x the PCIe copy of its bytes); without "
          f"a backup wake {runs['none']['wake_s']['median'] * 1e3:.0f} ms; torch_memory_saver "
          f"{tms['sleep_s']['median']:.1f} s / {tms['wake_s']['median']:.2f} s "
          f"({SLEEP.relative_to(SLEEP.parents[2])})")
else:
    print("bench/results/h200-sleep.json is not here: no H200 measurement")

# %% [markdown]
# ## 9. Your turn: the arena lab
#
# The panel below drives the same library. It has pressed **Reserve KV** for you: an
# owner like the one above (2 layers, so 4 buffers), slot 0 backed. Move the token slider
# and press **Ensure prefix**, **Finalize** or **Shrink**; **Close**, then **Reserve** +
# **Allocate** + **Commit** work on a bare arena. Next to the policy, what that policy
# over-commits (backs beyond need) while the buffers grow. Bad values show an error in
# red and change nothing.

# %% tags=["nbval-ignore-output"]
from kvvmm.lab import ArenaLab

lab = ArenaLab(driver=DRIVER, layers=2, reserved_tokens=8192)
lab.reserve_kv_button.click()
lab

# %% [markdown]
# The cell below checks the panel from code, on a panel of its own (so the one above stays
# as you left it): finalize works, fewer tokens than a page are refused.

# %%
check = ArenaLab(driver=DRIVER, layers=2, reserved_tokens=8192)
check.reserve_kv_button.click()
check.tokens.value = 4096
check.finalize_button.click()
print(check.error_text or "finalize(4096): ok")
check.tokens.value = 8  # below one page: refused, nothing changes
before_refusal = check.snapshot()
check.finalize_button.click()
refused = check.error_text
refusal_changed_nothing = check.snapshot() == before_refusal
print(refused)
print(describe(check.snapshot()))

# %% [markdown]
# ## 10. Close
#
# `close()` unmaps, frees the reservation and releases the handles; the driver then holds
# nothing. (If a tensor were still alive, the arena would wait for it: see `05_gpu`.)

# %%
owner.close()
check.close_button.click()
print(describe_stats(drv.stats()))

# %%
# The tour's claims, checked.
# 1: one K and one V buffer per layer, each (reserved_tokens + page_size, kv_heads, head_dim)
assert len(descs) == 2 * LAYERS
assert all(d.shape == (RESERVED_TOKENS + PAGE, KV_HEADS, HEAD_DIM) for d in descs)
# 2: construction backs one page of each buffer (slot 0) and nothing else: one handle each
assert len(snap.arena.mappings) == len(descs)
assert all(0 < b.page0_bytes <= b.backed_bytes == snap.arena.granularity for b in snap.buffers)
# 3: on the simulator the tensors are meta tensors
assert devices == ({"meta"} if DRIVER == "sim" else devices)
# 5: finalize backs each final span exactly (to the granularity), one new handle per buffer
gran = snap.arena.granularity
assert len(owner_final.arena.mappings) == handles_before + len(descs)
for b in owner_final.buffers:
    assert b.backed_bytes == -(-b.final_bytes // gran) * gran, b.name
# 6: shrink keeps the handle that straddles the boundary: more than the prefix stays
assert all(b.backed_bytes > b.prefix_bytes for b in shrunk.buffers)
# 8: sleep gives back every mapping and the wake brings the same snapshot back
assert slept.given_bytes == awake.backed_bytes and asleep_backed == 0 and woke_same
assert slept.mappings == len(awake.arena.mappings) and "asleep" in asleep_line
# 9: the reader's panel is an owner of 2 layers, so 4 buffers; fewer tokens than a page:
# refused, nothing changed
assert lab.layers.value == 2 and len(lab.snapshot().buffers) == 4
assert "page_size" in refused and refusal_changed_nothing
final = owner.snapshot()
assert final.arena.closed and final.backed_bytes == 0
assert drv.stats().clean, drv.stats()
assert {b.name: final.arena.base + b.offset for b in final.buffers} == captured
assert calls["create"] == calls["map"] == calls["set_access"]
assert check.owner is None and check.last_error is None
assert lab.owner is not None and lab.last_error is None  # the reader's panel: KV reserved
