# %% [markdown]
# # 08 · Tensor-parallel ranks: one resize, agreed by every rank
#
# A serving engine runs tensor parallelism (TP) as one process per GPU, all in one
# `torch.distributed` process group (torchrun starts them). Each rank keeps the KV buffers of
# its share of the heads, and every rank must serve the **same** number of tokens: if one
# rank failed to back its share while the others kept theirs, the capacities would diverge.
#
# `kvvmm.owner.distributed.DistributedOwner` wraps each rank's own `KvBufferOwner` and makes each
# resize collective, in four phases:
#
# | phase | what each rank does |
# |---|---|
# | prepare | check the arguments, compute the new backing, *create* the handles (no map) |
# | agree | one `all_reduce(MIN)`: which ranks succeeded, and did all ask for the same `n`? |
# | map | map the prepared handles (`Arena.adopt`) |
# | confirm | a second `all_reduce(MIN)` of the map results |
#
# Any failure anywhere, and every rank releases what it prepared or unmaps what it mapped,
# then raises `CollectiveError`. A rank that dies breaks its peers' collective (gloo
# notices at once; a hung one runs into the timeout): the others roll back too.
#
# Here two ranks run on the simulator, on gloo over 127.0.0.1, started by
# `kvvmm.owner.distributed.spawn` (an engine uses torchrun instead). Each rank runs
# `kvvmm.owner.drill.collective_drill(rank, world, fail_rank)`, what a torchrun script would
# call: its own simulated H200, driver and owner for its share of llama-3.1-8b's heads, the
# failing finalize of section 1, then the budget of section 2 and the gathered snapshots of
# section 3.

# %%
from kvvmm.owner.distributed import spawn
from kvvmm.owner.drill import collective_drill
from kvvmm.units import fmt_bytes
from kvvmm.viz import describe, va_map

# %% [markdown]
# ## 1. A world of two ranks; rank 1's third map fails
#
# Both ranks prepare and agree; rank 1 then fails in the middle of its maps. Rank 0 had
# mapped everything: it unmaps it again. Both raise `CollectiveError`, and both snapshots are
# what they were before the call.

# %%
ranks = spawn(collective_drill, 2, 1, timeout_s=120, group_timeout_s=30)
for r in ranks:
    print(f"rank {r.rank}: {r.error}")
    print(f"         cause: {r.cause}; snapshot unchanged: {r.unchanged}")

# %% [markdown]
# ## 2. The collective budget, then a finalize every rank completes
#
# `budget_bytes(headroom)` is the least over ranks of `free - headroom + backed`
# (SGLang's `get_available_gpu_memory(distributed=True)`); `finalize_to_budget` turns it into
# the most tokens that fit and finalizes every rank to them.

# %%
for r in ranks:
    print(f"rank {r.rank}: budget {fmt_bytes(r.budget_bytes)} -> {r.tokens} tokens, "
          f"{fmt_bytes(r.backed_bytes)} backed")

# %% [markdown]
# ## 3. All ranks, gathered on rank 0
#
# `gather_snapshot(dst=0)` sends every rank's `OwnerSnapshot` to rank 0 as one `TpSnapshot`
# (`gather_object`): what the lab draws for a TP=8 cache, here for TP=2.

# %%
tp = ranks[0].gathered
print(f"{tp.model}, TP={tp.tp}: {fmt_bytes(tp.backed_bytes)} backed of "
      f"{fmt_bytes(tp.reserved_bytes)} reserved on all ranks")
print(describe(tp.owners[1]).splitlines()[0])

# %% tags=["nbval-ignore-output"]
for rank, snap in enumerate(tp.owners):
    va_map(snap, title=f"rank {rank} of {tp.tp}").show()

# %% [markdown]
# ## 4. The same calls on an H200
#
# `tests/gpu/test_gpu_distributed.py` runs a collective finalize, an injected map fault and
# a shrink on a real GPU over NCCL, and keeps what it measured in
# `bench/results/h200-gpu-distributed.json`; the cell reads it (when this checkout has it).

# %%
import json
from pathlib import Path


def repo_file(rel: str) -> Path | None:
    """``rel`` in this checkout, looked for above the notebook's folder (None without it)."""
    for folder in (Path.cwd(), *Path.cwd().parents):
        if (folder / rel).is_file():
            return folder / rel
    return None


GPU_RUN = repo_file("bench/results/h200-gpu-distributed.json")
if GPU_RUN is not None:
    gpu = json.loads(GPU_RUN.read_text())
    print(f"{gpu['device_name']}, {gpu['backend']}, a world of {gpu['gathered_tp']}: "
          f"collective finalize({gpu['final_tokens']:,}) {gpu['collective_finalize_ms']:.1f} "
          f"ms against {gpu['plain_finalize_ms']:.1f} ms for the owner's own finalize; a "
          f"fault in {gpu['fault']['phase']} rolled back: {gpu['fault']['rolled_back']}, "
          f"snapshot unchanged: {gpu['fault_unchanged']}")
else:
    print("bench/results/h200-gpu-distributed.json is not here: no H200 measurement")

# %%
# The notebook's claims, checked.
assert all("aborted on every rank in map" in r.error for r in ranks)
assert all(r.unchanged for r in ranks)
assert "DriverOutOfMemoryError" in ranks[1].cause and ranks[0].cause is None
assert len({r.budget_bytes for r in ranks}) == 1 and len({r.tokens for r in ranks}) == 1
assert [o.final_tokens for o in tp.owners] == [ranks[0].tokens] * 2
assert tp.owners[0].backed_bytes == tp.owners[1].backed_bytes == ranks[0].backed_bytes
assert ranks[1].gathered is None
# The prose's claims, each against what ran.
assert [r.rank for r in ranks] == [0, 1] and all(r.world == 2 for r in ranks)
assert all(r.backend == "gloo" for r in ranks) and tp.tp == 2
# the budget: the least over ranks of free - headroom + backed
assert ranks[0].budget_bytes == min(r.own_budget_bytes for r in ranks)
for r in ranks:  # the most tokens that fit it: one more would not
    assert r.fit_bytes[0] <= r.budget_bytes < r.fit_bytes[1]
if GPU_RUN is not None:  # on the GPU too, a failed collective changed nothing
    assert gpu["fault"]["rolled_back"] and gpu["fault_unchanged"]
