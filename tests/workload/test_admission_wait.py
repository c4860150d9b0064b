"""What memory adds to a request's first token, and the bounded wait at admission.

- the metric: a request put off a whole step shows that step in ``first_token_added_s``;
  one admitted when it could be shows 0;
- the bounded wait (``admit_wait_s``): a lease whose commit ends within the bound stalls
  the step by what is left of it (decode-path time) and is admitted now; a longer one
  spins the bound, then is put off;
- the knob's checks.
"""

from __future__ import annotations

import pytest
from serving_support import QuietHooks

from kvvmm.driver import open_driver
from kvvmm.errors import ArgumentError
from kvvmm.layout import model_descs
from kvvmm.owner import KvBufferOwner, RangeBacking
from kvvmm.workload import Request, ServingConfig, Workload, generate, run_workload
from kvvmm.workload.serving import ServingModel, SlotAllocator, StepTimeModel
from kvvmm.workload.strategies import (
    ADMIT_WAIT_S,
    MAX_ADMIT_WAIT_S,
    LeaseAllocator,
    RequestRanges,
)


class _PutOff(SlotAllocator):
    """Request 1's memory is ready only from ``ready_s`` on: it is put off until then."""

    def __init__(self, pages: int, ready_s: float) -> None:
        super().__init__(pages)
        self.ready_at = ready_s
        self.refused: list[float] = []  # boundaries request 1 was put off at

    def prepare(self, rid: int, n: int) -> bool:
        if rid == 1 and self.now_s < self.ready_at:
            self.refused.append(self.now_s)
            return False
        return True

    def ready_s(self, rid: int) -> float:
        return self.ready_at if rid == 1 else self.now_s


def test_a_request_put_off_a_whole_step_shows_its_wait_and_a_ready_one_zero() -> None:
    sm = StepTimeModel(weights_bytes=10**9, kv_bytes_per_token=10**5, hbm_bytes_per_s=10**12,
                       overhead_s=1e-3, prefill_s_per_token=1e-5)
    # request 0 starts at 0; request 1 arrives with it but its memory is ready 0.1 ms
    # later: it is put off to the next boundary, the end of request 0's prefill step
    reqs = (Request(0.0, 100, 5), Request(0.0, 50, 2))
    alloc = _PutOff(64, ready_s=1e-4)
    stats = ServingModel(ServingConfig(), sm, pool_pages=64, allocator=alloc).run(
        Workload(reqs, "test"), QuietHooks())
    step1 = 2e-3 + 1e-7 * 100 + 1e-5 * 100  # request 0's prefill step
    assert alloc.refused == [0.0]  # put off once, at the first boundary
    assert stats.first_token_added_s == pytest.approx((0.0, step1))  # its whole step
    # ... and its first token waited exactly that much more than it would have
    assert stats.first_token_s[1] - stats.first_token_added_s[1] == pytest.approx(
        2e-3 + 1e-7 * 151 + 1e-5 * 50)
    ready = ServingModel(ServingConfig(), sm, pool_pages=64).run(Workload(reqs, "t"), QuietHooks())
    assert ready.first_token_added_s == (0.0, 0.0)  # admitted when it could be: nothing added


class _Commits:
    """The runner's executor in small: each commit ends ``cost_s`` after the boundary."""

    def __init__(self) -> None:
        self.alloc: LeaseAllocator | None = None
        self.cost_s = 0.0

    def __call__(self, job: object, waited: bool) -> None:
        job()  # type: ignore[operator]
        a = self.alloc
        if waited and a is not None and a.deferring:
            a.ready_at = max(a.ready_at, a.now_s + self.cost_s)


def _allocator(admit_wait_s: float) -> tuple[LeaseAllocator, _Commits]:
    descs = model_descs("llama-3.1-8b", layout="interleaved", reserved_tokens=1 << 16,
                        page_size=16, dtype="bfloat16")
    owner = KvBufferOwner(driver=open_driver("sim"), dtype="bfloat16", page_size=16,
                          reserved_tokens=1 << 16, descs=descs)
    ex = _Commits()
    backing = RangeBacking(owner, reserve_bytes=0, executor=ex)  # every admission commits
    alloc = LeaseAllocator(backing, 16, defer_unready=True, admit_wait_s=admit_wait_s)
    ex.alloc = alloc
    return alloc, ex


def test_a_commit_under_the_bound_stalls_the_step_by_its_cost_and_admits_now() -> None:
    alloc, ex = _allocator(1e-3)
    alloc.now_s, ex.cost_s = 1.0, 0.4e-3
    assert alloc.prepare(1, 4) is True  # ready 0.4 ms after the boundary: waited for
    assert alloc.take_wait() == pytest.approx(0.4e-3) and alloc.take_wait() == 0.0
    ex.cost_s = 0.7e-3  # a second admission at the same boundary: the step waits on, to 0.7
    assert alloc.prepare(2, 4) is True
    assert alloc.take_wait() == pytest.approx(0.3e-3)
    assert (alloc.waited_admits, alloc.deferred_admits, alloc.spun_out) == (2, 0, 0)
    assert alloc.range_stats()["admit_waited_ms"] == pytest.approx(0.7)
    alloc.backing.close()


def test_a_commit_above_the_bound_spins_the_bound_then_is_put_off() -> None:
    alloc, ex = _allocator(1e-3)
    alloc.now_s, ex.cost_s = 2.0, 3e-3
    assert alloc.prepare(1, 4) is False  # ends 3 ms after the boundary: put off ...
    assert alloc.take_wait() == pytest.approx(1e-3)  # ... after spinning the whole bound
    assert (alloc.spun_out, alloc.deferred_admits, alloc.waited_admits) == (1, 1, 0)
    assert alloc.ready_s(1) == pytest.approx(2.003)
    alloc.now_s = 2.05  # the next boundary, a step later: mapped, admitted, nothing to wait
    assert alloc.prepare(1, 4) is True and alloc.take_wait() == 0.0
    assert alloc.range_stats()["deferred_ms"] == pytest.approx(50.0)
    alloc.backing.close()


def test_no_bound_puts_off_every_unready_lease_without_a_spin() -> None:
    alloc, ex = _allocator(0.0)
    alloc.now_s, ex.cost_s = 1.0, 0.1e-3
    assert alloc.prepare(1, 4) is False and alloc.take_wait() == 0.0
    assert (alloc.spun_out, alloc.deferred_admits) == (0, 1)
    alloc.backing.close()


def test_in_a_replay_the_spins_are_decode_path_time_and_in_the_first_token() -> None:
    wl = generate(seed=5, duration_s=20.0, rate_scale=3.0)
    cmp = run_workload(wl, [lambda: RequestRanges(deferred=True, reserve_bytes=0,
                                                  admit_wait_s=0.0),
                            lambda: RequestRanges(deferred=True, reserve_bytes=0,
                                                  admit_wait_s=MAX_ADMIT_WAIT_S)],
                       model="llama-3.1-8b", tp=1, pause_scale=1.0)
    off, wait = (r.summary() for r in cmp.results)
    assert off["admissions_put_off"] > 0 and off["ranges_waited_admits"] == 0
    assert off["first_token_added_max_ms"] >= off["ranges_deferred_max_ms"] > 0
    assert wait["admissions_put_off"] == 0 < wait["ranges_waited_admits"]
    assert wait["decode_driver_ms"] >= wait["ranges_admit_waited_ms"] > 0
    for row, r in zip((off, wait), cmp.results, strict=True):
        added = r.serving.first_token_added_s
        assert len(added) == len(r.serving.first_token_s) and min(added) >= 0
        assert row["first_token_added_p50_ms"] <= row["first_token_added_p99_ms"] \
            <= row["first_token_added_max_ms"]
    # nothing put off: what memory added is the steps' stalls, a wait of at most the bound
    assert wait["first_token_added_max_ms"] <= wait["max_stall_us"] / 1e3 + 1e-9


@pytest.mark.parametrize("bad", [-1e-3, MAX_ADMIT_WAIT_S * 2, float("nan"), float("inf"),
                                 "1ms", True, None])
def test_admit_wait_is_checked_naming_value_and_limit(bad: object) -> None:
    if bad is not None:
        with pytest.raises(ArgumentError, match="admit_wait_s") as e:
            RequestRanges(deferred=True, admit_wait_s=bad)  # type: ignore[arg-type]
        assert e.value.name == "admit_wait_s" and str(MAX_ADMIT_WAIT_S) in e.value.limit
    with pytest.raises(ArgumentError, match="admit_wait_s") as e:
        LeaseAllocator(None, 16, admit_wait_s=bad)  # type: ignore[arg-type]
    assert str(MAX_ADMIT_WAIT_S) in e.value.limit


def test_admit_wait_needs_admissions_that_can_be_put_off() -> None:
    with pytest.raises(ArgumentError, match="deferred=True") as e:
        RequestRanges(admit_wait_s=1e-3)  # request ranges alone commit on the step
    assert e.value.value == 1e-3
    with pytest.raises(ArgumentError, match="defer_admissions=False"):
        RequestRanges(deferred=True, defer_admissions=False, admit_wait_s=1e-3)
    assert RequestRanges(deferred=True).admit_wait_s == ADMIT_WAIT_S
    assert RequestRanges(deferred=True, defer_admissions=False).admit_wait_s == 0.0
    assert RequestRanges(deferred=True, admit_wait_s=0).admit_wait_s == 0.0
