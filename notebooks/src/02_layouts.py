# %% [markdown]
# # 02 · Layouts and capacity
#
# What an owner lays out depends on the model's attention geometry, the KV dtype, the page
# size and tensor parallelism (TP). This notebook goes from model configs to buffers to a
# capacity plan: how many tokens fit a GPU, how much VA to reserve, and what the
# granularity wastes. Everything here is arithmetic: no driver is needed.

# %%
from kvvmm.layout import (
    kv_bytes_per_token,
    list_models,
    load_model,
    mha_token_major,
    page_major,
    plan,
)
from kvvmm.units import GiB, fmt_bytes
from kvvmm.viz import format_plan

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
# more tokens per rank. Past `tp = kv_heads` heads are replicated, and the gain stops.

# %%
for tp in (1, 2, 4, 8, 16):
    q = plan(gpu="h200", model="llama-3.1-70b", tp=tp)
    print(f"llama-3.1-70b tp {tp:>2}: {fmt_bytes(q.bytes_per_token):>9} per token per "
          f"rank -> {q.tokens:>9,} tokens, VA {fmt_bytes(q.va_reserve_bytes)}")

# %% [markdown]
# ## Every model on two GPUs, and the granularity's cost
#
# The granularity (2 MiB) rounds each buffer's backing up: a model with many small
# buffers wastes up to 2 MiB per buffer. The padded page costs one page per buffer.

# %%
for gpu in ("h200", "b200"):
    for key in list_models():
        q = plan(gpu=gpu, model=key, dtype="bfloat16")
        print(f"{gpu} {key:<14} {q.tokens:>10,} tokens in {q.num_buffers:>3} buffers, "
              f"waste {fmt_bytes(q.granularity_waste_bytes):>9}, "
              f"padding {fmt_bytes(q.padding_bytes):>9}")

# %%
for page in (1, 16, 64):
    q = plan(gpu="h200", model="mistral-7b", page_size=page, budget_bytes=40 * GiB)
    print(f"page {page:>2}: {q.tokens:,} tokens, padding {fmt_bytes(q.padding_bytes)}, "
          f"granularity waste {fmt_bytes(q.granularity_waste_bytes)}, "
          f"over budget {fmt_bytes(q.over_budget_bytes)}")

# %% [markdown]
# ## Explore
#
# The panel re-plans on every change and draws the finalized full-attention pool on the
# simulator of the chosen GPU. The cell after it sets the controls from code.

# %% tags=["nbval-ignore-output"]
from kvvmm.lab import LayoutExplorer

explorer = LayoutExplorer(model="llama-3.1-8b", gpu="h200")
explorer

# %%
explorer.model.value = "deepseek-v3"
explorer.tp.value = 8  # MLA: the latent is not sharded, every rank keeps it whole
print("\n".join(explorer.text.splitlines()[:7]))
explorer.tp.value = 3  # refused for GQA models whose heads do not split; MLA ignores tp
explorer.model.value = "llama-3.1-8b"
print(explorer.error_text)

# %%
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
