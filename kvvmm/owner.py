"""KvBufferOwner: a model's KV buffers in one arena, backed as serving needs them.

The flow SGLang uses to size its KV pool after CUDA-graph capture:

1. construct: lay every buffer out in one arena at its upper-bound shape (``reserved_tokens``)
   so tensor pointers never move, and back one page of each (slot 0: capture routes every
   dummy KV write there);
2. capture CUDA graphs against those tensors;
3. ``finalize(n)``: back each buffer's final span now that the memory budget is known;
4. ``ensure_prefix(n)`` grows backing on demand, ``shrink(n)`` gives memory back.

Every span is checked before anything is committed; nothing is clamped. A growth policy
decides handle sizes (see :mod:`kvvmm.policy`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvvmm.arena import Arena
from kvvmm.driver.base import Driver
from kvvmm.dtypes import dtype_itemsize, dtype_name
from kvvmm.errors import ArgumentError, ClosedError, DriverError, OutOfRangeError
from kvvmm.layout import KvBufferDesc
from kvvmm.policy import Chunked, Exact, Geometric, GrowthPolicy, default_policy
from kvvmm.record.trace import Trace
from kvvmm.snapshot import BufferInfo, OwnerSnapshot
from kvvmm.units import align_up

if TYPE_CHECKING:
    import torch

__all__ = ["BufferInfo", "Chunked", "Exact", "Geometric", "KvBufferOwner", "OwnerSnapshot"]

_EXACT = Exact()


class KvBufferOwner:
    """Owns one arena and the KV buffers laid out in it, in ``descs`` order.

    Args:
        driver: any driver.
        device: device ordinal (default: the driver's).
        dtype: a torch dtype or its name (``"bfloat16"``).
        page_size: tokens per page, > 0.
        reserved_tokens: upper bound on tokens the buffers can ever hold, >= ``page_size``.
        descs: the buffers (:class:`~kvvmm.layout.KvBufferDesc`), K buffers first by
            convention; names must be unique.
        policy: growth policy for ``ensure_prefix`` (default: :func:`~kvvmm.policy.default_policy`).
        name: the arena's name.
        trace: a :class:`~kvvmm.record.Trace` the arena records its operations in.
    Raises:
        ArgumentError, OutOfRangeError, UnknownDtypeError: bad arguments; nothing reserved.
        DriverError: reserving or backing slot 0 failed; nothing is left behind.
    """

    def __init__(
        self,
        *,
        driver: Driver,
        device: int | None = None,
        dtype: Any,
        page_size: int,
        reserved_tokens: int,
        descs: Sequence[KvBufferDesc],
        policy: GrowthPolicy | None = None,
        name: str = "kv",
        trace: Trace | None = None,
    ) -> None:
        self.dtype = dtype_name(dtype)
        self.itemsize = dtype_itemsize(self.dtype)
        self.page_size = _tokens("page_size", page_size, lo=1, hi=None)
        self.reserved_tokens = _tokens("reserved_tokens", reserved_tokens, lo=page_size,
                                       hi=None, what="page_size")
        if isinstance(descs, (str, bytes)) or not isinstance(descs, Sequence) or not descs:
            raise ArgumentError("descs", descs, "a non-empty sequence of KvBufferDesc")
        for i, d in enumerate(descs):
            if not isinstance(d, KvBufferDesc):
                raise ArgumentError(f"descs[{i}]", d, "a KvBufferDesc")
        names = [d.name for d in descs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ArgumentError("descs", dup, "buffers with unique names")
        if policy is None:
            policy = default_policy()
        if not isinstance(policy, (Exact, Chunked, Geometric)) and not callable(
            getattr(policy, "target_bytes", None)
        ):
            raise ArgumentError("policy", policy, "Exact(), Chunked(...) or Geometric(...)")
        self.policy: GrowthPolicy = policy
        self.descs: tuple[KvBufferDesc, ...] = tuple(descs)
        gran = driver.granularity()
        self._spans = [d.reserved_span_bytes(self.itemsize) for d in self.descs]
        self._limits = [align_up(s, gran) for s in self._spans]
        # A desc too small for reserved_tokens is a layout bug: refuse before reserving.
        for d, span in zip(self.descs, self._spans, strict=True):
            need = d.final_span_bytes(self.reserved_tokens, self.page_size)
            if need > span:
                raise OutOfRangeError(
                    "reserved_tokens", reserved_tokens,
                    f"at most what buffer {d.name!r} holds: its final span at "
                    f"{reserved_tokens} tokens is {need} bytes but its shape {d.shape} "
                    f"reserves {span}",
                )
        self.prefix_tokens = 0
        self.final_tokens: int | None = None
        self._closed = False
        # Decode growth calls ensure_prefix once per step for every buffer: keep what its
        # fast path needs in plain lists (rows of each buffer, backed bytes mirrored from the
        # arena after every change) so a step with nothing to back costs one pass of ints.
        self._rows = [(d.tokens_per_row, d.row_bytes) for d in self.descs]
        self._backed = [0] * len(self.descs)
        self.arena = Arena(driver, reserve_bytes=sum(self._limits), device=device, name=name,
                           trace=trace)
        try:
            self._offsets = [self.arena.allocate(s, d.name)
                             for d, s in zip(self.descs, self._spans, strict=True)]
            self.tensors: list[torch.Tensor] = [
                self.arena.tensor(o, d.shape, self.dtype)
                for o, d in zip(self._offsets, self.descs, strict=True)
            ]
            # Slot 0 before capture, exactly one page: the budget is unknown until after it.
            self._back([d.prefix_span_bytes(self.page_size, self.page_size) for d in self.descs],
                       _EXACT)
            self.prefix_tokens = self.page_size
        except BaseException:
            self.tensors = []
            self.arena.close()
            raise

    def __repr__(self) -> str:
        return (f"KvBufferOwner({len(self.descs)} buffers, {self.dtype}, page {self.page_size}, "
                f"reserved {self.reserved_tokens} tokens, final {self.final_tokens}, "
                f"policy {self.policy})")

    def __enter__(self) -> KvBufferOwner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- backing --------------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"KvBufferOwner: {what} after close()")

    def _back(self, spans: Sequence[int], policy: GrowthPolicy) -> int:
        """Back each buffer to at least ``spans[i]``; check every span before any commit."""
        for d, span, limit in zip(self.descs, spans, self._spans, strict=True):
            if not 0 <= span <= limit:
                raise OutOfRangeError(
                    f"span of {d.name!r}", span, f"in [0, {limit}] (its reserved tensor bytes)"
                )
        gran = self.arena.granularity
        requests = []
        for off, span, limit, backed in zip(self._offsets, spans, self._limits, self._backed,
                                            strict=True):
            if span > backed:
                target = policy.target_bytes(backed, span, limit, gran)
                # A policy's answer is checked like any input: short of the span would leave
                # token slots unbacked (illegal addresses on a GPU), past the limit or off the
                # granularity the commit itself would refuse.
                if not (span <= target <= limit and (target % gran == 0 or target == limit)):
                    raise ArgumentError(
                        "policy", policy,
                        f"a policy whose target_bytes lies in [{span}, {limit}] and is a "
                        f"multiple of {gran} (it answered {target} for buffer at {off})",
                    )
                requests.append((off, target))
        if not requests:
            return 0
        try:
            return self.arena.commit_many(requests)
        finally:
            self._sync_backed()

    def _sync_backed(self) -> None:
        self._backed = [self.arena.backed_of(o) for o in self._offsets]

    def ensure_prefix(self, n: int) -> int:
        """Back the first ``n`` token slots of every buffer (the growth policy sizes handles).

        Args:
            n: tokens, in ``[0, reserved_tokens]``.
        Returns:
            Bytes newly backed.
        Raises:
            ArgumentError, OutOfRangeError: bad ``n``; nothing committed.
            DriverError: a driver call failed; every buffer is as it was.
        """
        self._check_open("ensure_prefix")
        n = _tokens("n", n, lo=0, hi=self.reserved_tokens, what="0")
        # KvBufferDesc.prefix_span_bytes, inlined: rows(n) * row_bytes.
        spans = [-(-n // tpr) * rb for tpr, rb in self._rows]
        if all(s <= b for s, b in zip(spans, self._backed, strict=True)):
            self.prefix_tokens = max(self.prefix_tokens, n)
            return 0
        added = self._back(spans, self.policy)
        self.prefix_tokens = max(self.prefix_tokens, n)
        return added

    def finalize(self, n: int) -> int:
        """Back each buffer's final span for ``n`` tokens and make ``n`` the capacity.

        The final span includes one padded page beyond ``n`` (it absorbs the dummy writes
        to slot 0). Backed exactly: the size is known, over-commit buys nothing.

        Args:
            n: tokens, ``page_size <= n <= reserved_tokens``.
        Returns:
            Bytes newly backed.
        Raises:
            ArgumentError, OutOfRangeError: bad ``n``; nothing committed.
            DriverError: a driver call failed; every buffer is as it was.
        """
        self._check_open("finalize")
        n = _tokens("n", n, lo=self.page_size, hi=self.reserved_tokens, what="page_size")
        added = self._back([d.final_span_bytes(n, self.page_size) for d in self.descs], _EXACT)
        self.final_tokens = n
        return added

    def shrink(self, n: int) -> int:
        """Give back whole mappings beyond each buffer's final span for ``n`` tokens.

        Maps are whole handles, so a handle straddling the span stays backed.

        Args:
            n: tokens to keep, ``page_size <= n <= reserved_tokens``.
        Returns:
            Bytes given back.
        Raises:
            ArgumentError, OutOfRangeError: bad ``n``; nothing changed.
            DriverError: a driver call failed; every buffer is as it was.
        """
        self._check_open("shrink")
        n = _tokens("n", n, lo=self.page_size, hi=self.reserved_tokens, what="page_size")
        keep = [d.final_span_bytes(n, self.page_size) for d in self.descs]
        try:
            given = self.arena.decommit_many(zip(self._offsets, keep, strict=True))
        finally:
            self._sync_backed()
        self.prefix_tokens = min(self.prefix_tokens, n)
        if self.final_tokens is not None:
            self.final_tokens = min(self.final_tokens, n)
        return given

    # -- state ----------------------------------------------------------------------------

    @property
    def backed_bytes(self) -> int:
        """Bytes backed across all buffers (0 after close)."""
        return 0 if self._closed else self.arena.backed_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    def snapshot(self) -> OwnerSnapshot:
        """Frozen view of the owner and its arena now."""
        arena = self.arena.snapshot()
        ps = self.page_size
        buffers = tuple(
            BufferInfo(
                name=d.name, offset=a.offset, shape=tuple(d.shape), reserved_span_bytes=span,
                aligned_bytes=a.size_bytes, backed_bytes=a.backed_bytes,
                page0_bytes=d.prefix_span_bytes(ps, ps),
                prefix_bytes=d.prefix_span_bytes(self.prefix_tokens, ps),
                final_bytes=None if self.final_tokens is None
                else d.final_span_bytes(self.final_tokens, ps),
            )
            for d, span, a in zip(self.descs, self._spans, arena.allocations, strict=True)
        )
        return OwnerSnapshot(arena=arena, dtype=self.dtype, page_size=ps,
                             reserved_tokens=self.reserved_tokens,
                             prefix_tokens=self.prefix_tokens, final_tokens=self.final_tokens,
                             policy=str(self.policy), buffers=buffers)

    def close(self) -> None:
        """Drop the tensors and close the arena (idempotent).

        Tensors the caller still holds keep their memory until they go (see ``Arena.close``).
        Raises DriverError if the arena could not give its memory back (see ``Arena.close``);
        the owner stays usable when nothing was given back.
        """
        if self._closed:
            self.arena.close()  # retries a failed release, else a no-op
            return
        # Drop our tensors first, so the arena is not kept waiting for views we hold.
        self.tensors = []
        self._closed = True
        try:
            self.arena.close()
        except DriverError:
            if not self.arena.closed:  # nothing was given back: usable as before
                self._closed = False
                self.tensors = [self.arena.tensor(o, d.shape, self.dtype)
                                for o, d in zip(self._offsets, self.descs, strict=True)]
            raise


def _tokens(name: str, value: object, *, lo: int, hi: int | None, what: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(name, value, "an int (tokens)")
    if value < lo:
        named = what and what != str(lo)
        raise ArgumentError(name, value, f">= {what} ({lo})" if named else f">= {lo}")
    if hi is not None and value > hi:
        raise OutOfRangeError(name, value, f"<= reserved_tokens ({hi})")
    return value
