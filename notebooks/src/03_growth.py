# %% [markdown]
# # 03 · Growth policies and bandwidth
#
# When a KV buffer grows during decoding, each extension is a new handle. How big the
# handles are matters on a GPU: a tensor over many small handles copies slower than one over
# a few large ones, and slower still when those handles were created interleaved with other
# buffers' handles, which is what growing many buffers step by step does. The seed
# (SGLang's `kv_vmm_backing.py`, the implementation kvvmm follows) grew one small handle
# per extension.
#
# A **growth policy** trades handles for over-commit (memory backed before it is needed):
# `Exact()` backs exactly what is needed, `Chunked(min_bytes)` at least a chunk,
# `Geometric(factor, max_bytes)` a multiple of what is backed, capped. The question this
# notebook answers: **which policy keeps the KV tensors at 0.99x of `cudaMalloc`'s copy
# bandwidth with the least over-commit?**

# %%
import kvvmm
from kvvmm.growth import decode_growth, least_over_commit
from kvvmm.hardware import BANDWIDTH_TARGET, H200_BANDWIDTH, growth_fit, predicted_ratio
from kvvmm.policy import default_policy, simulate_growth
from kvvmm.units import GiB, MiB, fmt_bytes
from kvvmm.viz import format_bandwidth_fit, format_growth

# `kvvmm lab` sets KVVMM_DRIVER (cuda on a GPU machine). Without it, and under nbval,
# the notebooks run on the simulator, whose addresses and costs are deterministic.
DRIVER = kvvmm.notebook_driver_kind()

# %% [markdown]
# ## The measurements
#
# Two kinds, both on an H200; where and how they were measured is in `docs/MEASUREMENTS.md`
# §4 of this repository. First a table: one 1 GiB tensor over handles of one size, created
# in a row (and, for two sizes, interleaved with other allocations' handles), against
# `cudaMalloc`.

# %%
print(H200_BANDWIDTH.source)
malloc = H200_BANDWIDTH.reference_tb_s("plain")
assert malloc is not None
for pt in H200_BANDWIDTH.points:
    size = fmt_bytes(pt.handle_bytes) if pt.handle_bytes else "-"
    print(f"  {pt.label:<26} handle {size:>9}  {pt.tb_s:.3f} TB/s  {pt.tb_s / malloc:.3f}x")

# %% tags=["nbval-ignore-output"]
from kvvmm.viz import bandwidth_by_handle_size

bandwidth_by_handle_size()

# %% [markdown]
# That table describes one buffer's handles. A model's buffers grow together, each
# extension a handle of its own between the other buffers' ones, at every size the policy
# makes: a setting the table measured only for its two smallest sizes. So the second kind of
# measurement is the owner itself: `kvvmm bench` grows an owner of 64 buffers under each
# policy, finalizes it, and copies the first GiB of one buffer into the next against two
# `cudaMalloc` tensors, every run of it since the first session. The lab's bandwidth curve
# for interleaved handles is **fitted** to those runs (and to the table's interleaved
# points), once to each policy's median run and once to its lowest and its highest: a
# prediction comes with the band the runs spanned. Below, each run measured, next to what
# the fitted curve predicts for the same copy.

# %%
print(H200_BANDWIDTH.growth_source)
print("workload:", H200_BANDWIDTH.growth_workload)
print(format_bandwidth_fit())

# %% tags=["nbval-ignore-output"]
from kvvmm.viz import bandwidth_fit_figure

bandwidth_fit_figure()

# %% [markdown]
# ## One buffer, three policies (pure simulation)
#
# `simulate_growth` replays a policy on a list of byte counts the buffer must reach. Here
# one Llama-8B K buffer grows by decode steps; the cell prints its size per token, the
# steps, and each policy's handles.

# %%
DEFAULT = default_policy()  # what an owner uses when given no policy
print("the owner's default policy:", DEFAULT)
POLICIES = [kvvmm.Exact(), kvvmm.Chunked(64 * MiB), kvvmm.Geometric(2.0, 256 * MiB), DEFAULT]
ROW_BYTES, STEP, UPTO = 2048, 256, 32_768  # K of one layer: 8 heads x 128 x 2 bytes
print(f"{fmt_bytes(ROW_BYTES)} per token, grown in {STEP}-token steps to {UPTO:,} tokens")
needs = [n * ROW_BYTES for n in range(STEP, UPTO + 1, STEP)]
for policy in POLICIES:
    handles = simulate_growth(policy, needs, limit_bytes=66 * MiB, gran=2 * MiB)
    print(f"{policy!s:<38} {len(handles):>3} handle{'s' if len(handles) != 1 else ' '}: "
          + ", ".join(fmt_bytes(h) for h in handles[:6]) + (" ..." if len(handles) > 6 else ""))

# %% [markdown]
# ## Many buffers, on the workload the H200 measured
#
# `decode_growth` runs the real thing: for each policy a fresh owner on the chosen driver
# grows all buffers of a model, step by step, and every driver call is counted. `MEASURED`
# below is the workload of the runs above (llama-3.1-8b's 32 layers are the bench's 64
# buffers of 2 KiB per token), with the policies the runs measured. The bandwidth columns
# are *predicted* from the handle sizes by the fitted curve (the ratio to `cudaMalloc`, the
# runs' band, and whether it keeps the target), not measured: `kvvmm bench` measures.
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
MEASURED = {"model": "llama-3.1-8b", "page_size": 64, "tokens": 500_000, "step_tokens": 4096,
            "reserved_tokens": 2_000_000}
MEASURED_POLICIES = [DEFAULT, kvvmm.Exact(), kvvmm.Chunked(64 * MiB), kvvmm.Chunked(128 * MiB),
                     kvvmm.Chunked(256 * MiB), kvvmm.Geometric(2.0, 256 * MiB)]
results = decode_growth(MEASURED_POLICIES, driver=DRIVER, profile=PROFILE, **MEASURED)
predicted = None if DRIVER == "sim" else decode_growth(MEASURED_POLICIES, driver="sim",
                                                       profile=PROFILE, **MEASURED)
print(format_growth(results, profile=PROFILE, predicted=predicted))

# %% tags=["nbval-ignore-output"]
from kvvmm.viz import growth_figure

growth_figure(results, profile=PROFILE, predicted=predicted)

# %% [markdown]
# ## Bands: the driver time as a range
#
# One profile gives one number per policy, and the card does not: the same growth measured
# minutes apart moved by 10-50%, and a day later the shipped profile over-predicted most
# growths by about 30% (`docs/FIDELITY.md`). The H200 profile carries each cost figure's
# **spread**: its p10, p50 and p90 over the rounds and the calibrations kept, computed from
# the committed measurements (kept as shipped since). A band runs the same growth on
# the sim three times, with every figure at its p10, as it is, and at its p90
# (`DeviceProfile.at(q)`), and reports [low, mid, high]. All figures move together, as the
# card's did between runs: the band is not a joint distribution of independent costs.
#
# Those calibrations were all of one hour, and between sessions (another day, another loan
# of the machine) the whole card moved further: 0.64-0.8x the sim on one day, up to 1.5x on
# another. The profile also carries that **session level** per scenario group (construct,
# growth, finalize, close, elastic, startup, decode): the p10-p90 over the sessions measured
# of *measured / the sim's point*. A growth band is widened by the `growth` level where it
# passes 1 (`level=False` gives the per-call band alone). How often a measured run from a
# session left out of the fit landed inside, and how wide the bands were against the card's
# own spread, when that scoring stopped: `bench/results/fidelity-level.json`
# (`docs/FIDELITY.md`).

# %%
from kvvmm.viz.bands import format_growth_bands, growth_band_figure
from kvvmm.workload.bands import band_notes, growth_bands

sim_results = results if predicted is None else predicted
bands = growth_bands(MEASURED_POLICIES, profile=PROFILE, mid=sim_results, **MEASURED)
print(format_growth_bands(sim_results, bands, band_notes(PROFILE)))
per_call = growth_bands(MEASURED_POLICIES, profile=PROFILE, mid=sim_results, level=False,
                        **MEASURED)
print("without the session level (the per-call spread only):")
for r, b in zip(sim_results, per_call, strict=True):
    print(f"  {r.policy:<38} {b.low / 1e3:.1f}-{b.high / 1e3:.1f} ms ({b.width:.0%})")
assert all(w.low <= p.low <= p.high <= w.high for w, p in zip(bands, per_call, strict=True))

# %% tags=["nbval-ignore-output"]
growth_band_figure(sim_results, bands, label=kvvmm.hardware.profile_label(PROFILE))

# %% [markdown]
# A profile gets old: the lab says how old, and on a GPU the drift-prone figures (per-call
# costs by size, first touch, the library's own work) are measured again in about a minute,
# the rest rescaled and the old figures kept as the bands' history:
#
#     kvvmm calibrate --quick --profile h200 --out h200-refreshed.json
#
# then pass `h200-refreshed.json` as the profile.

# %% tags=["nbval-ignore-output"]
from kvvmm.viz.bands import profile_age_line

print(profile_age_line(PROFILE))

# %% [markdown]
# ## The answer
#
# The lab's answer is the last line of the table: of the policies predicted at the target
# or above, the one whose largest over-commit during the growth is smallest
# (`least_over_commit`). The runs give their own answer from their medians, with no model
# between; the cell prints both, and `docs/MEASUREMENTS.md` §4 states the same answer
# (`tests/hardware/test_bandwidth_fit.py` fails if it stops being this one).

# %%
runs = {p.label: p for p in H200_BANDWIDTH.growth}
answer = least_over_commit(results)
by_runs = min((r for r in results if runs[r.policy].median >= BANDWIDTH_TARGET),
              key=lambda r: r.max_over_commit_bytes)
assert answer is not None
print(f"keeps >= {BANDWIDTH_TARGET:g}x with the least over-commit: the lab {answer.policy}, "
      f"the runs' medians {by_runs.policy}")
for r in results:
    p = runs[r.policy]
    print(f"  {r.policy:<38} predicted {r.predicted_ratio.mid:.3f}x, runs {p.median:.3f}x "
          f"(median of {len(p.ratios)}, {sum(x >= BANDWIDTH_TARGET for x in p.ratios)} at "
          f"the target or above); over-commit at most {fmt_bytes(r.max_over_commit_bytes)}")

# %% [markdown]
# ## Shorter buffers: the panel's workload
#
# The same question on buffers a few tens of MiB long (the first layers of the model, a
# short context) has another answer. A policy reaches the large handles that keep the target
# only by backing a large handle early, so on a short buffer the handles stay small, or the
# over-commit is most of what is backed. No run measured buffers this short: the figures
# here extrapolate the fitted curve.

# %%
SHORT = {"model": "llama-3.1-8b", "layers": 8, "tokens": 32_768, "step_tokens": 256}
short = decode_growth(POLICIES, driver=DRIVER, profile=PROFILE, **SHORT)
print(format_growth(short))
best_ratio = max(short, key=lambda r: r.predicted_ratio.mid)
print(f"closest to the target: {best_ratio.policy} at {best_ratio.predicted_ratio.mid:.3f}x, "
      f"over-committing up to {fmt_bytes(best_ratio.max_over_commit_bytes)} on "
      f"{fmt_bytes(best_ratio.needed_bytes)} needed")

# %% tags=["nbval-ignore-output"]
from kvvmm.viz import handle_sizes

handle_sizes({r.policy: list(r.handle_bytes) for r in short})

# %% [markdown]
# ## Reading the tables
#
# - `Exact()` makes a handle per extension, as small as the step allows (at least a
#   granule): the most driver calls, the least over-commit, and the lowest bandwidth.
# - `Chunked(min_bytes)` makes chunk-sized handles, with up to one chunk over-committed per
#   buffer: on a model with many buffers and a short prefix that is most of what is backed
#   (the "max over" column).
# - `Geometric` starts small and doubles: few handles early, bounded over-commit late, and on
#   a long growth handles as large as its cap.
# - The first row of the measured table (the last of the short one) is the owner's default
#   (printed above: `default_policy()`), what every owner given no policy grows with.
#
# The check cells at the end hold each of these to the numbers. `finalize` always backs
# exactly (the size is known, over-commit buys nothing), so policies only matter for
# on-demand growth.
#
# ## Explore
#
# The panel below has run a short workload (its controls show which). Next to each policy is
# its over-commit (backed - needed) on the workload, worked out as you type; change the
# workload or policies and press **Run** (a progress bar shows while it runs). Its table and
# figure give the predicted bandwidth with the runs' band, the target line, and the policy
# that keeps the target with the least over-commit, as above. A value a policy refuses
# shows the error in red over the last results, marked stale.

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
by = {r.policy: r for r in results}
exact = by["Exact()"]
assert answer.policy == by_runs.policy  # the lab and the runs give one answer
# The prose's workload: the table's 1 GiB tensor; the runs' 64 buffers of 2 KiB per token,
# which llama-3.1-8b's 32 layers give.
assert H200_BANDWIDTH.tensor_bytes == GiB
assert H200_BANDWIDTH.growth_workload.startswith("64 buffers of 2 KiB per token (32 layers")
assert results[0].buffers == 64 and results[0].needed_bytes == 64 * 2048 * MEASURED["tokens"]
for r in results:  # each prediction lies in its policy's runs, on the same side of the line
    p = runs[r.policy]
    assert p.low <= r.predicted_ratio.mid <= p.high, r.policy
    assert (r.predicted_ratio.mid >= BANDWIDTH_TARGET) == (p.median >= BANDWIDTH_TARGET)
    assert r.predicted_ratio.low <= r.predicted_ratio.mid <= r.predicted_ratio.high
assert all(r.backed_bytes >= r.needed_bytes for r in (*results, *short))
for b in (*bands, *check.bands):  # every simulated time is a band around the point
    assert 0 < b.low < b.mid < b.high, b
assert [b.mid for b in bands] == [r.sim_us for r in sim_results]
for rs in (results, short):  # Exact: most handles and calls, least over-commit, slowest
    ex = next(r for r in rs if r.policy == "Exact()")
    assert all(ex.handles > r.handles and ex.driver_calls > r.driver_calls
               and ex.max_over_commit_bytes < r.max_over_commit_bytes
               and ex.predicted_ratio.mid < r.predicted_ratio.mid for r in rs if r is not ex)
    step_bytes = (ex.needed_by_step[1] - ex.needed_by_step[0]) // ex.buffers  # one buffer's
    assert ex.max_handle_bytes <= max(2 * MiB, step_bytes)  # as small as a step allows
s_exact, s_chunked, s_geometric, s_default = short
assert s_chunked.max_over_commit_bytes > 0.5 * s_chunked.backed_bytes  # most of what is backed
assert s_geometric.max_handle_bytes < 256 * MiB <= by["Geometric(2, 256.0 MiB)"].max_handle_bytes
assert least_over_commit(short) is None  # short buffers: no policy keeps the target
assert best_ratio.predicted_ratio.mid < BANDWIDTH_TARGET
assert short[-1].policy == results[0].policy == str(DEFAULT)
fit = growth_fit()
assert fit is not None and predicted_ratio([64 * MiB], interleaved=True).mid < BANDWIDTH_TARGET
assert predicted_ratio([GiB]).mid > predicted_ratio([2 * MiB]).mid
assert check.stale and len(check.results) == 4
assert growth_lab.last_error is None and len(growth_lab.results) == 4  # the reader's panel
