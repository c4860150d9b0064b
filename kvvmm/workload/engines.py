"""Serving engines' own sizing rules as lab strategies: vLLM 0.34's extensible KV cache.

vLLM 0.34 reserves VA for its KV cache at startup, commits blocks during warmup (as many as
its warmup shapes address, never past what :func:`~kvvmm.layout.vllm_warmup_bytes` allows),
and after CUDA-graph capture extends it once to the size measured then
(:func:`~kvvmm.layout.vllm_kv_bytes`). It neither grows nor shrinks while serving.
:class:`VllmExtensible` replays that on a :class:`~kvvmm.owner.KvBufferOwner`, so the lab
shows what vLLM's default holds beside SGLang's post-capture sizing (``finalize``) and
kvvmm's elastic strategies.

The device it measures is :class:`VllmMemory`: given, or read from the driver's
``mem_info()`` when the strategy is bound (a device holding nothing but this pool, the
weights not counted: vLLM then takes the whole pool, as its default of
``gpu_memory_utilization=1.0`` takes the whole device).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvvmm.checks import int_arg, number_arg
from kvvmm.errors import ArgumentError
from kvvmm.layout import vllm_kv_bytes, vllm_warmup_bytes
from kvvmm.layout.planner import VLLM_GPU_MEMORY_UTILIZATION
from kvvmm.owner import KvBufferOwner
from kvvmm.policy import Exact
from kvvmm.workload.serving import SlotAllocator
from kvvmm.workload.strategies import Strategy

__all__ = ["VllmExtensible", "VllmMemory"]


@dataclass(frozen=True, slots=True)
class VllmMemory:
    """The device as vLLM measures it, for one rank.

    Args:
        total_bytes: the device's memory, > 0.
        init_free_bytes: free when the engine started (``total_bytes`` less other
            processes), in ``[0, total_bytes]``.
        beside_kv_bytes: what the engine holds after warmup and capture beside its KV cache
            (weights, CUDA graphs, torch's cache after emptying it), >= 0.
        transient_peak_bytes: the activations' allocated peak the sizing steps measured
            (also warmup's reserve), >= 0.
        torch_reserve_growth_bytes: the largest growth of torch's reservation over a sizing
            step, >= 0.
        gpu_memory_utilization: the share of the device the instance may use, in (0, 1].
    Raises:
        ArgumentError: a figure outside its range (named, with the limit).
    """

    total_bytes: int
    init_free_bytes: int
    beside_kv_bytes: int = 0
    transient_peak_bytes: int = 0
    torch_reserve_growth_bytes: int = 0
    gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION

    def __post_init__(self) -> None:
        int_arg("total_bytes", self.total_bytes, lo=1, unit="bytes")
        int_arg("init_free_bytes", self.init_free_bytes, lo=0, hi=self.total_bytes,
                limit=f"an int in [0, {self.total_bytes}] (total_bytes)")
        int_arg("beside_kv_bytes", self.beside_kv_bytes, lo=0, hi=self.init_free_bytes,
                limit=f"an int in [0, {self.init_free_bytes}] (init_free_bytes)")
        int_arg("transient_peak_bytes", self.transient_peak_bytes, lo=0, unit="bytes")
        int_arg("torch_reserve_growth_bytes", self.torch_reserve_growth_bytes, lo=0,
                unit="bytes")
        number_arg("gpu_memory_utilization", self.gpu_memory_utilization, lo=0, hi=1,
                   lo_open=True, limit="a number in (0, 1]")

    def free_with(self, committed_bytes: int) -> int:
        """Free memory while ``committed_bytes`` of KV are mapped (never below 0)."""
        return max(0, self.init_free_bytes - self.beside_kv_bytes - committed_bytes)

    def final_kv_bytes(self, committed_bytes: int) -> int:
        """The KV bytes vLLM extends to after capture, ``committed_bytes`` mapped then."""
        return vllm_kv_bytes(
            init_free_bytes=self.init_free_bytes, free_bytes=self.free_with(committed_bytes),
            committed_bytes=committed_bytes,
            requested_bytes=int(self.total_bytes * self.gpu_memory_utilization),
            transient_peak_bytes=self.transient_peak_bytes,
            torch_reserve_growth_bytes=self.torch_reserve_growth_bytes)

    def warmup_kv_bytes(self, committed_bytes: int) -> int:
        """The KV bytes warmup may commit, ``committed_bytes`` mapped (may be negative)."""
        return vllm_warmup_bytes(free_bytes=self.free_with(committed_bytes),
                                 committed_bytes=committed_bytes,
                                 transient_peak_bytes=self.transient_peak_bytes)


class VllmExtensible(Strategy):
    """vLLM 0.34's extensible KV cache: warmup growth, one extend after capture, then fixed.

    Pages are vLLM's blocks (page 0, slot 0's, is its null block). As vLLM does, a count of
    pages is measured by its physical bytes: every buffer (vLLM's segment) rounded up to
    whole granules. When the measured size is below the pool, the engine's allocator hands
    out only those pages (vLLM's block pool holds the committed blocks).

    Args:
        memory: the device as vLLM measures it (default: the driver's ``mem_info()`` at
            bind, with only this pool on it).
        warmup_pages: pages warmup's shapes address, >= 1 (default: the most warmup may
            commit); warmup commits the smaller of this and that bound.
    Raises:
        ArgumentError: ``memory`` not a :class:`VllmMemory`, ``warmup_pages`` not an int >= 1.
    """

    name = "vllm-extensible"

    def __init__(self, memory: VllmMemory | None = None, *,
                 warmup_pages: int | None = None) -> None:
        if warmup_pages is not None:
            int_arg("warmup_pages", warmup_pages, lo=1, unit="pages")
        if memory is not None and not isinstance(memory, VllmMemory):
            raise ArgumentError("memory", memory, "a VllmMemory or None")
        self.memory = memory
        self.warmup_pages = warmup_pages
        # vLLM commits the blocks asked for, rounded to granules: no growth policy's slack.
        self.policy = Exact()
        self.final_pages = 0  #: the pages the extend after capture commits
        self.warmup_committed_pages = 0  #: the pages warmup committed

    def bind(self, owner: KvBufferOwner, *, pool_pages: int) -> None:
        super().bind(owner, pool_pages=pool_pages)
        ps = owner.page_size
        self._gran = owner.arena.granularity
        self._page_bytes = [d.row_bytes * ps // d.tokens_per_row for d in owner.descs]
        if self.memory is None:
            free, total = owner.arena.driver.mem_info()
            # Slot 0's page is mapped already: vLLM's first commit (its null block).
            self.memory = VllmMemory(total_bytes=total,
                                     init_free_bytes=min(total, free + owner.backed_bytes))
        self.final_pages = self.pages_within(self.memory.final_kv_bytes(self.physical_bytes_for(1)))

    def physical_bytes_for(self, pages: int) -> int:
        """Bytes vLLM counts mapped for ``pages`` pages: each buffer rounded to granules."""
        g = self._gran
        return sum(-(-pages * pb // g) * g for pb in self._page_bytes)

    def pages_within(self, num_bytes: int) -> int:
        """The most pages (at most the pool's) whose physical bytes fit ``num_bytes``."""
        pages = min(max(num_bytes, 0) // sum(self._page_bytes), self.pool_pages)
        while pages > 0 and self.physical_bytes_for(pages) > num_bytes:
            pages -= 1
        return pages

    def make_allocator(self, executor: Callable[[Callable[[], None], bool], None]
                       ) -> SlotAllocator | None:
        if self.final_pages >= self.pool_pages:
            return None  # the serving model's own, over the whole pool
        return SlotAllocator(max(self.final_pages, 2))

    def prepare(self) -> None:
        assert self.memory is not None  # bound
        committed = self.physical_bytes_for(max(self.covered_pages, 1))
        bound = max(self.pages_within(self.memory.warmup_kv_bytes(committed)),
                    self.covered_pages)
        want = bound if self.warmup_pages is None else min(self.warmup_pages, bound)
        if want > self.covered_pages:
            self.grow_to(want)
        self.warmup_committed_pages = self.covered_pages

    def start(self) -> None:
        # One extend to the measured size. A warmup that committed more is cut back to it:
        # vLLM remaps a smaller prefix (warmup's contents are garbage), so where a handle
        # straddles the cut, everything past slot 0's page goes and the prefix is mapped anew.
        final = max(self.final_pages, 2)
        if final < self.covered_pages:
            self.shrink_to(final)
            if self.covered_pages > final:
                self.shrink_to(2)
        if final > self.covered_pages:
            self.grow_to(final)

    def update(self, allocated: list[int], freed: list[int], high_water: int) -> None:
        pass  # no growth or shrink while serving
