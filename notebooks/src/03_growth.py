# %% [markdown]
# # 03 · Growth policies and bandwidth
#
# When a KV buffer grows during decoding, each extension is a new handle. How big the
# handles are matters on a GPU: copying a 1 GiB tensor on an H200 ran at 4.22 TB/s over
# one handle but 3.61 TB/s over 2 MiB handles, and 3.49 when those handles were created
# interleaved with other buffers' handles, which is what growing many buffers step by
# step does. The seed (SGLang's `kv_vmm_backing.py`, the implementation kvvmm follows)
# grew one small handle per extension and left its KV tensors at 0.87x of `cudaMalloc`
# bandwidth.
#
# A **growth policy** trades handles for over-commit (memory backed before it is needed):
# `Exact()` backs exactly what is needed, `Chunked(min_bytes)` at least a chunk,
# `Geometric(factor, max_bytes)` a multiple of what is backed, capped.

# %%
import os

import kvvmm
from kvvmm.growth import decode_growth
from kvvmm.hardware import H200_BANDWIDTH, predicted_bandwidth_tb_s
from kvvmm.policy import default_policy, simulate_growth
from kvvmm.units import MiB, fmt_bytes
from kvvmm.viz import format_growth

# `kvvmm lab` sets KVVMM_DRIVER (cuda on a GPU machine). Without it, and under nbval,
# the notebooks run on the simulator, whose addresses and costs are deterministic.
DRIVER = os.environ.get("KVVMM_DRIVER", "sim")

# %% [markdown]
# ## The measurements
#
# The H200 table the lab predicts bandwidth from; where it was measured and how is in
# `docs/MEASUREMENTS.md` §4 of this repository, and `kvvmm bench`'s own runs are under
# `bench/results/` (`h200-kvvmm-bench.json`).

# %%
print(H200_BANDWIDTH.source)
for pt in H200_BANDWIDTH.points:
    size = fmt_bytes(pt.handle_bytes) if pt.handle_bytes else "-"
    print(f"  {pt.label:<26} handle {size:>9}  {pt.tb_s:.3f} TB/s")

# %% tags=["nbval-ignore-output"]
from kvvmm.viz import bandwidth_by_handle_size

bandwidth_by_handle_size()

# %% [markdown]
# ## One buffer, three policies (pure simulation)
#
# `simulate_growth` replays a policy on a list of byte counts the buffer must reach. Here
# one Llama-8B K buffer (2 KiB per token) grows to 32k tokens, 256 tokens per step.

# %%
DEFAULT = default_policy()  # what an owner uses when given no policy
print("the owner's default policy:", DEFAULT)
POLICIES = [kvvmm.Exact(), kvvmm.Chunked(64 * MiB), kvvmm.Geometric(2.0, 256 * MiB), DEFAULT]
needs = [n * 2048 for n in range(256, 32_768 + 1, 256)]
for policy in POLICIES:
    handles = simulate_growth(policy, needs, limit_bytes=66 * MiB, gran=2 * MiB)
    print(f"{policy!s:<38} {len(handles):>3} handle{'s' if len(handles) != 1 else ' '}: "
          + ", ".join(fmt_bytes(h) for h in handles[:6]) + (" ..." if len(handles) > 6 else ""))

# %% [markdown]
# ## Many buffers on a driver
#
# `decode_growth` runs the real thing: for each policy a fresh owner on the chosen driver
# grows all buffers of the first layers of a model, step by step, and every driver call is
# counted. The bandwidth column is *predicted* from the handle sizes with the H200 table
# (interleaved, since many buffers grow together), not measured: `kvvmm bench` measures.
#
# The driver time on the sim is its clock, charged from a **profile** of measured costs
# (`PROFILE` below: the shipped H200's, or the `.json` that `kvvmm calibrate` writes on
# your own GPU): each driver call as it costs inside an owner's growth, and kvvmm's own work
# per arena and owner operation; the table names the profile. On a GPU the same growth also
# runs on the sim, and the table shows the measured time (the growth's wall) next to the
# predicted one. How close they come on an H200, and how much the card varies by itself:
# `docs/MEASUREMENTS.md` §12.

# %%
PROFILE = "h200"
GROWTH = {"model": "llama-3.1-8b", "layers": 8, "tokens": 32_768, "step_tokens": 256}
results = decode_growth(POLICIES, driver=DRIVER, profile=PROFILE, **GROWTH)
predicted = None if DRIVER == "sim" else decode_growth(POLICIES, driver="sim", profile=PROFILE,
                                                       **GROWTH)
print(format_growth(results, profile=PROFILE, predicted=predicted))

# %% tags=["nbval-ignore-output"]
from kvvmm.viz import handle_sizes

handle_sizes({r.policy: list(r.handle_bytes) for r in results})

# %% [markdown]
# ## Reading the table
#
# - `Exact()` makes a 2 MiB handle every 1024 tokens per buffer: the most driver calls,
#   the least over-commit, and the seed's bandwidth penalty.
# - `Chunked(64 MiB)` makes 64 MiB handles: predicted at the bandwidth of `cudaMalloc`,
#   with up to one chunk over-committed per buffer: on a model with many buffers and a
#   short prefix that is most of what is backed (the "max over" column).
# - `Geometric` starts small and doubles: few handles early, bounded over-commit late.
# - The last row is the owner's default (printed above: `default_policy()`),
#   what every owner given no policy grows with. Its cost is the over-commit column.
#
# `finalize` always backs exactly (the size is known, over-commit buys nothing), so
# policies only matter for on-demand growth.
#
# ## Explore
#
# The panel below has run the default workload (the first 4 layers of llama-3.1-8b to
# 16k tokens). Next to each policy is its over-commit (backed - needed) on the workload,
# worked out as you type; change the workload or policies and press **Run** (a progress
# bar shows while it runs; all 80 layers of llama-3.1-70b take a few seconds). A value a
# policy refuses shows the error in red over the last results, marked stale.

# %% tags=["nbval-ignore-output"]
from kvvmm.lab import GrowthLab

growth_lab = GrowthLab(driver=DRIVER, layers=4, tokens=16_384)
growth_lab.run()
growth_lab

# %% [markdown]
# The cell below checks the panel from code, on a panel of its own.

# %%
check = GrowthLab(driver=DRIVER, layers=4, tokens=16_384)
print(check.run(), [r.policy for r in check.results])
check.chunk_mib.value = 0  # not a chunk size: the error shows, results stay
print(check.run(), check.error_text)
print(len(check.results), "results kept, stale:", check.stale)

# %%
exact, chunked, geometric, default = results
malloc = H200_BANDWIDTH.reference_tb_s("plain")
assert exact.handles > geometric.handles > chunked.handles
assert exact.max_over_commit_bytes < chunked.max_over_commit_bytes
assert all(r.backed_bytes >= r.needed_bytes for r in results)
assert chunked.predicted_tb_s / malloc > 0.98 > 0.9 > exact.predicted_tb_s / malloc
assert predicted_bandwidth_tb_s([64 * MiB]) > predicted_bandwidth_tb_s([2 * MiB])
assert check.stale and len(check.results) == 4
assert growth_lab.last_error is None and len(growth_lab.results) == 4  # the reader's panel
