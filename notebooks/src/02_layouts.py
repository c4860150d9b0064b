# %% [markdown]
# # 02 · Layouts and capacity
#
# What an owner lays out depends on the model's attention geometry, the KV dtype, the page
# size and tensor parallelism (TP). This notebook goes from model configs to buffers to a
# capacity plan: how many tokens fit a GPU, how much VA to reserve, and what the
# granularity wastes. Everything here is arithmetic: no driver is needed.

# %%
from kvvmm.hardware import predicted_ratio
from kvvmm.layout import (
    kv_bytes_per_token,
    list_models,
    load_model,
    mha_token_major,
    page_major,
    plan,
    plan_smallest_tp,
)
from kvvmm.units import GiB, MiB, fmt_bytes
from kvvmm.viz import format_plan, handles_by_policy, tokens_by_tp, waste_by_model

# %% [markdown]
# ## Model configs
#
# kvvmm ships a few public models' attention fields (from their Hugging Face configs). KV
# bytes per token: `2 (K and V) x layers x kv_heads x head_dim x itemsize` for MHA/GQA;
# MLA models (DeepSeek) keep one latent of `kv_lora_rank + qk_rope_head_dim` per layer.
# Sliding-window layers (gpt-oss, Gemma 3) go to a second, window-sized pool.

# %%
print(f"{'model':<15}{'layers':>7}{'kv heads':>9}{'head dim':>9}  {'kind':<10}"
      f"{'bf16 / token':>13}")
for key in list_models():
    m = load_model(key)
    kind = "MLA" if m.is_mla else f"SWA {len(m.sliding_layers)}" if m.is_hybrid_swa else "GQA"
    print(f"{key:<15}{m.num_layers:>7}{m.num_kv_heads:>9}{m.head_dim:>9}  {kind:<10}"
          f"{fmt_bytes(kv_bytes_per_token(m, 'bfloat16')):>13}")

# %% [markdown]
# ## Spans: token-major and page-major
#
# A buffer's **prefix span** for `n` tokens is what must be backed to use the first `n`
# slots; its **final span** adds the padded page. Token-major buffers have one row per
# token; page-major (HND, as paged kernels read it) one row per page, so spans move in
# whole pages.

# %%
tm = mha_token_major(layers=1, kv_heads=8, head_dim=128, reserved_tokens=1024,
                     page_size=16, dtype="bfloat16")[0]
pm = page_major(layers=1, kv_heads=8, head_dim=128, reserved_tokens=1024, page_size=16,
                dtype="bfloat16")[0]
for d in (tm, pm):
    print(f"{d.name} shape {d.shape}: row {fmt_bytes(d.row_bytes)} holds "
          f"{d.tokens_per_row} tokens; prefix(17) {d.prefix_span_bytes(17, 16):,} B, "
          f"final(17) {d.final_span_bytes(17, 16):,} B")

# %% [markdown]
# ## A plan
#
# `plan()` sizes the pool as SGLang does after capture: budget = free - headroom + backed,
# tokens = budget // bytes per token, in whole pages. It then reports the VA to reserve,
# what finalize backs, and how many handles each growth policy creates on the way.

# %%
p = plan(gpu="h200", model="llama-3.1-8b", dtype="bfloat16", page_size=16, tp=1)
print(format_plan(p))

# %% [markdown]
# ## Tensor parallelism
#
# TP shards the KV heads: each rank stores `kv_heads / tp` heads, so the same GPU holds
# more tokens per rank. Past `tp = kv_heads` heads are replicated: the bytes per token per
# rank stop falling (the tokens still grow, by less, as each rank holds less of the weights).

# %%
by_tp = [plan(gpu="h200", model="llama-3.1-70b", tp=tp) for tp in (2, 4, 8, 16)]
for q in by_tp:
    print(f"llama-3.1-70b tp {q.tp:>2}: {fmt_bytes(q.bytes_per_token):>9} per token per "
          f"rank -> {q.tokens:>9,} tokens, VA {fmt_bytes(q.va_reserve_bytes)}")

# %% tags=["nbval-ignore-output"]
tokens_by_tp(by_tp)

# %% [markdown]
# ## Every model on two GPUs, and the granularity's cost
#
# The granularity (the GPU's allocation unit) rounds each buffer's backing up: a model
# with many small buffers wastes up to one granule per buffer. The padded page costs one
# page per buffer. Each
# model runs at the smallest TP (1, 2, 4, 8 or 16) its weights fit at, leaving room for KV
# (`plan_smallest_tp`: the planner refuses a TP at which they do not fit).

# %%
every = [plan_smallest_tp(gpu=gpu, model=key, dtype="bfloat16")
         for gpu in ("h200", "b200") for key in list_models()]
for q in every:
    print(f"{q.gpu} {q.model:<14} tp {q.tp} {q.tokens:>10,} tokens in {q.num_buffers:>3} "
          f"buffers, waste {fmt_bytes(q.granularity_waste_bytes):>9}, "
          f"padding {fmt_bytes(q.padding_bytes):>9}")

# %% tags=["nbval-ignore-output"]
waste_by_model([q for q in every if q.gpu == "h200"])

# %%
for page in (1, 16, 64):
    q = plan(gpu="h200", model="mistral-7b", page_size=page, budget_bytes=40 * GiB)
    print(f"page {page:>2}: {q.tokens:,} tokens, padding {fmt_bytes(q.padding_bytes)}, "
          f"granularity waste {fmt_bytes(q.granularity_waste_bytes)}, "
          f"over budget {fmt_bytes(q.over_budget_bytes)}")

# %% [markdown]
# ## Handles per growth policy
#
# How many handles each policy creates while the pool grows to its planned capacity:
# fewer, larger handles copy faster (`03_growth`; the check cell holds it to the fitted
# bandwidth curve).

# %%
for h in p.handles:
    print(f"{h.policy:<38} {h.handles:>6,} handles")

# %% tags=["nbval-ignore-output"]
handles_by_policy(p)

# %% [markdown]
# ## Explore
#
# The panel re-plans on every change and draws the finalized full-attention pool on the
# simulator of the chosen GPU: here llama-3.1-70b at TP 8, all its buffers. A change the
# planner refuses shows the error in red over the last good plan, marked stale. The cell
# after it checks the controls from code, on a panel of its own.

# %% tags=["nbval-ignore-output"]
from kvvmm.lab import LayoutExplorer

explorer = LayoutExplorer(model="llama-3.1-70b", gpu="h200", tp=8)
explorer

# %%
check = LayoutExplorer(model="deepseek-v3", gpu="h200", tp=8)  # its fp8 weights fit 8 ranks
# MLA: the latent is not sharded, every rank keeps it whole
mla = check.plan
print("\n".join(check.text.splitlines()[:7]))
check.model.value = "llama-3.1-8b"
check.tp.value = 3  # refused: 8 KV heads do not split over 3 ranks
print(check.error_text)
print("stale:", check.stale)

# %%
# The planner's invariants, checked on every shipped model.
for q in every:
    full = q.pools[0]
    assert full.tokens % q.page_size == 0
    assert full.tokens * full.bytes_per_token <= full.budget_bytes
    assert full.budget_bytes < (full.tokens + q.page_size) * full.bytes_per_token
    assert q.va_reserve_bytes >= q.final_backed_bytes
    assert q.va_reserve_bytes % q.granularity_bytes == 0
assert check.stale and check.plan.model == "llama-3.1-8b" and check.plan.tp == 8

# The prose's claims, each against the package.
for key in list_models():  # KV bytes per token, as the model configs section states it
    m = load_model(key)
    per_layer = (m.kv_lora_rank + m.qk_rope_head_dim if m.is_mla
                 else 2 * m.num_kv_heads * m.head_dim)
    full = m.num_layers - len(m.sliding_layers)  # sliding-window layers: the second pool
    assert kv_bytes_per_token(m, "bfloat16") == per_layer * full * 2, key
assert load_model("gpt-oss-120b").is_hybrid_swa and load_model("gemma-3-27b").is_hybrid_swa
assert load_model("deepseek-v3").is_mla
assert (tm.tokens_per_row, pm.tokens_per_row) == (1, 16)  # a row per token, a row per page
for d in (tm, pm):  # the final span adds the padded page
    assert d.final_span_bytes(17, 16) == d.prefix_span_bytes(17, 16) + 16 * d.row_bytes // \
        d.tokens_per_row
assert p.budget_bytes == p.free_bytes - p.headroom_bytes + p.backed_bytes  # the plan's budget
heads = load_model("llama-3.1-70b").num_kv_heads  # TP shards KV heads up to tp = kv_heads
for q in by_tp:
    assert q.bytes_per_token == by_tp[0].bytes_per_token * by_tp[0].tp // min(q.tp, heads)
past, at = by_tp[-1], next(q for q in by_tp if q.tp == heads)  # past it: replicated
assert past.tp > heads and past.bytes_per_token == at.bytes_per_token
assert at.tokens < past.tokens < 2 * at.tokens  # the weights' share only
for q in every:  # at most one granule of waste, and one padded page, per buffer
    assert q.granularity_waste_bytes < q.num_buffers * q.granularity_bytes
    if len(q.pools) == 1:
        assert q.padding_bytes == q.page_size * q.bytes_per_token
assert predicted_ratio([GiB]).mid > predicted_ratio([2 * MiB]).mid  # larger handles copy faster
assert all(h.handles >= p.handles[0].handles or h.max_handle_bytes > p.handles[0].max_handle_bytes
           for h in p.handles)  # Exact makes the most, smallest handles
assert explorer.plan.num_buffers == 2 * load_model("llama-3.1-70b").num_layers  # all buffers
assert mla.model == "deepseek-v3" and mla.tp == 8 and mla.tokens > 0
assert mla.bytes_per_token == kv_bytes_per_token(load_model("deepseek-v3"), "bfloat16")  # whole
assert load_model("llama-3.1-8b").num_kv_heads % 3 != 0 and "divisor" in check.error_text
assert explorer.last_error is None and explorer.plan.tp == 8  # the reader's panel
