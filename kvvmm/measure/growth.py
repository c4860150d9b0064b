"""``kvvmm bench``'s decode growth per policy: settled rounds, back to back, then finalize,
close and the copy bandwidth of the grown owner's tensors."""

from __future__ import annotations

import statistics
import time
from typing import Any

from kvvmm.measure.timer import copy_vs_malloc, rotated
from kvvmm.measure.workload import BENCH_WORKLOAD, Workload
from kvvmm.units import GiB

__all__ = ["SETTLE_S", "back_to_back", "grow", "grow_rounds", "policy_growth"]

#: Seconds between an owner's close and the next timed growth (see ``grow_rounds``).
SETTLE_S = 2.0


def grow(cd: Any, policy: Any, w: Workload = BENCH_WORKLOAD) -> tuple[Any, int, float]:
    """An owner of ``w`` grown by its decode steps under ``policy`` on ``cd`` (a GPU: the
    growth is synchronized before and after).

    Returns:
        The owner (open: the caller closes it), its handles before growth, and the seconds
        the growth took.
    """
    import torch

    owner = w.owner(cd, policy)
    h0 = owner.snapshot().handles
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for n in w.decode_steps():
        owner.ensure_prefix(n)
    torch.cuda.synchronize()
    return owner, h0, time.perf_counter() - t0


def grow_rounds(cd: Any, policies: list[Any], rounds: int = 3,
                 w: Workload = BENCH_WORKLOAD) -> dict[str, list[float]]:
    """Growth times per policy over ``rounds`` rounds, the order rotated each round, each
    started ``SETTLE_S`` after the previous owner closed: right after a large release the
    driver's creates run slower for a while, and a server grows its KV cache long after
    (:func:`back_to_back` times the other case).
    """
    runs: dict[str, list[float]] = {str(p): [] for p in policies}
    for r in range(rounds):
        for p in rotated(policies, r):
            time.sleep(SETTLE_S)
            runs[str(p)].append(_grow_ms(cd, p, w))
    return runs


def _grow_ms(cd: Any, policy: Any, w: Workload) -> float:
    owner, _, secs = grow(cd, policy, w)
    owner.close()
    return round(secs * 1e3, 2)


def back_to_back(cd: Any, policy: Any, rounds: int = 3,
                  w: Workload = BENCH_WORKLOAD) -> list[float]:
    """Growth times with no pause: each growth starts right after the previous owner (64 GiB
    backed) closed."""
    time.sleep(SETTLE_S)
    return [_grow_ms(cd, policy, w) for _ in range(rounds + 1)][1:]  # the first: settled


def policy_growth(cd: Any, policy: Any, rounds: list[float],
            w: Workload = BENCH_WORKLOAD) -> dict[str, Any]:
    """One policy's row of ``kvvmm bench``'s growth section: a settled growth, then finalize,
    the copy bandwidth of two of its tensors against cudaMalloc's, and close; ``rounds`` are
    the growth times :func:`grow_rounds` measured for it (ms)."""
    import torch

    time.sleep(SETTLE_S)
    owner, h0, grow_s = grow(cd, policy, w)
    descs = owner.descs
    steps = w.steps
    snap = owner.snapshot()
    need = sum(d.prefix_span_bytes(steps * w.step_tokens, w.page_size) for d in descs)
    over = [b.backed_bytes - b.prefix_bytes for b in snap.buffers]
    t0 = time.perf_counter()
    owner.finalize(w.finalize_tokens)
    torch.cuda.synchronize()
    fin_s = time.perf_counter() - t0
    fsnap = owner.snapshot()
    nbytes = 1 * GiB
    vm = owner.tensors[2].view(-1)[: nbytes // 2]
    vm2 = owner.tensors[3].view(-1)[: nbytes // 2]
    bw = copy_vs_malloc(vm, vm2)
    del vm, vm2
    t0 = time.perf_counter()
    owner.close()
    close_s = time.perf_counter() - t0
    handles = snap.handles - h0
    return {
        "policy": str(policy), "steps": steps,
        "grow_ms": statistics.median(rounds), "grow_ms_rounds": rounds,
        "settle_s_before_each_round": SETTLE_S,
        "grow_ms_with_finalize_run": round(grow_s * 1e3, 2),
        "grow_driver_calls": 3 * handles, "grow_handles": handles,
        "handles_after_growth": snap.handles, "backed_after_growth_bytes": snap.backed_bytes,
        "overcommit_bytes": snap.backed_bytes - need, "max_overcommit_per_buffer": max(over),
        "finalize_1M_ms": round(fin_s * 1e3, 2), "handles_after_finalize": fsnap.handles,
        "backed_after_finalize_bytes": fsnap.backed_bytes, "bandwidth": bw,
        "close_ms": round(close_s * 1e3, 2),
    }

