"""Bad inputs: each is a typed kvvmm error that names the value and the limit, and changes nothing.

One table row per bad input: an id, the call, the error class it must raise, the value the
message must name and a key fragment of the limit it broke. Rows that touch an arena or an
owner run on the simulator and on the host driver, and prove that nothing was committed: the
driver's own accounting and every snapshot are the same before and after.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import kvvmm
from kvvmm import (
    AlignmentError,
    Arena,
    ArgumentError,
    Chunked,
    ClosedError,
    Exact,
    Fault,
    Geometric,
    KvBufferDesc,
    KvBufferOwner,
    KvvmmError,
    OutOfRangeError,
    ReservationExhaustedError,
    SimDriver,
    UnknownDtypeError,
    mha_token_major,
    mla,
    open_driver,
    page_major,
)
from kvvmm.driver import Driver
from kvvmm.dtypes import dtype_itemsize
from kvvmm.growth import decode_growth
from kvvmm.layout import hybrid_swa_descs, load_model, model_descs
from kvvmm.measure.stats import quantiles
from kvvmm.policy import parse_policy
from kvvmm.units import GiB, MiB, align_down, align_up

MakeDriver = Callable[..., Driver]
G = 2 * MiB  # the granularity of both test drivers
PAGE = 16
RESERVED = 4096
DESCS = mha_token_major(layers=2, kv_heads=8, head_dim=128, reserved_tokens=RESERVED,
                        page_size=PAGE, dtype="bfloat16")
#: The arena every arena row starts from: "a" = [0, 3G) with G backed, "b" = [3G, 5G).
ARENA_RESERVE = 16 * G
A, B = 0, 3 * G


@dataclass
class Ctx:
    """What a row acts on; only the parts its ``needs`` names are built."""

    driver: Driver
    arenas: list[Arena] = field(default_factory=list)
    owners: list[KvBufferOwner] = field(default_factory=list)

    @property
    def arena(self) -> Arena:
        return self.arenas[0]

    @property
    def closed_arena(self) -> Arena:
        return self.arenas[1]

    @property
    def owner(self) -> KvBufferOwner:
        return self.owners[0]

    @property
    def closed_owner(self) -> KvBufferOwner:
        return self.owners[1]

    def owner_with(self, **overrides: Any) -> KvBufferOwner:
        kw: dict[str, Any] = {"driver": self.driver, "dtype": "bfloat16", "page_size": PAGE,
                              "reserved_tokens": RESERVED, "descs": DESCS, "policy": Exact()}
        kw.update(overrides)
        return KvBufferOwner(**kw)

    def state(self) -> tuple[object, ...]:
        return (
            self.driver.stats(),
            tuple(a.snapshot() for a in self.arenas),
            tuple(a.live_views for a in self.arenas),
            tuple(o.snapshot() for o in self.owners),
            tuple(len(o.tensors) for o in self.owners),
        )


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[Ctx], object]
    error: type[KvvmmError]
    value: object  #: its str() must appear in the message
    limit: str  #: a key fragment of the limit, which must appear too
    needs: str = ""  #: "arena", "owner", "driver" or "" (no driver at all)

    def param(self, marks: Any = ()) -> Any:
        return pytest.param(self, id=self.id, marks=marks)


def _build(ctx: Ctx, needs: str) -> None:
    if needs == "arena":
        arena = Arena(ctx.driver, reserve_bytes=ARENA_RESERVE, name="bad-inputs")
        assert arena.allocate(3 * G, "a") == A and arena.allocate(2 * G, "b") == B
        arena.commit(A, G)
        closed = Arena(ctx.driver, reserve_bytes=4 * G, name="closed")
        closed.allocate(G, "x")
        closed.close()
        ctx.arenas = [arena, closed]
    elif needs == "owner":
        closed = ctx.owner_with(name="closed")
        closed.close()
        ctx.owners = [ctx.owner_with(), closed]


# -- the tables -------------------------------------------------------------------------------

ARENA_CASES = [
    Case("arena-reserve-negative", lambda c: Arena(c.driver, reserve_bytes=-1), ArgumentError,
         -1, "> 0", "driver"),
    Case("arena-reserve-zero", lambda c: Arena(c.driver, reserve_bytes=0), ArgumentError,
         0, "> 0", "driver"),
    Case("arena-reserve-bool", lambda c: Arena(c.driver, reserve_bytes=True), ArgumentError,
         True, "an int", "driver"),
    Case("arena-reserve-float", lambda c: Arena(c.driver, reserve_bytes=4.0 * G), ArgumentError,
         4.0 * G, "an int", "driver"),
    Case("arena-reserve-str", lambda c: Arena(c.driver, reserve_bytes="4096"), ArgumentError,
         "4096", "an int", "driver"),
    Case("arena-device-not-the-drivers", lambda c: Arena(c.driver, reserve_bytes=G, device=3),
         ArgumentError, 3, "driver's device", "driver"),
    Case("allocate-zero", lambda c: c.arena.allocate(0), ArgumentError, 0, "> 0", "arena"),
    Case("allocate-negative", lambda c: c.arena.allocate(-5), ArgumentError, -5, "> 0", "arena"),
    Case("allocate-float", lambda c: c.arena.allocate(1.0), ArgumentError, 1.0, "an int",
         "arena"),
    Case("allocate-beyond-the-reservation", lambda c: c.arena.allocate(11 * G + 1),
         ReservationExhaustedError, 11 * G + 1, str(11 * G), "arena"),
    Case("allocate-duplicate-name", lambda c: c.arena.allocate(G, "a"), ArgumentError, "a",
         "unique", "arena"),
    Case("commit-at-an-aligned-offset-inside-an-allocation", lambda c: c.arena.commit(G, G),
         OutOfRangeError, G, "start of an allocation", "arena"),
    Case("commit-at-a-misaligned-offset", lambda c: c.arena.commit(12345, G), AlignmentError,
         12345, "start of an allocation", "arena"),
    Case("commit-at-the-cursor", lambda c: c.arena.commit(5 * G, G), OutOfRangeError, 5 * G,
         "start of an allocation", "arena"),
    Case("commit-at-a-negative-offset", lambda c: c.arena.commit(-G, G), OutOfRangeError, -G,
         "start of an allocation", "arena"),
    Case("commit-at-a-str-offset", lambda c: c.arena.commit("0", G), ArgumentError, "0",
         "an int", "arena"),
    Case("commit-negative-nbytes", lambda c: c.arena.commit(A, -1), ArgumentError, -1,
         f"[0, {3 * G}]", "arena"),
    Case("commit-beyond-the-allocation", lambda c: c.arena.commit(A, 3 * G + 1), OutOfRangeError,
         3 * G + 1, f"[0, {3 * G}]", "arena"),
    Case("commit-bool-nbytes", lambda c: c.arena.commit(B, True), ArgumentError, True,
         f"[0, {2 * G}]", "arena"),
    Case("commit-many-with-one-bad-request-commits-none",
         lambda c: c.arena.commit_many([(A, 3 * G), (B, 2 * G + 1)]), OutOfRangeError,
         2 * G + 1, f"[0, {2 * G}]", "arena"),
    Case("decommit-keep-beyond-the-allocation", lambda c: c.arena.decommit(A, 3 * G + 1),
         OutOfRangeError, 3 * G + 1, f"[0, {3 * G}]", "arena"),
    Case("decommit-keep-negative", lambda c: c.arena.decommit(A, -1), ArgumentError, -1,
         f"[0, {3 * G}]", "arena"),
    Case("decommit-at-a-non-allocation-offset", lambda c: c.arena.decommit(2 * G, 0),
         OutOfRangeError, 2 * G, "start of an allocation", "arena"),
    Case("decommit-many-with-one-bad-request-decommits-none",
         lambda c: c.arena.decommit_many([(A, 0), (B, 99 * G)]), OutOfRangeError, 99 * G,
         f"[0, {2 * G}]", "arena"),
    Case("tensor-with-a-zero-dim", lambda c: c.arena.tensor(A, (0, 4), "float16"),
         ArgumentError, 0, "> 0", "arena"),
    Case("tensor-with-a-negative-dim", lambda c: c.arena.tensor(A, (4, -2), "float16"),
         ArgumentError, -2, "> 0", "arena"),
    Case("tensor-at-a-negative-offset", lambda c: c.arena.tensor(-2, (4,), "float16"),
         ArgumentError, -2, str(ARENA_RESERVE - 8), "arena"),
    Case("tensor-beyond-the-reservation", lambda c: c.arena.tensor(ARENA_RESERVE - 6, (4,),
         "float16"), OutOfRangeError, ARENA_RESERVE - 6, str(ARENA_RESERVE - 8), "arena"),
    Case("tensor-larger-than-the-reservation",
         lambda c: c.arena.tensor(0, (ARENA_RESERVE // 4 + 1,), "float32"), OutOfRangeError, 0,
         f"{ARENA_RESERVE + 4} bytes fit", "arena"),
    Case("tensor-of-an-unknown-dtype-name", lambda c: c.arena.tensor(A, (4,), "float64"),
         UnknownDtypeError, "float64", "bfloat16", "arena"),
    Case("tensor-of-an-unsupported-torch-dtype",
         lambda c: c.arena.tensor(A, (4,), torch.complex64), UnknownDtypeError,
         torch.complex64, "bfloat16", "arena"),
    Case("tensor-at-an-offset-not-a-multiple-of-the-itemsize",
         lambda c: c.arena.tensor(1, (4,), "float16"), AlignmentError, 1, "itemsize 2", "arena"),
    Case("arena-allocate-after-close", lambda c: c.closed_arena.allocate(G), ClosedError,
         "allocate", "after close()", "arena"),
    Case("arena-commit-after-close", lambda c: c.closed_arena.commit(0, G), ClosedError,
         "commit", "after close()", "arena"),
    Case("arena-commit-many-after-close", lambda c: c.closed_arena.commit_many([(0, G)]),
         ClosedError, "commit", "after close()", "arena"),
    Case("arena-decommit-after-close", lambda c: c.closed_arena.decommit(0, 0), ClosedError,
         "decommit", "after close()", "arena"),
    Case("arena-decommit-many-after-close", lambda c: c.closed_arena.decommit_many([(0, 0)]),
         ClosedError, "decommit", "after close()", "arena"),
    Case("arena-tensor-after-close", lambda c: c.closed_arena.tensor(0, (4,), "float16"),
         ClosedError, "tensor", "after close()", "arena"),
]

OWNER_CASES = [
    Case("owner-page-size-zero", lambda c: c.owner_with(page_size=0), ArgumentError, 0, ">= 1",
         "driver"),
    Case("owner-page-size-negative", lambda c: c.owner_with(page_size=-16), ArgumentError, -16,
         ">= 1", "driver"),
    Case("owner-page-size-bool", lambda c: c.owner_with(page_size=True), ArgumentError, True,
         "an int", "driver"),
    Case("owner-page-size-float", lambda c: c.owner_with(page_size=16.0), ArgumentError, 16.0,
         "an int", "driver"),
    Case("owner-reserved-tokens-below-a-page", lambda c: c.owner_with(reserved_tokens=8),
         ArgumentError, 8, "page_size (16)", "driver"),
    Case("owner-reserved-tokens-str", lambda c: c.owner_with(reserved_tokens="4096"),
         ArgumentError, "4096", "an int", "driver"),
    Case("owner-empty-descs", lambda c: c.owner_with(descs=[]), ArgumentError, [],
         "non-empty", "driver"),
    Case("owner-descs-a-str", lambda c: c.owner_with(descs="k0"), ArgumentError, "k0",
         "KvBufferDesc", "driver"),
    Case("owner-a-non-desc-in-descs", lambda c: c.owner_with(descs=[DESCS[0], "k1"]),
         ArgumentError, "k1", "a KvBufferDesc", "driver"),
    Case("owner-duplicate-desc-names", lambda c: c.owner_with(descs=[DESCS[0], DESCS[0]]),
         ArgumentError, "k0", "unique names", "driver"),
    Case("owner-unknown-dtype-name", lambda c: c.owner_with(dtype="float64"), UnknownDtypeError,
         "float64", "bfloat16", "driver"),
    Case("owner-nonsense-dtype-name", lambda c: c.owner_with(dtype="bogus"), UnknownDtypeError,
         "bogus", "float16", "driver"),
    Case("owner-dtype-a-python-type", lambda c: c.owner_with(dtype=int), UnknownDtypeError, int,
         "a torch dtype", "driver"),
    Case("owner-dtype-an-unsupported-torch-dtype", lambda c: c.owner_with(dtype=torch.int32),
         UnknownDtypeError, torch.int32, "a torch dtype", "driver"),
    Case("owner-policy-a-str", lambda c: c.owner_with(policy="exact"), ArgumentError, "exact",
         "Chunked(", "driver"),
    Case("owner-policy-an-int", lambda c: c.owner_with(policy=42), ArgumentError, 42,
         "Geometric(", "driver"),
    Case("owner-desc-too-small-for-reserved-tokens",
         lambda c: c.owner_with(descs=[KvBufferDesc("k0", (100, 8, 128), 2048, 1)]),
         OutOfRangeError, RESERVED, "reserves 204800", "driver"),
    Case("owner-device-not-the-drivers", lambda c: c.owner_with(device=5), ArgumentError, 5,
         "driver's device", "driver"),
    Case("ensure-prefix-negative", lambda c: c.owner.ensure_prefix(-1), ArgumentError, -1,
         ">= 0", "owner"),
    Case("ensure-prefix-beyond-the-top-page",
         lambda c: c.owner.ensure_prefix(RESERVED + PAGE + 1), OutOfRangeError,
         RESERVED + PAGE + 1, f"reserved_tokens + page_size) ({RESERVED + PAGE})", "owner"),
    Case("ensure-prefix-float", lambda c: c.owner.ensure_prefix(2.5), ArgumentError, 2.5,
         "an int", "owner"),
    Case("ensure-prefix-bool", lambda c: c.owner.ensure_prefix(True), ArgumentError, True,
         "an int", "owner"),
    Case("finalize-below-a-page", lambda c: c.owner.finalize(PAGE - 1), ArgumentError, PAGE - 1,
         "page_size (16)", "owner"),
    Case("finalize-zero", lambda c: c.owner.finalize(0), ArgumentError, 0, "page_size (16)",
         "owner"),
    Case("finalize-beyond-reserved-tokens", lambda c: c.owner.finalize(RESERVED + PAGE),
         OutOfRangeError, RESERVED + PAGE, f"reserved_tokens ({RESERVED})", "owner"),
    Case("finalize-str", lambda c: c.owner.finalize("64"), ArgumentError, "64", "an int",
         "owner"),
    Case("finalize-none", lambda c: c.owner.finalize(None), ArgumentError, None, "an int",
         "owner"),
    Case("shrink-below-a-page", lambda c: c.owner.shrink(PAGE - 1), ArgumentError, PAGE - 1,
         "page_size (16)", "owner"),
    Case("shrink-negative", lambda c: c.owner.shrink(-3), ArgumentError, -3, "page_size (16)",
         "owner"),
    Case("shrink-beyond-reserved-tokens", lambda c: c.owner.shrink(5000), OutOfRangeError, 5000,
         f"reserved_tokens ({RESERVED})", "owner"),
    Case("shrink-float", lambda c: c.owner.shrink(32.0), ArgumentError, 32.0, "an int", "owner"),
    Case("owner-ensure-prefix-after-close", lambda c: c.closed_owner.ensure_prefix(PAGE),
         ClosedError, "ensure_prefix", "after close()", "owner"),
    Case("owner-finalize-after-close", lambda c: c.closed_owner.finalize(PAGE), ClosedError,
         "finalize", "after close()", "owner"),
    Case("owner-shrink-after-close", lambda c: c.closed_owner.shrink(PAGE), ClosedError,
         "shrink", "after close()", "owner"),
]


def _host_driver(**kw: Any) -> object:
    from kvvmm.driver.host import HostDriver

    d = HostDriver(**kw)
    d.close()  # only reached when the row is not refused: leave nothing behind
    return d


_MHA = {"layers": 2, "kv_heads": 8, "head_dim": 128, "reserved_tokens": RESERVED,
        "page_size": PAGE, "dtype": "bfloat16"}
_MLA = {"layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "reserved_tokens": RESERVED,
        "page_size": PAGE, "dtype": "bfloat16"}

PLAIN_CASES = [
    Case("chunked-zero", lambda c: Chunked(0), ArgumentError, 0, "> 0"),
    Case("chunked-negative", lambda c: Chunked(-MiB), ArgumentError, -MiB, "> 0"),
    Case("chunked-bool", lambda c: Chunked(True), ArgumentError, True, "> 0"),
    Case("chunked-float", lambda c: Chunked(1.5 * MiB), ArgumentError, 1.5 * MiB, "an int"),
    Case("geometric-factor-one", lambda c: Geometric(1.0), ArgumentError, 1.0, "(1, 1e6]"),
    Case("geometric-factor-below-one", lambda c: Geometric(0.5), ArgumentError, 0.5, "(1, 1e6]"),
    Case("geometric-factor-nan", lambda c: Geometric(math.nan), ArgumentError, math.nan,
         "(1, 1e6]"),
    Case("geometric-factor-a-str", lambda c: Geometric("2"), ArgumentError, "2", "a number"),
    Case("geometric-max-bytes-zero", lambda c: Geometric(2.0, max_bytes=0), ArgumentError, 0,
         "> 0"),
    Case("geometric-max-bytes-negative", lambda c: Geometric(2.0, max_bytes=-G), ArgumentError,
         -G, "> 0"),
    Case("open-driver-of-an-unknown-kind", lambda c: open_driver("nope"), ArgumentError, "nope",
         "'sim'"),
    Case("open-driver-kind-in-capitals", lambda c: open_driver("SIM"), ArgumentError, "SIM",
         "'sim'"),
    Case("sim-driver-unknown-profile", lambda c: SimDriver(profile="a100"), ArgumentError,
         "a100", "'h200'"),
    Case("sim-driver-capacity-zero", lambda c: SimDriver(capacity_bytes=0), ArgumentError, 0,
         "> 0"),
    Case("sim-driver-capacity-negative", lambda c: SimDriver(capacity_bytes=-G), ArgumentError,
         -G, "> 0"),
    Case("sim-driver-used-negative", lambda c: SimDriver(used_bytes=-1), ArgumentError, -1,
         "the capacity"),
    Case("sim-driver-used-beyond-capacity",
         lambda c: SimDriver(capacity_bytes=2 * G, used_bytes=3 * G), ArgumentError, 3 * G,
         str(2 * G)),
    Case("host-driver-granularity-not-a-page-multiple", lambda c: _host_driver(granularity=1000),
         ArgumentError, 1000, "multiple of 4096"),
    Case("host-driver-granularity-zero", lambda c: _host_driver(granularity=0), ArgumentError, 0,
         "positive multiple"),
    Case("host-driver-granularity-bool", lambda c: _host_driver(granularity=True),
         ArgumentError, True, "positive multiple"),
    Case("host-driver-capacity-zero", lambda c: _host_driver(capacity_bytes=0), ArgumentError,
         0, "an int > 0"),
    Case("host-driver-capacity-float", lambda c: _host_driver(capacity_bytes=1.5 * GiB),
         ArgumentError, 1.5 * GiB, "an int > 0"),
    Case("fault-of-an-unknown-call", lambda c: Fault(call="nope"), ArgumentError, "nope",
         "'create'"),
    Case("fault-nth-zero", lambda c: Fault(call="map", nth=0), ArgumentError, 0, ">= 1"),
    Case("fault-of-an-unknown-error", lambda c: Fault(error="CUDA_ERROR_BOGUS"), ArgumentError,
         "CUDA_ERROR_BOGUS", "CUDA_ERROR_OUT_OF_MEMORY"),
    Case("mha-tp-not-dividing-kv-heads", lambda c: mha_token_major(**_MHA, tp=3), ArgumentError,
         3, "divisor of kv_heads=8"),
    Case("mha-zero-layers", lambda c: mha_token_major(**{**_MHA, "layers": 0}), ArgumentError,
         0, "> 0"),
    Case("mha-negative-head-dim", lambda c: mha_token_major(**{**_MHA, "head_dim": -128}),
         ArgumentError, -128, "> 0"),
    Case("mha-unknown-dtype", lambda c: mha_token_major(**{**_MHA, "dtype": "fp64"}),
         UnknownDtypeError, "fp64", "bfloat16"),
    Case("page-major-page-size-zero", lambda c: page_major(**{**_MHA, "page_size": 0}),
         ArgumentError, 0, "> 0"),
    Case("page-major-reserved-tokens-zero",
         lambda c: page_major(**{**_MHA, "reserved_tokens": 0}), ArgumentError, 0, "> 0"),
    Case("page-major-tp-neither-divisor-nor-multiple",
         lambda c: page_major(**{**_MHA, "kv_heads": 12}, tp=16), ArgumentError, 16,
         "multiple of it"),
    Case("mla-unknown-layout", lambda c: mla(**_MLA, layout="columns"), ArgumentError, "columns",
         "token_major"),
    Case("mla-zero-kv-lora-rank", lambda c: mla(**{**_MLA, "kv_lora_rank": 0}), ArgumentError,
         0, "> 0"),
    Case("desc-empty-shape", lambda c: KvBufferDesc("k", (), 2, 1), ArgumentError, (),
         "non-empty"),
    Case("desc-zero-dim", lambda c: KvBufferDesc("k", (4, 0), 2, 1), ArgumentError, (4, 0),
         "ints > 0"),
    Case("desc-zero-row-bytes", lambda c: KvBufferDesc("k", (4,), 0, 1), ArgumentError, 0,
         "> 0"),
    Case("desc-empty-name", lambda c: KvBufferDesc("", (4,), 2, 1), ArgumentError, "",
         "non-empty str"),
    Case("desc-zero-tokens-per-row", lambda c: KvBufferDesc("k", (4,), 2, 0), ArgumentError, 0,
         "> 0"),
    Case("hybrid-swa-of-a-full-attention-model",
         lambda c: hybrid_swa_descs("llama-3.1-8b", reserved_tokens=RESERVED, page_size=PAGE,
                                    dtype="bf16"), ArgumentError, "llama-3.1-8b", "hybrid"),
    Case("model-descs-of-a-hybrid-model",
         lambda c: model_descs("gpt-oss-120b", reserved_tokens=RESERVED, page_size=PAGE,
                               dtype="bf16"), ArgumentError, "gpt-oss-120b", "hybrid_swa_descs"),
    Case("load-an-unknown-model", lambda c: load_model("no-such-model"), ArgumentError,
         "no-such-model", "llama-3.1-8b"),
    Case("itemsize-of-none", lambda c: dtype_itemsize(None), UnknownDtypeError, None,
         "bfloat16"),
    # These raised bare ValueErrors (or let a bool or infinity through).
    Case("align-up-alignment-zero", lambda c: align_up(4096, 0), ArgumentError, 0, "> 0"),
    Case("align-down-value-negative", lambda c: align_down(-1, 4096), ArgumentError, -1, ">= 0"),
    Case("policy-spec-unknown", lambda c: parse_policy("fixed:3"), ArgumentError, "fixed:3",
         "'chunked:MiB'"),
    Case("policy-spec-number-not-parsing", lambda c: parse_policy("chunked:two"), ArgumentError,
         "chunked:two", "'chunked:MiB'"),
    Case("geometric-factor-inf", lambda c: Geometric(math.inf), ArgumentError, math.inf,
         "(1, 1e6]"),
    Case("geometric-factor-bool", lambda c: Geometric(True), ArgumentError, True, "(1, 1e6]"),
    Case("decode-growth-step-zero",
         lambda c: decode_growth([Exact()], tokens=1024, step_tokens=0), ArgumentError, 0,
         ">= 1"),
    # ... and these let a bool through as an int or a number (True >= 1, True > 0).
    Case("fault-nth-bool", lambda c: Fault(nth=True), ArgumentError, True, "an int >= 1"),
    Case("quantiles-of-a-bool", lambda c: quantiles([1.0, True]), ArgumentError, [1.0, True],
         "finite ratios > 0"),
]

#: Rows once pinned as library bugs (fixed): capacity arguments are type-checked.
PLAIN_BUGS = [
    Case("sim-driver-capacity-float", lambda c: SimDriver(capacity_bytes=2.5 * GiB),
         ArgumentError, 2.5 * GiB, "an int"),
    Case("sim-driver-capacity-str", lambda c: SimDriver(capacity_bytes="80GB"),
         ArgumentError, "80GB", "an int"),
    Case("host-driver-capacity-bool", lambda c: _host_driver(capacity_bytes=True),
         ArgumentError, True, "an int > 0"),
]


# -- the tests --------------------------------------------------------------------------------


@pytest.fixture
def ctx(driver: Driver) -> Iterator[Ctx]:
    c = Ctx(driver)
    yield c
    for o in c.owners:
        o.close()
    for a in c.arenas:
        a.close()


def _check(case: Case, ctx: Ctx) -> None:
    _build(ctx, case.needs)
    before = ctx.state()
    with pytest.raises(KvvmmError) as info:
        case.call(ctx)
    err = info.value
    assert type(err) is case.error, f"{type(err).__name__}: {err}"
    text = str(err)
    assert str(case.value) in text, f"value {case.value!r} not named in: {text}"
    assert case.limit in text, f"limit {case.limit!r} not named in: {text}"
    if isinstance(err, ArgumentError):
        assert err.limit in text and str(err.value) in text
    assert ctx.state() == before, "a refused call changed something"


@pytest.mark.parametrize("case", [c.param() for c in ARENA_CASES + OWNER_CASES])
def test_a_bad_input_to_an_arena_or_owner_is_a_typed_error_that_commits_nothing(
    case: Case, ctx: Ctx
) -> None:
    _check(case, ctx)


@pytest.mark.parametrize("case", [c.param() for c in PLAIN_CASES] + PLAIN_BUGS)
def test_a_bad_input_to_a_policy_driver_or_layout_is_a_typed_error_naming_value_and_limit(
    case: Case, make_driver: MakeDriver
) -> None:
    if case.id.startswith("host-") and not sys.platform.startswith("linux"):
        pytest.skip("the host driver needs Linux")
    _check(case, Ctx(make_driver("sim")))


#: A bool-then-int test written out by hand, in either order, across line breaks too.
_HAND_CHECK = re.compile(
    r"isinstance\([^()]*,\s*bool\)\s+or\s+not\s+isinstance"
    r"|isinstance\([^()]*,\s*int\)\s+and\s+not\s+isinstance\([^()]*,\s*bool\)"
    r"|not\s+isinstance\([^()]*,\s*bool\)\s+and\s+isinstance\([^()]*,\s*int\)"
    r"|not\s+isinstance\([^()]*,\s*int\)\s+or\s+isinstance\([^()]*,\s*bool\)")


def test_no_hand_written_bool_then_int_check_is_left_in_kvvmm() -> None:
    # 55 such checks, each a little different, went through kvvmm.checks
    # (is_int, int_arg, is_number, number_arg). checks.py is where the test lives;
    # errors.py sits below checks (checks imports it), so its one message helper keeps its own.
    assert _HAND_CHECK.search("if isinstance(n, bool) or not\n        isinstance(n, int):")
    assert _HAND_CHECK.search("n if isinstance(n, int) and not isinstance(n, bool) else -1")
    root = Path(kvvmm.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 100
    found = []
    for path in files:
        rel = path.relative_to(root.parent).as_posix()
        if rel in ("kvvmm/checks.py", "kvvmm/errors.py"):
            continue
        text = path.read_text(encoding="utf-8")
        found += [f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
                  for m in _HAND_CHECK.finditer(text)]
    assert found == [], "check these through kvvmm.checks:\n" + "\n".join(found)


def test_there_are_at_least_forty_distinct_bad_inputs() -> None:
    ids = [c.id for c in ARENA_CASES + OWNER_CASES + PLAIN_CASES]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 40


def test_a_refused_finalize_leaves_an_owner_usable(driver_kind: str, make_driver: MakeDriver
                                                   ) -> None:
    ctx = Ctx(make_driver(driver_kind))
    owner = ctx.owner_with()
    with pytest.raises(OutOfRangeError):
        owner.finalize(RESERVED + 1)
    owner.finalize(RESERVED)
    assert owner.final_tokens == RESERVED
    owner.close()
    assert ctx.driver.stats().clean
