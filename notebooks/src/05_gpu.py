# %% [markdown]
# # 05 · Real memory: CUDA, or the host driver
#
# The other notebooks run on the simulator. This one uses real memory: the CUDA driver
# when a GPU is usable (`open_driver("auto")`), otherwise the **host driver**, which
# implements the same calls over Linux host memory (`mmap` reservations, `memfd` handles)
# so that touching unbacked VA faults just as it does on a GPU.
#
# Cells that print facts of the machine (device name, addresses, free memory) are tagged
# so that nbval does not compare them; the others print what holds on any driver.

# %% tags=["nbval-ignore-output"]
import kvvmm
from kvvmm.units import MiB, fmt_bytes
from kvvmm.viz import describe, describe_stats, va_map

# This notebook wants real memory: "sim" (the tests' default) becomes "auto" here.
drv = kvvmm.driver_for(kvvmm.notebook_driver_kind(real_memory=True))
print(drv.kind, "driver on", drv.name, "granularity", fmt_bytes(drv.granularity()))
free_bytes, total_bytes = drv.mem_info()
print(f"{fmt_bytes(free_bytes)} free of {fmt_bytes(total_bytes)}")

# %% [markdown]
# ## An owner over real memory
#
# Two layers, 4096 tokens. Slot 0 is backed at construction, so writing token 0 works at
# once.

# %%
descs = kvvmm.mha_token_major(layers=2, kv_heads=8, head_dim=128, reserved_tokens=4096,
                              page_size=16, dtype="bfloat16")
owner = kvvmm.KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16,
                            reserved_tokens=4096, descs=descs)
k0 = owner.tensors[0]
KV_ELEMENTS = k0[0].numel()  # one token of one buffer: kv_heads x head_dim
k0[0].fill_(1.5)
token0 = float(k0[0].float().sum())
print(f"k0 {tuple(k0.shape)} {k0.dtype}: token 0 sums to {token0}")
print(f"{len(owner.tensors)} buffers, {owner.snapshot().handles} handles, "
      f"{owner.backed_bytes // MiB} MiB backed")

# %% tags=["nbval-ignore-output"]
print(describe(owner.snapshot()))

# %% [markdown]
# ## Finalize, then write the last token
#
# After `finalize(3000)` tokens 0..2999 are backed (and the padded page after them).
# Writing beyond the backed span would fault (a segfault on the host driver, an illegal
# address on a GPU), which is why kvvmm checks every span before it commits and never
# clamps.

# %%
owner.finalize(3000)
finalized = owner.snapshot()
k0[2999].fill_(2.0)
print(f"tokens 0 and 2999 sum to {float(k0[:3000].float().sum())}; "
      f"{owner.backed_bytes // MiB} MiB backed in {owner.snapshot().handles} handles")

# %% tags=["nbval-ignore-output"]
va_map(owner.snapshot())

# %% [markdown]
# ## Close never pulls memory from under a live tensor
#
# `close()` gives everything back, unless a tensor made over the arena is still alive: then
# the arena is marked closed and its memory goes when the last such tensor goes. (The seed,
# SGLang's `kv_vmm_backing.py` that kvvmm follows,
# aborted at exit with "invalid device pointer" for want of this.)

# %%
owner.close()
released_while_held = owner.arena.released
print("closed:", owner.closed, "| memory given back:", owner.arena.released)
print("k0 still reads", float(k0[0].float().sum()))
del k0
print("after del k0, memory given back:", owner.arena.released)
print(describe_stats(drv.stats()))

# %%
# The notebook's claims, checked.
assert token0 == 1.5 * KV_ELEMENTS  # slot 0 backed at construction: token 0 written at once
gran = finalized.arena.granularity  # finalize(3000): 3000 tokens and the padded page backed
assert finalized.final_tokens == 3000
assert all(b.backed_bytes == -(-b.final_bytes // gran) * gran >= b.final_bytes
           >= (3000 + 16) * d.row_bytes for b, d in zip(finalized.buffers, descs, strict=True))
assert owner.closed and not released_while_held  # a live tensor kept the memory
assert owner.arena.released  # until it went
assert drv.stats().clean, drv.stats()
