# %% [markdown]
# # 06 · Workloads: memory strategies under real serving traffic
#
# The question a researcher brings is rarely "what does `finalize` do" but "how would this
# memory design behave for my model under real traffic". This notebook answers one such
# question end to end:
#
# > **On conversation traffic, how much KV memory would page-elastic backing (map and unmap
# > pages anywhere as requests come and go, kvcached's model) save over prefix growth, and
# > what would it cost in driver time on the decode path?**
#
# The traffic is Azure's public LLM inference trace (conversation service, 19,366 requests
# over one hour; CC-BY 4.0; Patel et al., "Splitwise: Efficient generative LLM inference using
# phase splitting", ISCA 2024). kvvmm does not ship it: download
# `AzureLLMInferenceTrace_conv.csv` from the Azure Public Dataset
# (github.com/Azure/AzurePublicDataset, `AzureLLMInferenceDataset2023.md`) and load it with
# `kvvmm.workload.load_azure_csv`. Here we use the generator whose defaults are fitted to that
# trace, on a five-minute slice, so the notebook stays fast.

# %%
from kvvmm.hardware import default_cost_model
from kvvmm.units import fmt_bytes
from kvvmm.viz.workload import format_workload, workload_figure
from kvvmm.workload import (
    PrefixGrowth,
    ServingConfig,
    Strategy,
    azure_conv_fit,
    fit_workload,
    generate,
    run_workload,
)

# %% [markdown]
# ## The traffic
#
# The fit's headline figures, computed from the real trace (its source is in the fit), and
# the same figures measured on five generated minutes.

# %%
fit = azure_conv_fit()
print(fit.source[:60] + "...")
print("fitted:   ", fit.summary())
wl = generate(seed=0, duration_s=300.0)
print("generated:", len(wl), "requests;", fit_workload(wl).summary())

# %% [markdown]
# ## The serving model and three strategies
#
# llama-3.1-70b at TP 8 on an H200: one rank's KV pool (160 buffers, K and V of 80 layers,
# one KV head each), as large as the planner fits after the weights: 2.87 M tokens. The
# engine batches continuously (256 requests, 8192 tokens per step at most), hands out
# 16-token pages lowest-free-first, and a decode step reads the rank's weights and the
# batch's KV at HBM bandwidth (`StepTimeModel`). Every strategy drives a real
# `KvBufferOwner` on the sim driver:
#
# - `static`: the whole pool backed before capture (what `cudaMalloc` gives);
# - `prefix`: `ensure_prefix` to the highest page in use, under the default growth policy;
# - `prefix+shrink`: the same, giving the tail back (with hysteresis) when the pool empties.
#
# Page-elastic backing needs page-granular owner calls that are still to come, so it does
# not run as a strategy yet; the runner records what it would back **at best** (every 2 MiB
# granule that a used page touches, in every buffer) and how many granules it would map and
# unmap: enough to answer the question with the sim's cost model.

# %%
cmp = run_workload(wl, ["static", "prefix", "prefix+shrink"], model="llama-3.1-70b",
                   gpu="h200", tp=8)
print(format_workload(cmp))

# %% tags=["nbval-ignore-output"]
workload_figure(cmp)

# %% [markdown]
# ## The answer
#
# Memory: the time-weighted mean of what each backs, against what page-elastic backing would
# back at best. Cost: page-elastic maps one granule handle per buffer each time a granule
# gains its first used page (create + map + set access) and unmaps it when it loses its last
# (unmap + release); the sim's H200 cost model prices each call.

# %%
prefix = cmp.result("prefix")
cost = default_cost_model()
gran = 2 << 20
map_us = cost("create", gran) + cost("map", gran) + cost("set_access", gran)
unmap_us = cost("unmap", gran) + cost("release", gran)
elastic_s = (prefix.elastic_maps * map_us + prefix.elastic_unmaps * unmap_us) * 1e-6
saved = prefix.mean_backed_bytes - prefix.mean_elastic_bytes
print(f"prefix growth backs on average {fmt_bytes(round(prefix.mean_backed_bytes))}, "
      f"page-elastic at best {fmt_bytes(round(prefix.mean_elastic_bytes))}: "
      f"{fmt_bytes(round(saved))} less ({saved / prefix.mean_backed_bytes:.0%})")
print(f"static backs {fmt_bytes(cmp.result('static').peak_backed_bytes)} throughout")
print(f"driver time on the decode path over {prefix.serving.end_s:.0f} s: prefix growth "
      f"{prefix.decode_driver_s * 1e3:.1f} ms in {prefix.stalled_steps} steps; page-elastic "
      f"~{elastic_s * 1e3:.0f} ms ({prefix.elastic_maps:,} granule maps, "
      f"{prefix.elastic_unmaps:,} unmaps over 160 buffers)")

# %% [markdown]
# So on this traffic page-elastic backing would hold about a third of what prefix growth
# holds (both a few hundredths of the static pool) but would pay on the order of a second of
# driver calls on the decode path where prefix growth pays a few milliseconds: a handle pool
# that maps pre-created handles (the elastic-backing issue) is what would make it affordable.
#
# ## Your own strategy, in a cell
#
# A strategy is a subclass of `Strategy` with an `update` method: back every page just
# handed out. This one grows in exact steps of one granule of headroom and never shrinks.

# %%
class Headroom(Strategy):
    name = "headroom"

    def update(self, allocated: list[int], freed: list[int], high_water: int) -> None:
        if high_water > self.covered_pages:  # pages [0, covered) are backed
            self.grow_to(high_water + 512)  # 512 pages: one 2 MiB granule per buffer


mine = run_workload(wl, [Headroom(), PrefixGrowth()], model="llama-3.1-70b", gpu="h200",
                    tp=8)
print(format_workload(mine))

# %% [markdown]
# ## The slot allocator's order
#
# The order decides how compact the used pages are. A free list (LIFO) scatters them over
# everything ever used: more granules hold a used page, so even page-elastic backing at best
# needs about twice as much, and a prefix-backed pool has no tail to give back.

# %%
lifo = run_workload(wl, ["prefix"], model="llama-3.1-70b", gpu="h200", tp=8,
                    config=ServingConfig(slot_order="lifo"))
lo, li = cmp.result("prefix"), lifo.result("prefix")
for name, r in (("lowest", lo), ("lifo", li)):
    hw = max(r.timeline.high_water_pages)
    print(f"{name:6s}: highest page in use {hw:,}; mean elastic at best "
          f"{fmt_bytes(round(r.mean_elastic_bytes))}; prefix backs "
          f"{fmt_bytes(round(r.mean_backed_bytes))}")

# %% [markdown]
# ## Checks

# %%
for r in (*cmp.results, *mine.results, *lifo.results):
    assert r.used_over_backed == 0 and r.conservation_errors == 0, r.strategy
    assert r.serving.completed + r.serving.rejected == r.serving.requests
assert prefix.mean_elastic_bytes < prefix.mean_backed_bytes < cmp.result("static").peak_backed_bytes
assert elastic_s > 10 * prefix.decode_driver_s
assert cmp.result("static").decode_driver_s == 0.0
