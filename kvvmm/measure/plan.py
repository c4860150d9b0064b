"""What one ``kvvmm calibrate`` run measures (:class:`Plan`, :data:`FULL`, :data:`QUICK`) and
what every section gets (:class:`Ctx`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvvmm.measure.timer import TimedDriver
from kvvmm.measure.workload import BENCH_WORKLOAD, Workload
from kvvmm.units import GiB

__all__ = ["FULL", "QUICK", "Ctx", "Plan", "plan_dict", "plan_from_dict"]


@dataclass(frozen=True, slots=True)
class Plan:
    """What one calibration run measures, and how often (sizes in MiB unless named)."""

    call_sizes_mib: tuple[int, ...]  #: handle sizes of the per-call section
    call_reps: tuple[int, ...]  #: reps per size (the same order)
    reserve_gib: tuple[int, ...]  #: reservation sizes of the reserve/free section
    reserve_reps: int
    access_cases: tuple[tuple[int, int], ...]  #: (mapping MiB, mappings) for access_multi
    access_reps: int
    layers: int  #: decode-growth workload: 2 x layers buffers (K and V)
    reserved_tokens: int
    step_tokens: int
    grow_to_tokens: int
    finalize_tokens: int  #: finalize after the default policy's growth (0: skip)
    policies: tuple[str, ...]  #: growth policies, as :func:`kvvmm.policy.parse_policy` reads them
    rounds: int  #: settled growth rounds per policy
    settle_s: float  #: pause after a large close, before anything timed
    commit_reps: int  #: Arena.commit calls timed
    owner_reps: int  #: owner constructions (and closes) timed
    bandwidth_handles_mib: tuple[int, ...]  #: 0: one handle for the whole tensor
    bandwidth_bytes: int
    release_bytes: int  #: released just before the slowed creates (capped by free memory)
    slow_creates: int  #: creates timed after the release, and settled
    slow_create_mib: int
    slow_repeats: int
    cold_rounds: int = 12  #: pauses, each followed by one cold and one warm round of calls
    cold_gap_s: float = 0.05  #: the pause before each cold round
    #: shorter pauses, each timed as ``cold_gap_s`` is: the share of the premium they give
    cold_partial_s: tuple[float, ...] = (0.001, 0.005, 0.02)
    touch_regions: int = 32  #: untouched 1 GiB regions the first-touch section maps into
    touch_reps: int = 3  #: fresh reservations of those regions
    #: seconds after which the per-call section stops its reps (each size timed at least 5
    #: times); 0: every rep of ``call_reps``
    call_limit_s: float = 0.0

    @property
    def workload(self) -> Workload:
        """The decode growth the growth and library sections time (bench's buffers, this
        plan's tokens and steps)."""
        return Workload(layers=self.layers, reserved_tokens=self.reserved_tokens,
                        step_tokens=self.step_tokens, grow_to_tokens=self.grow_to_tokens,
                        finalize_tokens=self.finalize_tokens)


#: The full run: under 5 minutes on an H200.
FULL = Plan(
    call_sizes_mib=(2, 8, 32, 128, 512, 2048), call_reps=(200, 150, 150, 100, 50, 20),
    reserve_gib=(1, 64, 256, 1024), reserve_reps=20,
    access_cases=((2, 64), (8, 32), (32, 16), (128, 8), (512, 4)), access_reps=5,
    # kvvmm bench's decode growth (kvvmm.measure.workload)
    layers=BENCH_WORKLOAD.layers, reserved_tokens=BENCH_WORKLOAD.reserved_tokens,
    step_tokens=BENCH_WORKLOAD.step_tokens, grow_to_tokens=BENCH_WORKLOAD.grow_to_tokens,
    finalize_tokens=BENCH_WORKLOAD.finalize_tokens,
    policies=("default", "exact", "chunked:32", "chunked:128", "geometric:2:1024"),
    rounds=3, settle_s=2.0, commit_reps=200, owner_reps=5,
    bandwidth_handles_mib=(0, 512, 64, 8, 2), bandwidth_bytes=GiB,
    release_bytes=64 * GiB, slow_creates=256, slow_create_mib=32, slow_repeats=3,
)


#: ``--quick``: about a minute; the same sections, fewer sizes, one growth round.
QUICK = replace(
    FULL, call_sizes_mib=(2, 32, 512), call_reps=(80, 60, 20), reserve_gib=(64, 256),
    reserve_reps=8, access_cases=((2, 64), (32, 16)), access_reps=3,
    policies=("default", "exact", "chunked:128"), rounds=1, settle_s=1.0, commit_reps=100,
    owner_reps=3, finalize_tokens=0, bandwidth_handles_mib=(0, 64, 2),
    release_bytes=32 * GiB, slow_creates=128, slow_repeats=2, cold_rounds=6,
)


#: The share of the card's free memory the decode growth may back at its end (the policies'
#: overshoot and the other sections' handles fit in the rest), and the finalize: a plan
#: that needs more is cut to it; one within :data:`FITS_SHARE` of free memory runs as it is.
GROWTH_SHARE, FINALIZE_SHARE, FITS_SHARE = 0.6, 0.75, 0.9


def fit_to_memory(plan: Plan, free_bytes: int) -> Plan:
    """``plan`` with its decode growth and finalize cut to what ``free_bytes`` holds: a size that
    does not fit is cut, in whole steps, to its share of the free memory (a section that runs out
    of memory is lost); the plan recorded in the profile says what was grown.
    """
    per_token, step = plan.workload.token_bytes_all, plan.step_tokens

    def cut(tokens: int, share: float, fits: float) -> int:
        if tokens * per_token <= free_bytes * fits:
            return tokens
        return max(int(free_bytes * share) // per_token // step * step, step)

    grow = cut(plan.grow_to_tokens, GROWTH_SHARE, GROWTH_SHARE)
    fin = cut(plan.finalize_tokens, FINALIZE_SHARE, FITS_SHARE) if plan.finalize_tokens else 0
    if (grow, fin) == (plan.grow_to_tokens, plan.finalize_tokens):
        return plan
    return replace(plan, grow_to_tokens=grow, finalize_tokens=max(fin, grow) if fin else 0)


@dataclass(slots=True)
class Ctx:
    """What every section gets: the driver (wrapped), the plan, how to wait for the device,
    and how time is told (a card: the wall clock and a sleep; a simulator: its clock and its
    ``pause``, so the same sections measure either)."""

    td: TimedDriver
    plan: Plan
    sync: Callable[[], None]
    cuda: bool  #: a GPU (bandwidth and the post-release probe need one)
    clock: Callable[[], float] = time.perf_counter  #: seconds now
    pause: Callable[[float], None] = time.sleep  #: lets that many seconds pass


def plan_dict(plan: Plan) -> dict[str, Any]:
    """The plan as JSON-ready data (recorded in the profile: what was measured, how often)."""
    return dataclasses.asdict(plan)


def plan_from_dict(rec: object) -> Plan:
    """The plan :func:`plan_dict` recorded (a calibrated profile's ``calibration.plan``):
    its fields over :data:`FULL`'s (JSON's lists back to tuples; fields a plan did not
    have then, and keys it no longer has, as today's); :data:`FULL` where none is recorded."""
    if not isinstance(rec, Mapping):
        return FULL

    def tup(v: Any) -> Any:
        return tuple(tup(x) for x in v) if isinstance(v, list) else v

    names = {f.name for f in dataclasses.fields(Plan)}
    return replace(FULL, **{k: tup(v) for k, v in rec.items() if k in names})
