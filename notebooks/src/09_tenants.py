# %% [markdown]
# # 09 · Tenants: two models sharing one GPU's KV budget
#
# kvcached's users most often ask for several models on one GPU, each KV pool growing and
# shrinking into one shared budget. This notebook asks the question that decides whether it
# is worth it:
#
# > **Two models on one simulated H200 with a KV budget too small for both peaks: does
# > elastic sharing serve (nearly) what each model serves alone on the whole budget, where a
# > fixed half-half split does not?**
#
# Two tenants: llama-3.1-8b and qwen2.5-7b (TP1), each serving five minutes of traffic from
# the generator fitted to Azure's conversation trace (other seeds; the second starts 150 s
# later), on a real `KvBufferOwner` each, over one sim driver whose capacity is the budget.
# The arbiter's rules (budget, per-tenant limit, shed order, deadline) are in
# `kvvmm.workload.tenants`' docstring; `kvvmm replay --tenants` runs the same with the real
# trace (docs/TENANTS.md has those numbers). Requests wait at most 30 s in a queue; one that
# waited longer is dropped and counted rejected, so "served" is what the engine could serve.
# The last section drives the real broker, `kvvmm.budget` (a ledger file every engine process
# maps), with two owners on the sim driver: the same rules, booked across processes.

# %%
from IPython.display import Markdown, display

from kvvmm.layout import kv_bytes_per_token, load_model
from kvvmm.units import fmt_bytes
from kvvmm.viz.tenants import format_tenants, tenants_figure
from kvvmm.workload import generate
from kvvmm.workload.tenants import ANSWERS, Demand, Tenant, compare_tenants, shifted

GiB = 1 << 30
BUDGET = 2 * GiB
llama = Tenant("llama-3.1-8b", "llama-3.1-8b", generate(seed=0, duration_s=300.0))
qwen = Tenant("qwen2.5-7b", "qwen2.5-7b", shifted(generate(seed=1, duration_s=300.0), 150.0))
print(f"budget {fmt_bytes(BUDGET)}; requests: llama {len(llama.workload):,}, "
      f"qwen {len(qwen.workload):,}")

# %% [markdown]
# ## Alone, split, shared
#
# Each tenant alone on the whole budget (all of it backed: the whole card), then both with a
# static split (each backs its half before serving), then both elastic (one budget; a
# tenant's growth that does not fit asks the other to give back idle backing, within the
# deadline, else waits or preempts its own requests).

# %%
runs = compare_tenants([llama, qwen], budget_bytes=BUDGET)
print(format_tenants(runs))

# %%
alone = {t: runs[f"alone {t}"].tenants[0].served for t in (llama.name, qwen.name)}
share = {label: {t.name: t.served / alone[t.name] for t in runs[label].tenants}
         for label in ("static", "elastic")}
for label, s in share.items():
    print(f"{label:8s}", "  ".join(f"{k}: {v:.1%} of alone" for k, v in s.items()))

# %% [markdown]
# What the table says, read from it (the next cell writes the sentences from the numbers above;
# the check cells at the end hold the same claims):

# %%
def pct(x: float) -> str:
    return f"{x:.1%}"


per_token = {t.name: kv_bytes_per_token(load_model(t.model), "bfloat16") for t in (llama, qwen)}
served = {label: sum(t.served for t in runs[label].tenants) for label in ("static", "elastic")}
peak_sum = max(sum(row) for row in runs["elastic"].held_bytes)
short = [k for k, v in share["static"].items() if v < 0.95]
display(Markdown(
    f"Split half-half, {llama.name} serves {pct(share['static'][llama.name])} of what it "
    f"serves alone and {qwen.name} {pct(share['static'][qwen.name])}: "
    f"{llama.name}'s KV takes {fmt_bytes(per_token[llama.name])} per token against "
    f"{qwen.name}'s {fmt_bytes(per_token[qwen.name])} "
    f"({per_token[llama.name] / per_token[qwen.name]:.1f}x), so "
    + (f"the half is too small for the bursts of {' and '.join(short)}. " if short
       else "both fit their halves. ")
    + f"Sharing elastically, {llama.name} serves {pct(share['elastic'][llama.name])} and "
    f"{qwen.name} {pct(share['elastic'][qwen.name])} of alone: "
    + ("both at least 95%" if min(share["elastic"].values()) >= 0.95
       else "not both at least 95%")
    + f", {served['elastic']:,} requests served in all against {served['static']:,} with the "
    f"split. The chart is every tenant's backing over time, stacked, under the budget line: "
    f"the top edge reaches {fmt_bytes(peak_sum)} at most, of the {fmt_bytes(BUDGET)} budget."))

# %% tags=["nbval-ignore-output"]
tenants_figure(runs["elastic"], title="elastic sharing: backing of each tenant")

# %% [markdown]
# ## A second engine takes memory mid-trace
#
# llama-3.1-8b serves alone with the whole budget; at 60 s a second engine
# wants 1 GiB of it at once and waits at most five seconds. Three answers: **reject** (the
# newcomer gets only what is free), **shed** (idle backing goes back at once, then every
# granule that empties as requests finish), **preempt** (idle backing, then llama preempts
# its most recent requests until the newcomer fits).

# %%
step = Demand("newcomer", at_s=60.0, nbytes=1 << 30, patience_s=5.0)
first = Tenant(llama.name, llama.model, llama.workload.first(120.0))
answers = compare_tenants([first], budget_bytes=BUDGET, demand=step)
print(format_tenants(answers))
for k, r in answers.items():
    print(f"{k:8s} newcomer held at most {fmt_bytes(r.demands[0].peak_held_bytes)}")

# %% [markdown]
# Each answer against refusing (which leaves llama as if the newcomer had not come), from the
# table above:

# %%
base, shed_t = answers["reject"].tenants[0], answers["shed"].tenants[0]


def answered(label: str) -> str:
    t, d = answers[label].tenants[0], answers[label].demands[0]
    got = (f"gets its {fmt_bytes(d.nbytes)} after {d.wait_s:.1f} s" if d.granted else
           f"holds at most {fmt_bytes(d.peak_held_bytes)} of its {fmt_bytes(d.nbytes)} "
           f"within its {step.patience_s:g} s and is refused")
    lost = base.served - t.served
    cost = (f"{llama.name} serves {lost:,} fewer requests ({t.rejected:,} dropped from the "
            f"queue)" if lost > 0 else f"{llama.name} serves as many requests")
    return (f"**{label}**: the newcomer {got}; {cost} and preempts {t.preempted:,} times "
            f"against {base.preempted:,}")


display(Markdown(
    f"**reject**: the newcomer holds at most "
    f"{fmt_bytes(answers['reject'].demands[0].peak_held_bytes)}; {llama.name} serves "
    f"{base.served:,} requests and preempts {base.preempted:,} times.\n\n"
    f"{answered('shed')}. The shed itself gives back only idle backing (memory no request "
    f"uses), but {llama.name} then runs on what the newcomer leaves it"
    + (": it serves less and preempts more" if shed_t.served < base.served
       and shed_t.preempted > base.preempted else "")
    + f".\n\n{answered('preempt')}."))

# %% [markdown]
# Why preempting can do worse than shedding: llama's backing grows in 16 MiB chunks (one
# handle each) and a handle goes back only whole, so preempted requests free pages scattered
# over handles that other requests still touch. Compacting before giving back (moving
# requests' pages) is what it would need; the lab does not model it.

# %% tags=["nbval-ignore-output"]
tenants_figure(answers["shed"], title="a 1 GiB step at 60 s, answered by shedding")

# %% [markdown]
# ## The real broker: two tenants in one ledger
#
# Everything above is the lab's arbiter on one simulated clock. On a GPU the tenants are
# separate engine processes, and the broker is `kvvmm.budget` (docs/BUDGET.md): a ledger file
# every process maps, in which each registers as a tenant; its owner's driver is a
# `BudgetedDriver`, which books every create to the tenant before it happens and every release
# back after it. Here two owners on the sim driver (two layers each: 4 buffers of 2 KiB per
# token, `Exact()` growth) share a small budget, each through its own `Ledger` object on one
# file in a temporary folder, as two processes would. `llama` refuses at once when the budget
# is full (`shed_wait_s=0`); `qwen` asks the others to shed and waits for them (up to
# `shed_wait_s=5` seconds).

# %%
import tempfile
from pathlib import Path

import kvvmm
from kvvmm.budget import BudgetedDriver, BudgetExceededError, Ledger, ShedRequest
from kvvmm.lab import BudgetLab
from kvvmm.lab.budget_lab import ledger_figure
from kvvmm.units import MiB

folder = tempfile.TemporaryDirectory()  # a GPU's ledger lives in /dev/shm by default
ledger_path = Path(folder.name) / "kvvmm-budget-gpu0"
ledgers = {"llama": Ledger(ledger_path, budget_bytes=96 * MiB), "qwen": Ledger(ledger_path)}
tenants = {"llama": ledgers["llama"].register("llama", limit_bytes=80 * MiB, shed_wait_s=0.0),
           "qwen": ledgers["qwen"].register("qwen", shed_wait_s=5.0)}
PAGE = 16
kv = kvvmm.mha_token_major(layers=2, kv_heads=8, head_dim=128, reserved_tokens=16_384,
                           page_size=PAGE, dtype="bfloat16")
owners = {name: kvvmm.KvBufferOwner(driver=BudgetedDriver(kvvmm.SimDriver("h200"), t),
                                    dtype="bfloat16", page_size=PAGE, reserved_tokens=16_384,
                                    descs=kv, policy=kvvmm.Exact(), name=name)
          for name, t in tenants.items()}
labels: list[str] = []  # each step, and the ledger after it (bytes)
steps: list[dict[str, int]] = []


def book(step: str) -> None:
    """Record what the ledger books after ``step``, read through a snapshot as
    ``kvvmm budget show`` reads it."""
    snap = ledgers["qwen"].snapshot()
    row = {"free": snap.free_bytes}
    for t in snap.tenants:
        row |= {t.name: t.backed_bytes, f"{t.name} limit": t.limit_bytes,
                f"{t.name} asked": t.shed_bytes}
    labels.append(step)
    steps.append(row)


book("both owners made (slot 0)")
for n in range(1024, 8193, 1024):  # llama grows by decode steps: one granule per buffer each
    owners["llama"].ensure_prefix(n)
book("llama grows to 8,192 tokens")
owners["qwen"].ensure_prefix(4096)
book("qwen grows to 4,096 tokens")
print(f"budget {fmt_bytes(ledgers['llama'].budget_bytes)}: llama backs "
      f"{fmt_bytes(owners['llama'].backed_bytes)}, qwen {fmt_bytes(owners['qwen'].backed_bytes)}")

# %% [markdown]
# The budget is full. llama's next growth is within its own limit, but not within the GPU's
# free budget: refused at once, with a typed error (a `DriverOutOfMemoryError`, so an engine's
# out-of-memory handling applies unchanged), and the owner is as it was.

# %%
before_refusal = owners["llama"].snapshot()
try:
    owners["llama"].ensure_prefix(9216)
except BudgetExceededError as e:
    refusal = e
    print(f"{type(e).__name__}: {e}")
    print(f"reason {e.budget_reason!r}: asked {fmt_bytes(e.asked_bytes)}, "
          f"{fmt_bytes(e.free_bytes)} free of {fmt_bytes(e.budget_bytes)}, "
          f"limit {fmt_bytes(e.limit_bytes)}")
assert owners["llama"].snapshot() == before_refusal  # the commit undid itself
book("llama asks 9,216 tokens: refused")

# %% [markdown]
# An operator lowers llama's limit, live (`kvvmm budget set llama 32MiB` does the same from a
# shell). Nothing is taken from llama: it is asked to shed the excess before a deadline, and
# its engine answers when it polls between decode steps, giving back its tail.

# %%
old_limit = ledgers["qwen"].set_limit("llama", 32 * MiB, shed_wait_s=5.0)
request = tenants["llama"].poll()
assert request is not None
book("llama's limit set to 32 MiB")
print(f"limit {fmt_bytes(old_limit)} -> {fmt_bytes(tenants['llama'].limit_bytes)}; "
      f"llama asked to shed {fmt_bytes(request.shed_bytes)}")
# the engine's loop, between two decode steps:
per_granule = sum(d.row_bytes for d in kv) * 1024  # 1,024 tokens: one granule per buffer


def tokens_to_keep(owner: kvvmm.KvBufferOwner, shed_bytes: int) -> int:
    """The prefix that gives back at least ``shed_bytes`` in whole granules."""
    return max(owner.backed_tokens - -(-shed_bytes // per_granule) * 1024, PAGE)


freed_on_poll = owners["llama"].release_beyond(
    tokens_to_keep(owners["llama"], request.shed_bytes))
book("llama sheds its tail")
print(f"llama gave back {fmt_bytes(freed_on_poll)}; request standing now: "
      f"{tenants['llama'].poll()}")

# %% [markdown]
# Now qwen grows past the free budget. It may wait, so the broker asks the other tenants for
# the shortfall, the most backed first. llama answers on a watcher thread this time
# (`Tenant.watch`: its callback runs whenever a request stands), and qwen's commit goes
# through as soon as the bytes are booked back.

# %%
freed_by_watch: list[int] = []


def shed(req: ShedRequest) -> None:
    owner = owners["llama"]
    freed_by_watch.append(owner.release_beyond(tokens_to_keep(owner, req.shed_bytes)))


tenants["llama"].watch(shed)
owners["qwen"].ensure_prefix(10_240)
book("qwen grows to 10,240: llama sheds")
print(f"qwen backs {fmt_bytes(owners['qwen'].backed_bytes)}; llama gave back "
      f"{' + '.join(fmt_bytes(b) for b in freed_by_watch)} on {len(freed_by_watch)} requests")

# %% [markdown]
# The ledger after each step:

# %%
print(f"{'step':34s} {'llama':>9s} {'its limit':>9s} {'asked':>9s} {'qwen':>9s} {'free':>9s}")
for step, row in zip(labels, steps, strict=True):
    print(f"{step:34s} " + " ".join(
        f"{fmt_bytes(row[k]) if row[k] or k != 'llama asked' else '-':>9s}"
        for k in ("llama", "llama limit", "llama asked", "qwen", "free")))

# %% tags=["nbval-ignore-output"]
ledger_figure(labels, steps, ledgers["llama"].budget_bytes)

# %%
first, refused_row, lowered, after_shed, last = steps[2:6] + steps[-1:]
display(Markdown(
    f"With the budget full ({fmt_bytes(first['llama'])} booked to llama and "
    f"{fmt_bytes(first['qwen'])} to qwen, {fmt_bytes(first['free'])} free), llama's commit of "
    f"{fmt_bytes(refusal.asked_bytes)} more was refused for `{refusal.budget_reason}` with "
    f"{fmt_bytes(refusal.free_bytes)} free, and the ledger books what it booked before "
    + ("(unchanged)" if refused_row["llama"] == first["llama"] else "(changed!)")
    + f". Lowering llama's limit from {fmt_bytes(old_limit)} to "
    f"{fmt_bytes(lowered['llama limit'])} asked it to shed {fmt_bytes(lowered['llama asked'])}; "
    f"its engine gave back {fmt_bytes(freed_on_poll)} and the request was gone "
    f"({fmt_bytes(after_shed['llama'])} booked, {fmt_bytes(after_shed['free'])} free). "
    f"qwen's growth then needed more than was free: llama's watcher gave back "
    f"{fmt_bytes(sum(freed_by_watch))} over {len(freed_by_watch)} requests, and qwen ends at "
    f"{fmt_bytes(last['qwen'])} beside llama's {fmt_bytes(last['llama'])}, "
    f"{fmt_bytes(last['free'])} free: never more than the "
    f"{fmt_bytes(ledgers['llama'].budget_bytes)} budget at any step."))

# %%
for owner in owners.values():
    owner.close()  # every release books back
closed_backed = {t.name: t.backed_bytes for t in ledgers["llama"].snapshot().tenants}
for t in tenants.values():
    t.close()
for led in ledgers.values():
    led.close()
folder.cleanup()
print("after the owners closed, the ledger books", closed_backed)

# %% [markdown]
# ## Explore: the broker in a panel
#
# `BudgetLab` makes the same two tenants on a ledger of its own (both refuse at once when the
# budget is full). Pick a tenant and a token count and press **Grow** (by 1,024-token decode
# steps) or **Give back**; move its limit and press **Set limit** (live: below what it books,
# it is asked to shed), then **Shed** to answer the request as its engine would. A refusal
# shows the broker's error in red; the table and the chart follow the ledger.

# %% tags=["nbval-ignore-output"]
budget_lab = BudgetLab(budget_mib=96)
budget_lab

# %% [markdown]
# The cell below drives a panel of its own from code (the one above stays as you leave it).

# %%
check = BudgetLab(budget_mib=96)
check.tokens.value = 8192
check.grow()
check.tenant.value, check.tokens.value = "qwen", 4096
check.grow()
check.tokens.value = 5120
panel_refused = not check.grow()
panel_error = check.error_text
print(panel_error)
check.tenant.value, check.limit_mib.value = "llama", 32
check.set_limit()
check.shed()
print(check.table())
panel_rows = list(check.rows)
check.close()

# %% [markdown]
# ## Checks

# %%
for r in (*runs.values(), *answers.values()):
    assert r.over_budget == 0
    assert all(sum(row) <= BUDGET for row in r.held_bytes)  # never double-booked
    for t in r.tenants:
        assert t.served + t.rejected == t.serving.requests
assert share["static"][llama.name] < 0.95  # the split serves less
assert min(share["elastic"].values()) >= 0.95  # sharing: each >= 95% of alone
assert sum(t.served for t in runs["elastic"].tenants) > \
    sum(t.served for t in runs["static"].tenants)
assert set(answers) == set(ANSWERS)
assert not answers["reject"].demands[0].granted
assert answers["reject"].demands[0].peak_held_bytes == 0
assert answers["shed"].demands[0].granted
assert answers["preempt"].tenants[0].preempted > answers["shed"].tenants[0].preempted \
    > answers["reject"].tenants[0].preempted
# The broker: never past the budget or a limit, the refusal typed, the sheds answered
budget_b = 96 * MiB
for row in steps:
    assert row["llama"] + row["qwen"] + row["free"] == budget_b and row["free"] >= 0
    assert row["llama"] <= row["llama limit"] or row["llama asked"] > 0  # over: asked to shed
assert isinstance(refusal, kvvmm.DriverOutOfMemoryError) and refusal.budget_reason == "budget"
assert refused_row == first  # the refusal booked nothing
assert lowered["llama asked"] == steps[3]["llama"] - 32 * MiB > 0
assert after_shed["llama"] <= 32 * MiB and after_shed["llama asked"] == 0
assert freed_on_poll >= lowered["llama asked"]
assert freed_by_watch and last["llama"] == after_shed["llama"] - sum(freed_by_watch)
assert last["qwen"] > after_shed["qwen"] + after_shed["free"]  # more than was free
assert closed_backed == {"llama": 0, "qwen": 0}
assert panel_refused and panel_error.startswith("BudgetExceededError")  # the panel shows it
assert panel_rows[-1]["llama"] <= 32 * MiB < panel_rows[-2]["llama"]  # asked, then shed
assert budget_lab.last_error is None  # the reader's panel
