"""Capacity planner: how many KV tokens fit a GPU, how much VA to reserve, what backing costs.

The budget follows SGLang's post-capture rule, ``max(0, free - headroom) + backed``
(``backed``: KV memory already committed when ``free`` was read), or with ``engine="vllm"``
vLLM's extensible KV cache (:func:`vllm_kv_bytes`). Without measured figures, ``free`` is
the device's capacity less the weights the model config implies, and ``headroom = total *
(1 - mem_fraction_static)``.

By default (``count_overhead=False``) only token slots count, as SGLang sizes its pool::

    tokens * bytes_per_token <= budget_bytes < (tokens + page_size) * bytes_per_token

with ``tokens`` a multiple of ``page_size``; the padded pages and the granularity rounding
come on top (``padding_bytes``, ``granularity_waste_bytes``, ``over_budget_bytes``). With
``count_overhead=True`` everything finalize backs counts::

    final_backed_bytes(tokens) <= budget_bytes < final_backed_bytes(tokens + page_size)

``max_total_tokens`` caps the tokens at whole pages of it and the budget at what they cost.
``va_reserve_bytes`` is each buffer's span at ``reserved_tokens`` (default: the planned
tokens) rounded up to the granularity. A hybrid sliding-window model's sliding pool is sized
first and its cost leaves the full pool's budget; the top-level ``bytes_per_token`` and
``tokens`` are the full pool's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from kvvmm.checks import bool_arg, int_arg, number_arg
from kvvmm.dtypes import dtype_itemsize, dtype_name
from kvvmm.errors import ArgumentError, OutOfRangeError
from kvvmm.hardware import DeviceProfile, get_profile
from kvvmm.layout.desc import KvBufferDesc
from kvvmm.layout.model_buffers import (
    hybrid_swa_descs,
    kv_bytes_per_token,
    model_descs,
    swa_kv_bytes_per_token,
)
from kvvmm.layout.models import ModelConfig, ModelLike, load_model, weights_bytes_per_rank
from kvvmm.layout.pools import (
    HandleCount,
    PoolPlan,
    check_policies,
    default_policies,
    final_backed,
    fit_tokens,
    pool_plan,
    shape_groups,
    sum_handles,
)
from kvvmm.policy import GrowthPolicy
from kvvmm.units import TiB, align_up, fmt_bytes

__all__ = [
    "DEFAULT_MEM_FRACTION_STATIC",
    "DEFAULT_PAGE_SIZE",
    "ENGINES",
    "LARGE_TOKENS",
    "LARGE_VA_BYTES",
    "TP_SIZES",
    "VLLM_GPU_MEMORY_UTILIZATION",
    "VLLM_MARGIN_FLOOR_BYTES",
    "VLLM_MARGIN_FRACTION",
    "VLLM_WARMUP_RESERVE_FRACTION",
    "HandleCount",
    "Plan",
    "PlanOptions",
    "PlanRequest",
    "PoolPlan",
    "default_policies",
    "plan",
    "plan_request",
    "plan_smallest_tp",
    "vllm_kv_bytes",
    "vllm_warmup_bytes",
]

#: Tokens per page when none is given (vLLM's default block size; SGLang serves 1 to 64).
DEFAULT_PAGE_SIZE = 16

#: Share of the device's memory (before weights) for weights + KV when no headroom is given;
#: the rest, ``total * (1 - mem_fraction_static)``, is kept back for activations, CUDA graphs
#: and the allocator (SGLang's ``profile_max_num_token``). SGLang's own default depends on the
#: GPU and the TP size (about 0.8 to 0.9): pass the figure your engine uses.
DEFAULT_MEM_FRACTION_STATIC = 0.9

#: A VA reservation above this draws a warning: VA costs no memory, but a petabyte for one
#: rank's KV cache is a mistake of units or of a missing cap, not a plan.
LARGE_VA_BYTES = 1024 * TiB

#: More token slots than this draw a warning: engines index KV slots with int32 (SGLang's
#: ``req_to_token`` table), so 2**31 slots cannot be addressed.
LARGE_TOKENS = 2**31

#: Whose sizing rule :func:`plan` follows: SGLang's post-capture ``free - headroom + backed``,
#: or vLLM's extensible KV cache (:func:`vllm_kv_bytes`).
ENGINES = ("sglang", "vllm")

# vLLM's extensible KV cache on CUDA: the margin kept free beyond the transient peak (the
# floor, else that share of the peak); the share of the headroom warmup leaves uncommitted;
# the default gpu_memory_utilization (the share of the device the instance may use).
VLLM_MARGIN_FLOOR_BYTES = 1 << 30
VLLM_MARGIN_FRACTION = 0.75
VLLM_WARMUP_RESERVE_FRACTION = 0.1
VLLM_GPU_MEMORY_UTILIZATION = 1.0

#: The tensor-parallel sizes :func:`plan_smallest_tp` tries by default: the powers of two
#: serving engines run, up to two 8-GPU nodes.
TP_SIZES = (1, 2, 4, 8, 16)


@dataclass(frozen=True, slots=True)
class Plan:
    """A capacity plan for one model on one GPU (one tensor-parallel rank)."""

    gpu: str  #: device profile key (``"h200"``)
    gpu_name: str  #: the device's name
    capacity_bytes: int  #: device memory of the profile
    granularity_bytes: int  #: VMM granularity of the profile
    model: str  #: model name
    dtype: str  #: KV dtype (torch name)
    page_size: int  #: tokens per page
    tp: int  #: tensor-parallel size; every figure is per rank
    layout: str  #: ``"token_major"`` or ``"page_major"``
    count_overhead: bool  #: whether padding and granularity rounding count against the budget
    weights_dtype: str  #: dtype the weights were counted in
    weights_bytes: int | None  #: the model's weights per rank (``None``: config lacks sizes)
    mem_fraction_static: float | None  #: the fraction the headroom came from (``None``: given)
    free_bytes: int | None  #: free memory after weights the budget came from (``None``: explicit)
    headroom_bytes: int | None  #: memory kept back (``None``: explicit budget)
    backed_bytes: int  #: KV memory already backed when ``free_bytes`` was read (added back)
    memory_budget_bytes: int  #: explicit, or ``max(0, free - headroom) + backed``, before the cap
    max_total_tokens: int | None  #: the token cap (``None``: none)
    budget_bytes: int  #: KV budget: ``memory_budget_bytes``, capped by ``max_total_tokens``
    bytes_per_token: int  #: the full pool's KV bytes per token per rank
    tokens: int  #: the full pool's capacity in tokens
    num_buffers: int  #: buffers over all pools
    va_reserve_bytes: int  #: VA reserved over all pools
    final_backed_bytes: int  #: memory backed after finalize, over all pools
    padding_bytes: int  #: padded pages over all pools
    granularity_waste_bytes: int  #: granularity rounding of the backing, over all pools
    va_slack_bytes: int  #: granularity rounding of the VA, over all pools
    over_budget_bytes: int  #: ``max(0, final_backed_bytes - budget_bytes)``
    decode_step_tokens: int  #: tokens per growth step in the handle simulation
    handles: tuple[HandleCount, ...]  #: per policy, over all pools
    pools: tuple[PoolPlan, ...]  #: ``(full,)`` or ``(full, swa)`` for hybrid models
    warnings: tuple[str, ...]  #: figures that are legal but almost surely a mistake
    engine: str = "sglang"  #: whose sizing rule the budget follows (:data:`ENGINES`)
    #: ``engine="vllm"``: the share of the device the instance may use (else ``None``)
    gpu_memory_utilization: float | None = None
    #: ``engine="vllm"``: the activations' transient peak kept free (else ``None``)
    activation_peak_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON-ready data: ``pools`` and ``handles`` as lists of dicts."""
        return _plain(asdict(self))  # type: ignore[no-any-return]


def _plain(value: Any) -> Any:
    # asdict keeps tuples; JSON and notebook diffs read lists.
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _int(lo: int, unit: str, *, none: bool = False) -> dict[str, Callable[[str, Any], Any]]:
    """A field's check: an int >= ``lo`` (or None, with ``none``)."""
    def check(name: str, value: Any) -> int | None:
        return None if none and value is None else int_arg(name, value, lo=lo, unit=unit)
    return {"check": check}


def _share(name: str, value: Any) -> float | None:
    return None if value is None else number_arg(name, value, lo=0, hi=1, lo_open=True,
                                                 limit="a float in (0, 1]")


def _one_of(choices: Sequence[str]) -> dict[str, Callable[[str, Any], Any]]:
    def check(name: str, value: Any) -> str:
        if value not in choices:
            raise ArgumentError(name, value, f"one of {list(choices)}")
        return str(value)
    return {"check": check}


_DTYPE = {"check": lambda name, value: dtype_name(value)}
_OPT_DTYPE = {"check": lambda name, value: None if value is None else dtype_name(value)}


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """Every option of :func:`plan` but the GPU and the model, each checked at construction.

    Each field's metadata holds its check: a bad value, or options that exclude each other,
    raise :class:`~kvvmm.errors.ArgumentError` (or ``OutOfRangeError``,
    ``UnknownDtypeError``) naming it and its limit.
    """

    #: KV dtype: a name or a torch dtype (kept as the name)
    dtype: str = field(default="bfloat16", metadata=_DTYPE)
    #: tokens per page, > 0; the planned tokens are a multiple of it
    page_size: int = field(default=DEFAULT_PAGE_SIZE, metadata=_int(1, "tokens"))
    #: tensor-parallel size; every figure is per rank
    tp: int = field(default=1, metadata=_int(1, "tensor-parallel ranks"))
    #: the KV budget, alone; ``None``: SGLang's ``max(0, free - headroom) + backed``
    budget_bytes: int | None = field(default=None, metadata=_int(0, "bytes", none=True))
    #: memory kept back for activations, CUDA graphs and the allocator (``None``:
    #: ``capacity * (1 - mem_fraction_static)``); not with ``mem_fraction_static``
    headroom_bytes: int | None = field(default=None, metadata=_int(0, "bytes", none=True))
    #: free memory after weights and graph capture, in ``[0, capacity]``, as the engine
    #: measures it (``None``: the capacity less the weights per rank)
    free_bytes: int | None = field(default=None, metadata=_int(0, "bytes", none=True))
    #: KV memory already backed when ``free_bytes`` was read (SGLang adds it back: the
    #: slot-0 page is part of the pool, not lost memory)
    backed_bytes: int = field(default=0, metadata=_int(0, "bytes"))
    #: ``"token_major"`` or ``"page_major"``
    layout: str = field(default="token_major", metadata=_one_of(("token_major", "page_major")))
    #: growth policies whose handle counts to report: one, several, or None
    #: (:func:`default_policies`); kept as a tuple
    policy: tuple[GrowthPolicy, ...] = field(default_factory=default_policies,
                                             metadata={"check": lambda n, v: check_policies(v)})
    #: tokens added per growth step in the handle simulation
    decode_step_tokens: int = field(default=4096, metadata=_int(1, "tokens"))
    #: the full pool's upper bound for the VA, >= the planned tokens (``None``: those)
    reserved_tokens: int | None = field(default=None, metadata=_int(1, "tokens", none=True))
    #: hybrid models: the sliding pool's capacity (``None``: one sequence's window,
    #: :func:`~kvvmm.layout.swa_reserved_tokens_default`)
    swa_reserved_tokens: int | None = field(default=None,
                                            metadata=_int(1, "tokens", none=True))
    #: count padded pages and granularity rounding against the budget (the module
    #: docstring says which invariant each choice keeps)
    count_overhead: bool = field(default=False,
                                 metadata={"check": lambda n, v: bool_arg(n, v, limit="a bool")})
    #: SGLang's share of the device for weights + KV, in (0, 1] (``None``:
    #: :data:`DEFAULT_MEM_FRACTION_STATIC`); not with ``headroom_bytes``
    mem_fraction_static: float | None = field(default=None, metadata={"check": _share})
    #: dtype the weights are counted in (``None``: the model's own, as its config says: fp8
    #: for DeepSeek-V3, else its ``torch_dtype``; bf16 when unknown)
    weights_dtype: str | None = field(default=None, metadata=_OPT_DTYPE)
    #: cap on the full pool's tokens, >= ``page_size`` (SGLang's option); the budget is
    #: capped at what the capped tokens cost
    max_total_tokens: int | None = field(default=None, metadata=_int(1, "tokens", none=True))
    #: whose sizing rule the budget follows (:data:`ENGINES`): ``"sglang"``'s post-capture
    #: ``free - headroom + backed``, or ``"vllm"``'s extensible KV cache (:func:`vllm_kv_bytes`)
    engine: str = field(default="sglang", metadata=_one_of(ENGINES))
    #: ``engine="vllm"``: the share of the device the instance may use, in (0, 1]
    #: (``None``: :data:`VLLM_GPU_MEMORY_UTILIZATION`)
    gpu_memory_utilization: float | None = field(default=None, metadata={"check": _share})
    #: ``engine="vllm"``: the activations' transient peak vLLM measured (its log's
    #: "allocated at peak"; ``None``: 0, the margin floor alone)
    activation_peak_bytes: int | None = field(default=None,
                                              metadata=_int(0, "bytes", none=True))

    def __post_init__(self) -> None:
        for f in fields(self):
            if "check" in f.metadata:
                object.__setattr__(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))
        self._check_together()

    def _check_together(self) -> None:
        """Refuse options that exclude each other."""
        theirs, why = ((("headroom_bytes", "mem_fraction_static"),
                        "vLLM keeps back its measured margin and peak, not a share; pass "
                        "activation_peak_bytes") if self.engine == "vllm" else
                       (("gpu_memory_utilization", "activation_peak_bytes"),
                        "it is vLLM's option; pass engine='vllm'"))
        for name in theirs:
            if getattr(self, name) is not None:
                raise ArgumentError(name, getattr(self, name), f"None with engine={self.engine!r}",
                                    why)
        replaced = (self.free_bytes, self.headroom_bytes, self.mem_fraction_static,
                    self.gpu_memory_utilization, self.activation_peak_bytes)
        if self.budget_bytes is not None and (any(v is not None for v in replaced)
                                              or self.backed_bytes):
            raise ArgumentError("budget_bytes", self.budget_bytes, "given alone",
                                "it replaces free_bytes - headroom_bytes + backed_bytes; pass "
                                "one or the other")
        if self.headroom_bytes is not None and self.mem_fraction_static is not None:
            raise ArgumentError("headroom_bytes", self.headroom_bytes,
                                "given without mem_fraction_static",
                                "the headroom is total * (1 - mem_fraction_static); pass one or "
                                "the other")

    @classmethod
    def build(cls, base: PlanOptions | None = None, **changes: Any) -> PlanOptions:
        """``base`` (default: every default) with ``changes``, checked.

        Raises:
            ArgumentError: naming ``option``: a name that is no field; or a bad value.
        """
        names = [f.name for f in fields(cls)]
        for k in changes:
            if k not in names:
                raise ArgumentError("option", k, f"one of {names}")
        return cls(**changes) if base is None else replace(base, **changes)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRequest(PlanOptions):
    """What :func:`plan` was asked: the options, the device's profile and the model loaded,
    and ``weights_dtype`` resolved (never ``None``)."""

    profile: DeviceProfile  #: the device
    model: ModelConfig  #: the model's attention geometry
    itemsize: int  #: bytes per KV element

    @classmethod
    def resolve(cls, gpu: str | DeviceProfile, model: ModelLike,
                options: PlanOptions) -> PlanRequest:
        """Load the profile and the model beside the checked ``options``.

        Raises:
            ArgumentError: an unknown gpu or model.
        """
        cfg = load_model(model)
        given = {f.name: getattr(options, f.name) for f in fields(PlanOptions)}
        given["weights_dtype"] = options.weights_dtype or cfg.weights_dtype or "bfloat16"
        return cls(**given, profile=get_profile(gpu), model=cfg,
                   itemsize=dtype_itemsize(options.dtype))


@dataclass(frozen=True, slots=True)
class _Budget:
    budget_bytes: int  # what the pools are sized from, before the token cap
    weights_bytes: int | None  # the weights per rank (None: unknown)
    mem_fraction_static: float | None  # where the headroom came from (None: given or explicit)
    free_bytes: int | None  # None: explicit budget
    headroom_bytes: int | None  # None: explicit budget
    how: str  # the formula with its figures, for error messages
    warnings: tuple[str, ...]


def _budget(req: PlanRequest) -> _Budget:
    """The KV budget: explicit, or SGLang's post-capture ``max(0, free - headroom) + backed``."""
    cap, key = req.profile.capacity_bytes, req.profile.key
    weights = weights_bytes_per_rank(req.model, req.weights_dtype, req.tp)
    if req.budget_bytes is not None:  # given alone: PlanOptions saw to it
        if req.budget_bytes > cap:
            raise OutOfRangeError(
                "budget_bytes", req.budget_bytes, f"<= {cap} ({key}'s capacity, bytes)"
            )
        return _Budget(req.budget_bytes, weights, None, None, None, "explicit", ())
    free, notes = _free_after_weights(req, weights)
    if req.engine == "vllm":
        return _vllm_budget(req, weights, free, notes)
    mfs = None
    if req.headroom_bytes is None:
        mfs = req.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
    head = round(cap * (1 - mfs)) if mfs is not None else req.headroom_bytes or 0
    backed = req.backed_bytes
    how = f"free {fmt_bytes(free)} - headroom {fmt_bytes(head)} + backed {fmt_bytes(backed)}"
    if req.free_bytes is None and weights is not None:
        how += f" (free = capacity {fmt_bytes(cap)} - weights {fmt_bytes(weights)})"
    return _Budget(max(0, free - head) + backed, weights, mfs, free, head, how, notes)


def vllm_kv_bytes(*, init_free_bytes: int, free_bytes: int, committed_bytes: int,
                  requested_bytes: int, transient_peak_bytes: int = 0,
                  torch_reserve_growth_bytes: int = 0) -> int:
    """The KV bytes vLLM's extensible KV cache extends to once warmup and capture ran.

    What the engine holds beside the KV cache is ``init_free - free - committed``; the cache
    gets the rest of ``requested``, capped by the headroom (``free + committed``) less a
    margin of ``max(VLLM_MARGIN_FLOOR_BYTES, int(VLLM_MARGIN_FRACTION * peak))``, and the
    larger of the peak and torch's reservation growth is then kept free in full.

    Args:
        init_free_bytes: device memory free when the engine started, >= 0.
        free_bytes: device memory free after warmup and capture, >= 0.
        committed_bytes: KV memory committed when ``free_bytes`` was read, >= 0.
        requested_bytes: the instance's share of the device (capacity x
            ``gpu_memory_utilization``), >= 0.
        transient_peak_bytes: the activations' allocated peak over the sizing steps, >= 0.
        torch_reserve_growth_bytes: the largest growth of torch's reservation over a sizing
            step, >= 0.
    Returns:
        The KV bytes, >= 0 (vLLM then commits the most blocks whose granules fit them).
    Raises:
        ArgumentError: a figure that is not an int >= 0.
    """
    init_free = int_arg("init_free_bytes", init_free_bytes, lo=0, unit="bytes")
    free = int_arg("free_bytes", free_bytes, lo=0, unit="bytes")
    committed = int_arg("committed_bytes", committed_bytes, lo=0, unit="bytes")
    requested = int_arg("requested_bytes", requested_bytes, lo=0, unit="bytes")
    peak = int_arg("transient_peak_bytes", transient_peak_bytes, lo=0, unit="bytes")
    growth = int_arg("torch_reserve_growth_bytes", torch_reserve_growth_bytes, lo=0,
                     unit="bytes")
    beside_kv = init_free - free - committed
    margin = max(VLLM_MARGIN_FLOOR_BYTES, int(peak * VLLM_MARGIN_FRACTION))
    available = min(requested - beside_kv, free + committed - margin) - max(peak, growth)
    return max(available, 0)


def vllm_warmup_bytes(*, free_bytes: int, committed_bytes: int,
                      transient_peak_bytes: int = 0) -> int:
    """The KV bytes vLLM's warmup may commit before the final sizing.

    The headroom is ``free + committed``; warmup keeps back a reserve, the larger of the
    profiled peak and :data:`VLLM_WARMUP_RESERVE_FRACTION` of the headroom, and a margin of
    ``max(VLLM_MARGIN_FLOOR_BYTES, int(VLLM_MARGIN_FRACTION * reserve))`` beside it.

    Args:
        free_bytes, committed_bytes, transient_peak_bytes: as :func:`vllm_kv_bytes`'s, now.
    Returns:
        The bytes (may be negative: nothing more may be committed; vLLM never goes below
        what it already committed).
    Raises:
        ArgumentError: a figure that is not an int >= 0.
    """
    free = int_arg("free_bytes", free_bytes, lo=0, unit="bytes")
    committed = int_arg("committed_bytes", committed_bytes, lo=0, unit="bytes")
    peak = int_arg("transient_peak_bytes", transient_peak_bytes, lo=0, unit="bytes")
    headroom = free + committed
    reserve = max(peak, int(headroom * VLLM_WARMUP_RESERVE_FRACTION))
    margin = max(VLLM_MARGIN_FLOOR_BYTES, int(reserve * VLLM_MARGIN_FRACTION))
    return headroom - margin - reserve


def _vllm_budget(req: PlanRequest, weights: int | None, free: int,
                 notes: tuple[str, ...]) -> _Budget:
    """vLLM's budget on a device with nothing else on it: it started with all of it free."""
    cap, backed = req.profile.capacity_bytes, req.backed_bytes
    util = req.gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION
    peak = req.activation_peak_bytes or 0
    requested = int(cap * util)
    budget = vllm_kv_bytes(init_free_bytes=cap, free_bytes=free, committed_bytes=backed,
                           requested_bytes=requested, transient_peak_bytes=peak)
    margin = max(VLLM_MARGIN_FLOOR_BYTES, int(peak * VLLM_MARGIN_FRACTION))
    how = (f"vLLM: min(capacity {fmt_bytes(cap)} x {util:g} - beside KV "
           f"{fmt_bytes(cap - free - backed)}, free {fmt_bytes(free)} + backed "
           f"{fmt_bytes(backed)} - margin {fmt_bytes(margin)}) - peak {fmt_bytes(peak)}")
    # What is kept back of free + backed, whichever term of the min bound it.
    return _Budget(budget, weights, None, free, max(0, free + backed - budget), how, notes)


def _free_after_weights(req: PlanRequest, weights: int | None) -> tuple[int, tuple[str, ...]]:
    """Free memory after weights: measured (``free_bytes``), or the device less the weights;
    with the notes to warn of. The backed memory must fit beside it."""
    cap, key = req.profile.capacity_bytes, req.profile.key
    notes: tuple[str, ...] = ()
    if req.free_bytes is not None:
        if req.free_bytes > cap:
            raise OutOfRangeError("free_bytes", req.free_bytes, f"<= {cap} ({key}'s capacity)")
        free = req.free_bytes  # measured: the weights are already out of it
    elif weights is None:
        free, notes = cap, (
            f"{req.model.name}'s config lacks hidden_size, intermediate_size or vocab_size: "
            "its weights are not counted, free = the whole device; pass --free-bytes",
        )
    elif weights >= cap:
        need = -(-weights * req.tp // cap)
        raise OutOfRangeError(
            "tp",
            req.tp,
            f"> {need - 1} for {req.model.name}'s weights to fit {key} at all",
            f"its weights take {fmt_bytes(weights)} per rank in {req.weights_dtype} at tp "
            f"{req.tp}, the device has {fmt_bytes(cap)}; raise tp, pass a smaller "
            "weights_dtype, or pass free_bytes measured after loading",
        )
    else:
        free = cap - weights
    if free + req.backed_bytes > cap:
        raise OutOfRangeError(
            "backed_bytes", req.backed_bytes, f"<= {cap - free} (capacity {cap} - free_bytes "
            f"{free})", "backed memory is not free memory: free + backed cannot exceed the device")
    return free, notes


def _pool_descs(
    req: PlanRequest, full_tokens: int, swa_tokens: int | None
) -> tuple[list[KvBufferDesc], ...]:
    # Row sizes, all the span arithmetic needs, do not depend on the capacity the descs are
    # built for: descs built for any capacity size the pools, and the final ones reserve VA.
    common: dict[str, Any] = dict(
        page_size=req.page_size, dtype=req.dtype, tp=req.tp, layout=req.layout
    )
    if req.model.is_hybrid_swa:
        return hybrid_swa_descs(
            req.model, reserved_tokens=full_tokens, swa_reserved_tokens=swa_tokens, **common
        )
    return (model_descs(req.model, reserved_tokens=full_tokens, **common),)


@dataclass(frozen=True, slots=True)
class _Sizing:
    budget: int  # the budget after the token cap
    bpt: int  # the full pool's bytes per token
    tokens: int  # the full pool's tokens
    upper: int  # the full pool's reserved tokens
    full_budget: int  # the full pool's share of the budget
    swa_bpt: int  # the sliding pool's bytes per token (0: none)
    swa_tokens: int | None  # the sliding pool's tokens (None: no sliding pool)
    swa_cost: int  # the sliding pool's share of the budget


def _swa_share(req: PlanRequest) -> tuple[int | None, int, int]:
    """The sliding pool's (tokens, bytes per token, cost): sized first, by its window."""
    m = req.model
    if req.swa_reserved_tokens is not None and not m.is_hybrid_swa:
        raise ArgumentError(
            "swa_reserved_tokens",
            req.swa_reserved_tokens,
            "None for a model without sliding-window layers",
            f"{m.name} has a single full-attention pool",
        )
    if not m.is_hybrid_swa:
        return None, 0, 0
    page = req.page_size
    if req.swa_reserved_tokens is None:
        # swa_reserved_tokens_default() capped by the full pool's tokens, which are not
        # known yet: take the window, and check the cap once the full pool is sized.
        assert m.sliding_window is not None
        swa_tokens = align_up(m.sliding_window, page) + page
    else:
        swa_tokens = req.swa_reserved_tokens
    swa_bpt = swa_kv_bytes_per_token(m, req.dtype, req.tp)
    if not req.count_overhead:
        return swa_tokens, swa_bpt, swa_tokens * swa_bpt
    groups = shape_groups(_pool_descs(req, swa_tokens, swa_tokens)[1])
    return (
        swa_tokens,
        swa_bpt,
        final_backed(groups, swa_tokens, page, req.profile.granularity_bytes),
    )


def _size_pools(req: PlanRequest, budget: _Budget) -> _Sizing:
    """Fit the full pool's tokens into what the sliding pool leaves of the budget."""
    m, page, gran = req.model, req.page_size, req.profile.granularity_bytes
    bpt = kv_bytes_per_token(m, req.dtype, req.tp)  # also checks tp against the KV heads
    if bpt == 0:
        raise ArgumentError(
            "model", m.name, "a model with at least one full-attention layer", "every layer slides"
        )
    swa_tokens, swa_bpt, swa_cost = _swa_share(req)
    groups = shape_groups(_pool_descs(req, max(page, swa_tokens or 0), swa_tokens)[0])
    capped = _cap_budget(req, budget.budget_bytes, bpt, groups, swa_cost)
    full_budget = capped - swa_cost
    tokens = fit_tokens(full_budget, bpt, groups, page, gran, req.count_overhead)
    if req.max_total_tokens is not None:
        # Granularity rounding makes the capped cost fit a few more pages: cap the tokens too.
        tokens = min(tokens, req.max_total_tokens // page * page)
    if tokens == 0:
        one_page = final_backed(groups, page, page, gran) if req.count_overhead else page * bpt
        raise OutOfRangeError(
            "budget_bytes",
            budget.budget_bytes,
            f">= {one_page + swa_cost} bytes (one page of KV"
            + (f" plus the sliding pool's {swa_cost}" if swa_cost else "")
            + ")",
            f"budget = {budget.how}; {m.name} takes {bpt} bytes per token per rank",
        )
    if swa_tokens is not None and swa_tokens > tokens:
        raise OutOfRangeError(
            "swa_reserved_tokens",
            swa_tokens,
            f"<= {tokens} (the full pool's tokens at this budget)",
            "the budget is too small for the sliding pool to be smaller than the full pool",
        )
    upper = tokens if req.reserved_tokens is None else req.reserved_tokens
    if upper < tokens:
        raise OutOfRangeError(
            "reserved_tokens",
            upper,
            f">= {tokens} (the tokens that fit the budget)",
            "finalize would back spans beyond the reservation",
        )
    return _Sizing(capped, bpt, tokens, upper, full_budget, swa_bpt, swa_tokens, swa_cost)


def _cap_budget(
    req: PlanRequest, budget: int, bpt: int, groups: Counter[tuple[int, int]], swa_cost: int
) -> int:
    """``budget`` capped at what ``max_total_tokens`` (in whole pages) would cost.

    SGLang takes ``min(max_total_tokens, tokens that fit)``; capping the budget at the cost
    of the capped tokens gives the same tokens and keeps the fill invariant.
    """
    if req.max_total_tokens is None:
        return budget
    page = req.page_size
    if req.max_total_tokens < page:
        raise OutOfRangeError(
            "max_total_tokens",
            req.max_total_tokens,
            f">= {page} (one page)",
            "tokens come in pages",
        )
    tokens = req.max_total_tokens // page * page
    gran = req.profile.granularity_bytes
    cost = final_backed(groups, tokens, page, gran) if req.count_overhead else tokens * bpt
    return min(budget, cost + swa_cost)


def _build_pools(req: PlanRequest, s: _Sizing) -> tuple[PoolPlan, ...]:
    """Lay the sized pools out for VA and simulate each policy's handles."""
    descs = _pool_descs(req, s.upper, s.swa_tokens)
    m = req.model
    sized = [("full", len(m.full_layers), s.bpt, s.full_budget, s.tokens, s.upper)]
    if s.swa_tokens is not None:
        sized.append(
            ("swa", len(m.sliding_layers), s.swa_bpt, s.swa_cost, s.swa_tokens, s.swa_tokens)
        )
    return tuple(
        pool_plan(
            name,
            n_layers,
            pool_descs,
            bpt=bpt,
            budget=budget,
            tokens=tokens,
            reserved_tokens=reserved,
            itemsize=req.itemsize,
            page=req.page_size,
            gran=req.profile.granularity_bytes,
            step=req.decode_step_tokens,
            policies=req.policy,
        )
        for (name, n_layers, bpt, budget, tokens, reserved), pool_descs in zip(
            sized, descs, strict=True
        )
    )


def plan_request(req: PlanRequest) -> Plan:
    """Plan a resolved request: budget, tokens, pools, handle counts (see :func:`plan`)."""
    budget = _budget(req)
    sizing = _size_pools(req, budget)
    pools = _build_pools(req, sizing)
    final_backed = sum(p.final_backed_bytes for p in pools)
    return Plan(
        gpu=req.profile.key,
        gpu_name=req.profile.name,
        capacity_bytes=req.profile.capacity_bytes,
        granularity_bytes=req.profile.granularity_bytes,
        model=req.model.name,
        dtype=req.dtype,
        page_size=req.page_size,
        tp=req.tp,
        layout=req.layout,
        count_overhead=req.count_overhead,
        weights_dtype=str(req.weights_dtype),  # resolved: PlanRequest.resolve
        weights_bytes=budget.weights_bytes,
        mem_fraction_static=budget.mem_fraction_static,
        free_bytes=budget.free_bytes,
        headroom_bytes=budget.headroom_bytes,
        backed_bytes=req.backed_bytes,
        memory_budget_bytes=budget.budget_bytes,
        max_total_tokens=req.max_total_tokens,
        budget_bytes=sizing.budget,
        bytes_per_token=sizing.bpt,
        tokens=sizing.tokens,
        num_buffers=sum(p.num_buffers for p in pools),
        va_reserve_bytes=sum(p.va_reserve_bytes for p in pools),
        final_backed_bytes=final_backed,
        padding_bytes=sum(p.padding_bytes for p in pools),
        granularity_waste_bytes=sum(p.granularity_waste_bytes for p in pools),
        va_slack_bytes=sum(p.va_slack_bytes for p in pools),
        over_budget_bytes=max(0, final_backed - sizing.budget),
        decode_step_tokens=req.decode_step_tokens,
        handles=sum_handles(pools),
        pools=pools,
        warnings=budget.warnings + _warnings(pools),
        engine=req.engine,
        gpu_memory_utilization=(req.gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION)
        if req.engine == "vllm" else None,
        activation_peak_bytes=(req.activation_peak_bytes or 0) if req.engine == "vllm"
        else None,
    )


def _warnings(pools: Sequence[PoolPlan]) -> tuple[str, ...]:
    """Legal figures that are almost surely a mistake: say so rather than refuse."""
    out = []
    va = sum(p.va_reserve_bytes for p in pools)
    if va > LARGE_VA_BYTES:
        out.append(
            f"VA reservation {fmt_bytes(va)} > {fmt_bytes(LARGE_VA_BYTES)}: check reserved_tokens "
            "and the units of the sizes given"
        )
    for p in pools:
        if p.reserved_tokens > LARGE_TOKENS:  # reserved_tokens >= tokens: one check for both
            out.append(
                f"{p.name} pool: {p.reserved_tokens:,} token slots (tokens {p.tokens:,}) > 2**31: "
                "int32 KV slot indices cannot address them"
            )
    return tuple(out)


def plan(*, gpu: str | DeviceProfile, model: ModelLike, options: PlanOptions | None = None,
         **changes: Any) -> Plan:
    """Plan a KV cache for ``model`` on one rank of ``gpu``: tokens, VA, backing, handles.

    Args:
        gpu: device profile key (``"h100"``, ``"h200"``, ``"b200"``, ``"gb300"``) or profile.
        model: a :class:`~kvvmm.layout.ModelConfig`, a shipped model key, a config path or dict.
        options: the other options (default :class:`PlanOptions`'s defaults).
        changes: :class:`PlanOptions` fields by name (``page_size=32, tp=8``), over
            ``options``; each field's comment there says what it means and its limit.
    Returns:
        The :class:`Plan`.
    Raises:
        ArgumentError: a bad option (:class:`PlanOptions`: an unknown name, a size that is
            not an int in range, options that exclude each other); an unknown gpu or model;
            ``tp`` not fitting the KV heads; a model with no full-attention layer.
        OutOfRangeError: a budget or memory figure outside the device, weights larger than
            the device (named ``tp``), a budget too small for one page, ``reserved_tokens``
            below the planned tokens, ``max_total_tokens`` under one page.
        UnknownDtypeError: unknown dtype.
    """
    return plan_request(PlanRequest.resolve(gpu, model, PlanOptions.build(options, **changes)))


def plan_smallest_tp(
    *, gpu: str | DeviceProfile, model: ModelLike, tps: Sequence[int] = TP_SIZES,
    **options: Any,
) -> Plan:
    """The :func:`plan` at the smallest tensor-parallel size in ``tps`` at which the model fits.

    A model fits a TP when :func:`plan` finds room there for its weights per rank and at
    least one page of KV after them. A TP where it does not (an :class:`OutOfRangeError`
    naming ``tp`` or ``budget_bytes``) is skipped for the next larger one; any other error
    is the request's, and is raised at once.

    Args:
        gpu, model: as :func:`plan` takes them.
        tps: TP sizes to try, each an int >= 1 (tried from the smallest; default
            :data:`TP_SIZES`).
        options: :func:`plan`'s other keyword arguments (``options=`` and
            :class:`PlanOptions` fields but ``tp``).
    Returns:
        The :class:`Plan` at the smallest TP that fits.
    Raises:
        ArgumentError: ``tps`` empty or not ints >= 1, ``tp`` among ``options``, or a bad
            option (as :func:`plan`).
        OutOfRangeError: naming ``tp``: the model fits at none of ``tps`` (the largest one's
            refusal is the cause).
    """
    if "tp" in options:
        raise ArgumentError("tp", options["tp"], "not given", "plan_smallest_tp picks it "
                            "from tps; call plan(tp=...) for one TP")
    sizes = sorted({int_arg("tps", t, lo=1, unit="tensor-parallel ranks") for t in tps})
    if not sizes:
        raise ArgumentError("tps", list(tps), "a non-empty sequence of TP sizes")
    refusal: OutOfRangeError | None = None
    for tp in sizes:
        try:
            return plan(gpu=gpu, model=model, tp=tp, **options)
        except OutOfRangeError as e:
            if not _misfit(e):
                raise
            refusal = e
    assert refusal is not None  # sizes is not empty, and every one was refused
    name, key = load_model(model).name, get_profile(gpu).key
    raise OutOfRangeError(
        "tp", sizes[-1], f"a TP in {sizes} at which {name} fits {key}",
        f"not even at TP {sizes[-1]}: {refusal}",
    ) from refusal


def _misfit(e: OutOfRangeError) -> bool:
    """Whether :func:`plan` refused a TP for the model not fitting there (a larger may fit).

    Its weights per rank exceed the device (named ``tp``), or leave less than a page of KV
    (``budget_bytes`` below its one-page lower bound, ``">= ..."``); a budget above the
    device (``"<= ..."``) is the request's at every TP.
    """
    return e.name == "tp" or (e.name == "budget_bytes" and e.limit.startswith(">="))
