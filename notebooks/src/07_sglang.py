# %% [markdown]
# # 07 · SGLang: swap one import, keep SGLang's calls
#
# SGLang sizes its KV pool after CUDA-graph capture with `KvVmmBufferOwner` from its
# `kv_vmm_backing.py` (**the seed**). `kvvmm.integrations.sglang` offers the same class, with
# the same keyword constructor and calls, on kvvmm's owner: no C++ stub compiled per arena
# (the seed builds one each time: the first cell prints how long that took on an H200,
# from the measurement this repository keeps), every multi-step change undone on failure,
# a close that waits for the last live tensor, and an owner the lab can draw.
#
# The swap is one line, before SGLang builds its pool:
#
# ```python
# import kvvmm.integrations.sglang as k; k.install()
# ```
#
# (or launch the server with `python -m kvvmm.integrations.sglang_launch sglang.launch_server
# ...`, so the worker processes SGLang spawns get it too). After it, SGLang's own
# `from sglang.srt.mem_cache.kv_vmm_backing import KvVmmBufferOwner` finds kvvmm's class.

# %%
import json
from pathlib import Path

import kvvmm
import kvvmm.integrations.sglang as k
from kvvmm.units import fmt_bytes
from kvvmm.viz import describe, va_map

k.install()  # the one line


def repo_file(rel: str) -> Path | None:
    """``rel`` in this checkout: looked for above the notebook's folder (kvvmm lab runs a
    working copy in notebooks/.work/); None where the notebook runs without the repository."""
    for folder in (Path.cwd(), *Path.cwd().parents):
        if (folder / rel).is_file():
            return folder / rel
    return None


def ctor_seconds(node: object, key: str) -> list[float]:
    """Every ``key`` (a constructor's seconds) anywhere in a measurement JSON."""
    if isinstance(node, dict):
        return [v for k_, v in node.items() if k_ == key] + [
            x for v in node.values() for x in ctor_seconds(v, key)]
    return [x for v in node for x in ctor_seconds(v, key)] if isinstance(node, list) else []


CONFORMANCE = repo_file("bench/results/h200-sglang-conformance.json")
if CONFORMANCE is not None:
    measured = json.loads(CONFORMANCE.read_text())
    seed_s, ours_s = (ctor_seconds(measured, f"{who}_ctor_s") for who in ("seed", "kvvmm"))
    print(f"constructing one pool on an {measured['device']}: the seed "
          f"{min(seed_s):.1f}-{max(seed_s):.1f} s, kvvmm {min(ours_s) * 1e3:.1f}-"
          f"{max(ours_s) * 1e3:.1f} ms ({len(seed_s)} pools each; "
          f"{CONFORMANCE.relative_to(CONFORMANCE.parents[2])})")
else:
    print("bench/results/h200-sglang-conformance.json is not here: no H200 measurement")

# %%
from sglang.srt.mem_cache.kv_vmm_backing import KvVmmBufferOwner  # SGLang's own line

print("SGLang's import gives kvvmm's class:", KvVmmBufferOwner is k.KvVmmBufferOwner)

# `kvvmm lab` sets KVVMM_DRIVER (cuda on a GPU machine). Without it, and under nbval, this
# notebook runs on the simulator, whose addresses are deterministic.
DRIVER = kvvmm.notebook_driver_kind()

# %% [markdown]
# ## 1. SGLang's descriptors, SGLang's constructor
#
# SGLang describes each KV buffer with an object of four fields: `name`, `shape`,
# `row_bytes`, `tokens_per_row`. The adapter reads exactly those (duck-typed), so SGLang's own
# objects pass as they are; `SglDesc` below stands for them. MHA: one K and one V buffer per
# layer, token-major, `(size + page_size, kv_heads, head_dim)`: the extra page absorbs the
# dummy writes CUDA-graph capture sends to slot 0.
#
# On a GPU SGLang passes `device="cuda"` and kvvmm opens its CUDA driver on `device_id`;
# `driver=` (a kvvmm extension) runs the same class on any driver, here the simulator.

# %%
class SglDesc:
    """SGLang's KvBufferDesc as the adapter sees it: four fields, nothing else."""

    def __init__(self, name, shape, row_bytes, tokens_per_row):
        self.name, self.shape = name, shape
        self.row_bytes, self.tokens_per_row = row_bytes, tokens_per_row


LAYERS, KV_HEADS, HEAD_DIM, PAGE = 4, 8, 128, 16
SIZE = 262_144  # reserved_num_tokens: the most tokens the pool can ever serve
ROW = KV_HEADS * HEAD_DIM * 2  # bfloat16: bytes of one token of one buffer
descs = [SglDesc(f"{kv}{i}", (SIZE + PAGE, KV_HEADS, HEAD_DIM), ROW, 1)
         for kv in "kv" for i in range(LAYERS)]

drv = kvvmm.driver_for(DRIVER, profile="h200")  # the sim simulates an H200
pool = KvVmmBufferOwner(device="cuda", device_id=0, store_dtype="bfloat16", page_size=PAGE,
                        reserved_num_tokens=SIZE, buffer_descs=descs, driver=drv)
ptrs = [t.data_ptr() for t in pool.tensors]
print(f"{len(pool.tensors)} tensors of shape {tuple(pool.tensors[0].shape)}; backed after "
      f"construction (slot 0): {fmt_bytes(pool.backed_bytes)}; "
      f"{pool.bytes_per_token()} bytes per token")

# %% [markdown]
# ## 2. What the lab sees
#
# The adapter is a `KvBufferOwner` underneath: `snapshot()` is the frozen record every lab
# view draws. After CUDA-graph capture SGLang knows its budget and calls `finalize(n)`:
# each buffer's final span (n tokens plus the padded page) is backed, with `Exact()` growth,
# one handle per extension, as the seed does.

# %%
BUDGET_BYTES = 1 << 30  # what is left after weights, activations and graphs
n = BUDGET_BYTES // pool.bytes_per_token() // PAGE * PAGE
slot0 = pool.snapshot()
pool.finalize(n)
finalized = pool.snapshot()
assert [t.data_ptr() for t in pool.tensors] == ptrs  # captured graphs keep their addresses
print(f"finalize({n}): {fmt_bytes(pool.backed_bytes)} backed, "
      f"{pool.backed_tokens} tokens usable with nothing more to back")
print(describe(pool.snapshot()))

# %% tags=["nbval-ignore-output"]
va_map(pool.snapshot())

# %% [markdown]
# ## 3. The later upstream calls, and errors SGLang catches
#
# The lazy-backing caller hands out the pool's top page with `ensure_prefix(size + page_size)`
# and reads `backed_tokens` (O(1)) on every allocation; when the pool goes idle,
# `release_beyond(n)` gives back every mapping that starts past the first `n` slots' prefix,
# as upstream does (a mapping straddling it stays whole); `ensure_prefix(n)` backs again.
# docs/SGLANG.md lists every call with its line in SGLang 0.5.23. A driver failure reaches
# SGLang as the `RuntimeError` it catches, and stays the kvvmm error it is
# (`DriverOutOfMemoryError`, with the call and the CUDA error name), undone before it is raised.

# %%
given = pool.release_beyond(PAGE)
after_release = pool.snapshot()
print(f"release_beyond({PAGE}): gave back {fmt_bytes(given)}; "
      f"{fmt_bytes(pool.backed_bytes)} stay (slot 0's handles)")

faulty = kvvmm.FaultyDriver(kvvmm.driver_for(DRIVER, profile="h200"))
small = KvVmmBufferOwner(device="cuda", device_id=0, store_dtype="bfloat16", page_size=PAGE,
                         reserved_num_tokens=SIZE, buffer_descs=descs, driver=faulty,
                         name="faulty")
faulty.arm({"create": 1})
small_before = small.snapshot()
try:
    small.finalize(n)
except RuntimeError as e:  # what SGLang catches
    caught = e
print(type(caught).__name__, "is a RuntimeError:", isinstance(caught, RuntimeError),
      "and a kvvmm DriverError:", isinstance(caught, kvvmm.DriverError))
print(caught)
small_after = small.snapshot()
print(f"after the failed finalize: {fmt_bytes(small.backed_bytes)} backed "
      f"({'as' if small_after == small_before else 'NOT as'} before)")

# %% [markdown]
# ## 4. Close
#
# The seed unmaps at once, even under a tensor SGLang still holds (its pool's `k_buffer`):
# the next touch is an illegal address. kvvmm drops the owner's tensors and gives the memory
# back when the last one goes; `close(wait=True, timeout=...)` waits for that, `released`
# says whether it happened. The simulator's tensors are `meta` tensors that reach no memory,
# so its owners give back at once: this part runs on the host driver (Linux), whose tensors
# hold real bytes.

# %%
small.close()
pool.close()
host = kvvmm.open_driver("host")
hpool = KvVmmBufferOwner(device="cpu", device_id=0, store_dtype="bfloat16", page_size=PAGE,
                         reserved_num_tokens=4096, buffer_descs=[
                             SglDesc(f"{kv}0", (4096 + PAGE, KV_HEADS, HEAD_DIM), ROW, 1)
                             for kv in "kv"], driver=host)
held = hpool.tensors[0][:PAGE]  # as SGLang's pool keeps its k_buffer
held.fill_(1.0)
print("released with a tensor held:", hpool.close(), f"({hpool.live_tensors} live)")
print("its bytes are still there:", float(held.sum()))
try:
    hpool.close(wait=True, timeout=0.05)
except RuntimeError as e:  # BusyError, a RuntimeError for SGLang
    print(type(e).__name__ + ":", str(e).split(";")[0])
del held
print("released after it goes:", hpool.close(wait=True, timeout=5.0))
host.close()
k.uninstall()

# %% [markdown]
# ## 5. Both engines on kvvmm
#
# vLLM 0.34 makes every VMM call of its growable KV cache through one `VmmDriver`;
# `kvvmm.integrations.vllm` answers those calls over any kvvmm driver (docs/VLLM.md:
# `kv.install(driver)` is the one line). Below, one simulated H200 serves both engines:
# SGLang's class from above, and vLLM's calls as its `ExtensibleTensor` makes them (reserve
# the whole span, then create, map and set access granule by granule as it grows). Then what
# each engine's own sizing rule would hold for llama-3.1-70b at TP 8 (the planner, with a
# 4 GiB activation peak for vLLM), and a replayed trace with vLLM's rule (`vllm-extensible`:
# warmup growth, one extend after capture, nothing while serving) beside kvvmm's request
# ranges on the pool vLLM would size.

# %%
import kvvmm.integrations.vllm as kv
from kvvmm.layout import plan
from kvvmm.workload import generate, run_workload
from kvvmm.workload.engines import VllmExtensible, VllmMemory

both = kvvmm.driver_for(DRIVER, profile="h200")
sgl = KvVmmBufferOwner(device="cuda", device_id=0, store_dtype="bfloat16", page_size=PAGE,
                       reserved_num_tokens=SIZE, buffer_descs=descs, driver=both, name="sglang")
sgl.finalize(n)
vmm = kv.KvvmmVmmDriver(both)
G = vmm.granularity(0)
span = 64 * G
base = vmm.reserve(span)  # vLLM reserves its whole span at startup ...
handles = []
for i in range(8):  # ... and maps granules as warmup and the final extend commit blocks
    h = vmm.create(G, 0)
    vmm.map(base + i * G, G, h)
    vmm.set_access(base + i * G, G, 0)
    handles.append(h)
vsnap = vmm.snapshot(base)
print(f"one driver, two engines: SGLang's pool {fmt_bytes(sgl.backed_bytes)} backed, "
      f"vLLM's reservation {fmt_bytes(vsnap.backed_bytes)} of {fmt_bytes(vsnap.reserved_bytes)} "
      f"backed; the driver holds {fmt_bytes(both.stats().physical_bytes)}")

PEAK = 4 << 30
plans = {"sglang": plan(gpu="h200", model="llama-3.1-70b", tp=8),
         "vllm": plan(gpu="h200", model="llama-3.1-70b", tp=8, engine="vllm",
                      activation_peak_bytes=PEAK)}
print(f"{'engine':8} {'kept back':>10} {'KV budget':>10} {'tokens':>11}")
for name, p in plans.items():
    print(f"{name:8} {fmt_bytes(p.headroom_bytes or 0):>10} {fmt_bytes(p.budget_bytes):>10} "
          f"{p.tokens:>11,}")
more = plans["vllm"].budget_bytes - plans["sglang"].budget_bytes
print(f"vLLM's default (gpu_memory_utilization 1.0) holds {fmt_bytes(more)} more KV per rank "
      f"than SGLang's mem_fraction_static {plans['sglang'].mem_fraction_static:g}")

# %%
vp = plans["vllm"]
memory = VllmMemory(total_bytes=vp.capacity_bytes, init_free_bytes=vp.capacity_bytes,
                    beside_kv_bytes=vp.weights_bytes or 0, transient_peak_bytes=PEAK)
cmp = run_workload(generate(seed=1, duration_s=30.0),
                   [VllmExtensible(memory), "request-ranges+deferred"],
                   model="llama-3.1-70b", tp=8, pool_tokens=vp.tokens)
print(f"{'strategy':24} {'mean held':>10} {'peak held':>10} {'mean used':>10}")
for r in cmp.results:
    print(f"{r.strategy:24} {fmt_bytes(r.mean_backed_bytes + r.mean_pool_bytes):>10} "
          f"{fmt_bytes(r.peak_backed_bytes):>10} {fmt_bytes(r.mean_used_bytes):>10}")
held = {r.strategy: r.mean_backed_bytes + r.mean_pool_bytes for r in cmp.results}
print(f"over 30 s of the generated trace, vLLM's rule holds "
      f"{held['vllm-extensible'] / held['request-ranges+deferred']:.0f}x what request ranges "
      f"hold, for the same requests ({cmp.results[0].serving.completed} completed each)")
for h in handles:
    vmm.unmap(base + handles.index(h) * G, G)
    vmm.release(h)
vmm.free_reserved(base, span)
sgl.close()

# %%
# The notebook's claims, checked.
assert pool.released and small.released and hpool.released and pool.backed_bytes == 0
assert isinstance(caught, RuntimeError) and isinstance(caught, kvvmm.DriverOutOfMemoryError)
assert n == 65_536 and given > 0
# The prose's claims, each against what ran.
if CONFORMANCE is not None:  # seconds per seed pool, milliseconds per kvvmm one
    assert min(seed_s) > 1.0 > 0.1 > max(ours_s)
assert all(tuple(t.shape) == (SIZE + PAGE, KV_HEADS, HEAD_DIM) for t in pool.tensors)
gran = finalized.arena.granularity
assert finalized.policy == "Exact()"  # the seed's growth: one handle per extension
for b0, b in zip(slot0.buffers, finalized.buffers, strict=True):  # final span backed
    assert b.backed_bytes == -(-b.final_bytes // gran) * gran and b0.backed_bytes == gran
handles = {m.allocation for m in finalized.arena.mappings}
assert len(finalized.arena.mappings) == 2 * len(handles)  # slot 0's page, one extension
assert after_release.backed_bytes == len(descs) * gran  # slot 0's handles stay
assert small_after == small_before  # the failed finalize was undone
sglang_doc = repo_file("docs/SGLANG.md")
assert sglang_doc is None or "0.5.23" in sglang_doc.read_text()
assert drv.stats().clean and faulty.inner.stats().clean
# Section 5: both engines were on one driver, and each table's sentence is its figures'.
assert vsnap.backed_bytes == 8 * G and vsnap.reserved_bytes == span
assert both.stats().physical_bytes == 0 and sgl.released
assert more == plans["vllm"].budget_bytes - plans["sglang"].budget_bytes > 0
assert plans["vllm"].headroom_bytes == (1 << 30) * 3 + PEAK  # margin 0.75 x 4 GiB + the peak
assert held["vllm-extensible"] > held["request-ranges+deferred"]
assert {r.serving.completed for r in cmp.results} == {cmp.results[0].serving.completed}
assert all(r.used_over_backed == 0 for r in cmp.results)
