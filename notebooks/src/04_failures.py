# %% [markdown]
# # 04 · Failures: fault injection, bad input, recovery
#
# Every multi-step change in kvvmm is a **transaction**: if any driver call fails, the
# calls before it are undone, nothing leaks, the snapshot is as it was, and the error is
# re-raised (with any failure of the undo attached as a note). Bad input is refused before
# any driver call. This notebook proves both with `FaultyDriver`, which fails chosen calls
# with chosen CUDA errors, and shows how to recover.

# %%
import kvvmm
from kvvmm.driver import Fault, FaultyDriver
from kvvmm.units import MiB, fmt_bytes
from kvvmm.viz import describe, describe_stats

# `kvvmm lab` sets KVVMM_DRIVER (cuda on a GPU machine). Without it, and under nbval,
# the notebooks run on the simulator, whose addresses and costs are deterministic.
DRIVER = kvvmm.notebook_driver_kind()

descs = kvvmm.mha_token_major(layers=2, kv_heads=8, head_dim=128, reserved_tokens=16_384,
                              page_size=16, dtype="bfloat16")


def make_owner(driver: kvvmm.Driver,
               policy: kvvmm.GrowthPolicy | None = None) -> kvvmm.KvBufferOwner:
    return kvvmm.KvBufferOwner(driver=driver, dtype="bfloat16", page_size=16,
                               reserved_tokens=16_384, descs=descs,
                               policy=policy or kvvmm.Exact())


def show(e: Exception) -> None:
    print(f"{type(e).__name__}: {e}")
    for note in getattr(e, "__notes__", []):
        print("  note:", note)


# %% [markdown]
# ## A failure during construction
#
# The owner backs slot 0 of its 4 buffers while it is constructed: 4 creates. Make the
# 3rd one run out of memory: construction fails, and the two handles already made, the
# tensors and the reservation are all given back.

# %%
faulty = FaultyDriver(kvvmm.driver_for(DRIVER, profile="h200"), fail={"create": 3})
try:
    make_owner(faulty)
except kvvmm.DriverError as e:
    show(e)
construction_calls, after_construction = list(faulty.calls), faulty.stats()
print("calls:", " ".join(faulty.calls))
print("driver holds:", describe_stats(faulty.stats()))

# %% [markdown]
# ## A failure while growing
#
# With the fault spent, construction works. Now fail the 2nd `map` of the next growth:
# `ensure_prefix` had created and mapped the first buffer's extension, so it unmaps and
# releases it again. The snapshot is exactly as before.

# %%
owner = make_owner(faulty)
before = owner.snapshot()
faulty.arm(Fault(call="map", nth=2, error="CUDA_ERROR_UNKNOWN"))
calls_at = len(faulty.calls)
try:
    owner.ensure_prefix(4096)
except kvvmm.DriverError as e:
    show(e)
growth_calls = faulty.calls[calls_at:]
print("snapshot unchanged:", owner.snapshot() == before)
print(describe(owner.snapshot()))

# %% [markdown]
# ## Every position, every kind of call
#
# A small fault matrix: fail the n-th `create`, `map` or `set_access` of a 4-buffer
# growth and check that the snapshot and the driver's own accounting are unchanged.
# (`tests/` runs the full matrix on every operation.)

# %%
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

# %% [markdown]
# ## Bad input
#
# Wrong values are refused before any driver call, with a message that names the value,
# the limit and often the fix. kvvmm never clamps.

# %%
calls_before, refused = len(faulty.calls), 0
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
        refused += 1
bad_input_calls = len(faulty.calls) - calls_before
print("driver calls made by the bad input:", bad_input_calls)

# %% [markdown]
# ## Out of memory, and recovering from it
#
# A simulated GPU with 64 MiB free: finalizing 16k tokens needs more, so `create` fails
# with `CUDA_ERROR_OUT_OF_MEMORY` and everything is undone. Finalizing to what fits works.

# %%
small = kvvmm.SimDriver("h200", capacity_bytes=64 * MiB)
tight = make_owner(small)
before_oom = small.stats()
try:
    tight.finalize(16_384)
except kvvmm.DriverOutOfMemoryError as e:
    show(e)
after_oom = small.stats()
print(describe_stats(small.stats()))
free, _ = small.mem_info()
fits = (free // (4 * 2048)) // 16 * 16 - 16  # per token: 4 buffers x 2 KiB; keep a page
print(f"{fmt_bytes(free)} free -> finalize({fits})")
tight.finalize(fits)
fitted = tight.snapshot()
print(describe(fitted))
tight.close()

# %% [markdown]
# ## The lab shows errors too
#
# An `ArenaLab` on a faulty driver: it reserved KV buffers, then `Finalize` of 4096 tokens
# hit an injected `set_access` failure. The failure appears in red in the panel, and the
# map and the summary stay as they were (slot 0 backed only), because the library undid
# every call. Press **Finalize** again: the fault is spent (it failed one call), and it
# works.

# %% tags=["nbval-ignore-output"]
from kvvmm.lab import ArenaLab


def faulty_lab() -> tuple[ArenaLab, FaultyDriver]:
    """An ArenaLab whose finalize(4096) fails on its first set_access."""
    d = FaultyDriver(kvvmm.SimDriver("h200"))
    panel = ArenaLab(driver=d, layers=2, reserved_tokens=8192)
    panel.reserve_kv_button.click()
    d.arm(Fault(call="set_access", nth=1, error="CUDA_ERROR_UNKNOWN"))
    panel.tokens.value = 4096
    panel.finalize_button.click()
    return panel, d


lab, lab_driver = faulty_lab()
lab

# %% [markdown]
# The cells below check the same on a panel of their own (the one above stays as it is):
# the error, the unchanged snapshot, and recovery once the fault is gone.

# %%
check, check_driver = faulty_lab()
failed = check.snapshot()
print(check.error_text)
print(describe(failed))
check.finalize_button.click()  # recovery: the same click works, the fault spent
print(check.error_text or "finalize(4096): ok,", fmt_bytes(check.snapshot().backed_bytes),
      "backed")

# %%
owner.finalize(8192)
owner.close()
check.close_button.click()
print(describe_stats(faulty.stats()), "|", describe_stats(check_driver.stats()))

# %%
assert all(rows), rows
# The prose's claims, each against what ran.
assert len(descs) == 4 and construction_calls.count("create") == 3  # the 3rd of 4 failed
assert construction_calls.count("release") == 2 and after_construction.clean  # all back
assert growth_calls.count("map") == 2  # the growth stopped at its 2nd map
first_map = growth_calls.index("map")  # the first buffer's extension: unmapped and released
assert {"unmap", "release"} <= set(growth_calls[first_map + 1:])
assert refused == 5 and bad_input_calls == 0  # refused before any driver call
need = 16_384 * sum(d.row_bytes for d in descs)  # finalizing 16k tokens needs more
assert small.mem_info()[1] == 64 * MiB < need and after_oom == before_oom  # undone
assert fitted.final_tokens == fits  # what fits, works
assert failed.backed_bytes == len(failed.buffers) * failed.arena.granularity  # slot 0 only
assert faulty.stats().clean and small.stats().clean and check_driver.stats().clean
assert len(faulty.injected) >= 8
assert check.last_error is None
assert "CUDA_ERROR_UNKNOWN" in lab.error_text  # the reader's panel shows the failure
