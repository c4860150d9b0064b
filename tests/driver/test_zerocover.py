"""The zero cover's book and plans (``kvvmm/driver/zerocover.py``), on a CPU.

A reservation is played as the driver plays it with ``zero_page`` on: a map of ``[lo, hi)``
unmaps the pieces :meth:`ZeroCover.uncover` names and maps the ones it plans, an unmap maps
:meth:`ZeroCover.cover`'s pieces back. After every step the zero pieces and the real maps
tile the reservation exactly, every piece has one of the sizes and is aligned to its size
from the reservation's start, and no plan touches VA it need not.
"""

from __future__ import annotations

import enum
import itertools
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvvmm.driver.zerocover import ZeroCover, runs
from kvvmm.errors import ArgumentError, DriverError

G = 2 << 20
BASE = 1 << 40


def test_piece_sizes_halve_from_the_block_to_the_granularity() -> None:
    assert ZeroCover(G, 32 * G).sizes == (G, 2 * G, 4 * G, 8 * G, 16 * G, 32 * G)
    assert ZeroCover(G, G).sizes == (G,)
    for bad in (0, -G, 3 * G, G + 4096, 6 * G):
        with pytest.raises(ValueError):
            ZeroCover(G, bad)


def test_a_reservation_is_covered_by_blocks_and_halving_edges() -> None:
    z = ZeroCover(G, 8 * G)
    z.add_reservation(BASE, 27 * G)
    plan = z.cover(BASE, BASE + 27 * G)
    assert plan == [(BASE, 8 * G), (BASE + 8 * G, 8 * G), (BASE + 16 * G, 8 * G),
                    (BASE + 24 * G, 2 * G), (BASE + 26 * G, G)]
    z.add(plan)
    assert z.covered_bytes == 27 * G and len(z) == 5
    # A map of one granule in the middle of the second block: that block goes, and its
    # remainders come back as halving pieces (two on the left, one on the right).
    old, new = z.uncover(BASE + 11 * G, BASE + 12 * G)
    assert old == [(BASE + 8 * G, 8 * G)]
    assert new == [(BASE + 8 * G, 2 * G), (BASE + 10 * G, G),
                   (BASE + 12 * G, 4 * G)]
    # Granule-only: the same map leaves 7 granules.
    g1 = ZeroCover(G, G)
    g1.add_reservation(BASE, 16 * G)
    g1.add(g1.cover(BASE, BASE + 16 * G))
    assert len(g1) == 16
    assert g1.uncover(BASE + 3 * G, BASE + 4 * G) == ([(BASE + 3 * G, G)], [])


def test_alignment_is_relative_to_the_reservation_start() -> None:
    z = ZeroCover(G, 4 * G)
    base = BASE + G  # not block-aligned in absolute terms
    z.add_reservation(base, 8 * G)
    assert z.cover(base, base + 8 * G) == [(base, 4 * G), (base + 4 * G, 4 * G)]


def test_records_refuse_what_breaks_the_invariants() -> None:
    z = ZeroCover(G, 4 * G)
    z.add_reservation(BASE, 16 * G)
    z.add([(BASE, 4 * G)])
    with pytest.raises(ValueError):
        z.add([(BASE + 2 * G, 2 * G)])  # overlaps
    with pytest.raises(ValueError):
        z.add([(BASE + 6 * G, 4 * G)])  # misaligned for its size
    with pytest.raises(ValueError):
        z.add([(BASE + 8 * G, 3 * G)])  # not a piece size
    with pytest.raises(ValueError):
        z.add([(BASE + 16 * G, G)])  # outside the reservation
    with pytest.raises(ValueError):
        z.cover(BASE, BASE + 8 * G)  # partly covered already
    with pytest.raises(ValueError):
        z.remove([(BASE, 2 * G)])  # not recorded so
    with pytest.raises(ValueError):
        z.drop_reservation(BASE)  # still has pieces
    with pytest.raises(ValueError):
        z.add_reservation(BASE + 8 * G, 16 * G)  # overlaps the reservation
    z.remove([(BASE, 4 * G)])
    z.drop_reservation(BASE)
    assert len(z) == 0 and z.covered_bytes == 0


def test_gaps_and_runs() -> None:
    z = ZeroCover(G, 4 * G)
    z.add_reservation(BASE, 16 * G)
    z.add([(BASE, 4 * G), (BASE + 8 * G, G)])
    assert z.gaps(BASE, BASE + 10 * G) == [(BASE + 4 * G, BASE + 8 * G),
                                           (BASE + 9 * G, BASE + 10 * G)]
    assert z.gaps(BASE + G, BASE + 3 * G) == []
    assert runs([(0, 2), (2, 2), (6, 1)]) == [(0, 4), (6, 7)]


def _levels(z: ZeroCover) -> int:
    return len(z.sizes) - 1


def _check(z: ZeroCover, base: int, size: int, real: dict[int, int]) -> None:
    pieces = list(z)
    for s, n in pieces:
        assert n in z.sizes and (s - base) % n == 0, (s - base, n)
    spans = sorted(pieces + list(real.items()))
    pos = base
    for s, n in spans:
        assert s == pos, f"hole or overlap at {(s - base) // G}"
        pos = s + n
    assert pos == base + size
    assert z.covered_bytes == sum(n for _, n in pieces)


@settings(max_examples=300, deadline=None)
@given(
    block_log=st.integers(0, 5),
    granules=st.integers(1, 200),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 10**6), st.integers(1, 40)),
                 max_size=60),
)
def test_random_maps_and_unmaps_keep_the_tiling(
    block_log: int, granules: int, ops: list[tuple[bool, int, int]]
) -> None:
    z = ZeroCover(G, G << block_log)
    size = granules * G
    z.add_reservation(BASE, size)
    first = z.cover(BASE, BASE + size)
    assert all(s >= BASE and s + n <= BASE + size for s, n in first)
    # Whole blocks, plus at most log2(Z/g) pieces at the unaligned tail.
    assert len(first) <= granules // (1 << block_log) + _levels(z)
    z.add(first)
    real: dict[int, int] = {}
    _check(z, BASE, size, real)
    for is_map, where, n in ops:
        if is_map:
            lo_g = where % granules
            n = min(n, granules - lo_g)
            lo, hi = BASE + lo_g * G, BASE + (lo_g + n) * G
            if any(s < hi and lo < s + m for s, m in real.items()):
                continue  # the driver refuses a map over a real mapping before planning
            old, new = z.uncover(lo, hi)
            # Only pieces that overlap [lo, hi); only VA they covered outside it.
            assert old and all(s < hi and lo < s + m for s, m in old)
            outside = [(s, s + m) for s, m in old]
            for s, m in new:
                assert s + m <= lo or s >= hi
                assert any(a <= s and s + m <= b for a, b in outside)
            assert len(new) <= 2 * _levels(z)
            # Every byte of old outside [lo, hi) comes back, once.
            assert sum(m for _, m in old) == sum(m for _, m in new) + (hi - lo)
            z.remove(old)
            z.add(new)
            real[lo] = hi - lo
        elif real:
            starts = sorted(real)
            lo = starts[where % len(starts)]
            # Sometimes a run of adjacent real maps at once, as the arena unmaps.
            hi = lo + real.pop(lo)
            while n % 2 and hi in real:
                hi += real.pop(hi)
                n //= 2
            plan = z.cover(lo, hi)
            assert plan[0][0] == lo and plan[-1][0] + plan[-1][1] == hi
            assert len(plan) <= (hi - lo) // z.block + 2 * _levels(z)
            z.add(plan)
        _check(z, BASE, size, real)
    # Free: every real map goes, then the cover; the book ends empty.
    for lo, m in sorted(real.items()):
        z.add(z.cover(lo, lo + m))
    z.remove(list(z))
    z.drop_reservation(BASE)
    assert len(z) == 0 and z.covered_bytes == 0


@settings(max_examples=100, deadline=None)
@given(block_log=st.integers(0, 6), lo=st.integers(0, 300), n=st.integers(1, 300))
def test_a_cover_is_the_fewest_aligned_pieces(block_log: int, lo: int, n: int) -> None:
    """The greedy tiling is the canonical dyadic one: no two pieces could merge into one
    aligned piece of a size the cover has."""
    z = ZeroCover(G, G << block_log)
    z.add_reservation(BASE, 1024 * G)
    lo = min(lo, 1023)
    hi = min(lo + n, 1024)
    plan = z.cover(BASE + lo * G, BASE + hi * G)
    for (a, m), (b, k) in itertools.pairwise(plan):
        assert a + m == b
        if m == k and m < z.block:
            assert (a - BASE) % (2 * m) != 0  # else these two would be one piece of 2m


# -- CudaDriver(zero_page=...) over a fake libcuda ------------------------------------------
#
# The driver's own code (the plans made into CUDA calls, each undo) runs here against a
# stand-in for ``cuda.bindings.driver`` that keeps VA, mappings, access and one fill byte per
# granule of each handle, and refuses what CUDA refuses (a map of part of a handle, over
# mapped VA; an unmap or access change that does not tile whole mappings). Fresh handles hold
# 0xAB, so a zero read shows the zero handles were cleared. tests/gpu/test_gpu_zero_page.py
# runs the same on a real GPU.

MiB = 1 << 20


class R(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906
    CUDA_ERROR_UNKNOWN = 999


class _Obj:
    def __init__(self) -> None:
        self.location = SimpleNamespace(type=0, id=0)
        self.flags = 0
        self.type = 0
        self.requestedHandleTypes = 0

    def getPtr(self) -> int:
        return id(self)


class FakeCuda:
    """cuda.bindings.driver as far as CudaDriver uses it, on one fake device."""

    CUresult = R
    CUmemAllocationProp = _Obj
    CUmemAccessDesc = _Obj
    CU_STREAM_LEGACY = 0
    CUdevice_attribute = SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=1)
    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAllocationHandleType = SimpleNamespace(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR=1)
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READ=1,
                                        CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0,
                                                       CU_MEM_ALLOC_GRANULARITY_RECOMMENDED=1)
    CUstreamCaptureStatus = SimpleNamespace(CU_STREAM_CAPTURE_STATUS_NONE=0)
    TOTAL = 1 << 40

    def __init__(self) -> None:
        self.res: dict[int, int] = {}
        self.next_va = 1 << 44
        self.handles: dict[int, dict[str, Any]] = {}  # raw -> size, refs, fill
        self.next_raw = 1
        self.maps: dict[int, tuple[int, int, int]] = {}  # va -> (size, raw, access flags)
        self.used = 0
        self.syncs = 0

    @staticmethod
    def CUstream(x: Any) -> Any:
        return x

    # -- device and context
    def cuInit(self, flags: int) -> Any:
        return (R.CUDA_SUCCESS,)

    def cuDeviceGetCount(self) -> Any:
        return R.CUDA_SUCCESS, 1

    def cuDeviceGet(self, i: int) -> Any:
        return R.CUDA_SUCCESS, i

    def cuDeviceGetName(self, n: int, dev: int) -> Any:
        return R.CUDA_SUCCESS, b"Fake H200\0"

    def cuDeviceGetAttribute(self, attr: int, dev: int) -> Any:
        return R.CUDA_SUCCESS, 1

    def cuDevicePrimaryCtxRetain(self, dev: int) -> Any:
        return R.CUDA_SUCCESS, 77

    def cuDevicePrimaryCtxRelease(self, dev: int) -> Any:
        return (R.CUDA_SUCCESS,)

    def cuCtxGetCurrent(self) -> Any:
        return R.CUDA_SUCCESS, 77

    def cuCtxSetCurrent(self, ctx: int) -> Any:
        return (R.CUDA_SUCCESS,)

    def cuCtxPushCurrent(self, ctx: int) -> Any:
        return (R.CUDA_SUCCESS,)

    def cuCtxPopCurrent(self) -> Any:
        return R.CUDA_SUCCESS, 77

    def cuCtxSynchronize(self) -> Any:
        self.syncs += 1
        return (R.CUDA_SUCCESS,)

    def cuStreamIsCapturing(self, s: Any) -> Any:
        return R.CUDA_SUCCESS, 0

    def cuGetErrorName(self, err: Any) -> Any:
        return R.CUDA_SUCCESS, R(err).name.encode()

    def cuGetErrorString(self, err: Any) -> Any:
        return R.CUDA_SUCCESS, b"fake"

    def cuMemGetAllocationGranularity(self, prop: Any, flag: int) -> Any:
        return R.CUDA_SUCCESS, G

    def cuMemGetInfo(self) -> Any:
        return R.CUDA_SUCCESS, self.TOTAL - self.used, self.TOTAL

    # -- VA
    def cuMemAddressReserve(self, size: int, align: int, addr: int, flags: int) -> Any:
        align = max(align, G)
        va = -(-self.next_va // align) * align
        self.next_va = va + size + 64 * MiB
        self.res[va] = size
        return R.CUDA_SUCCESS, va

    def cuMemAddressFree(self, va: int, size: int) -> Any:
        if self.res.get(va) != size or any(va <= s < va + size for s in self.maps):
            return (R.CUDA_ERROR_INVALID_VALUE,)
        del self.res[va]
        return (R.CUDA_SUCCESS,)

    # -- handles
    def cuMemCreate(self, size: int, prop: Any, flags: int) -> Any:
        raw = self.next_raw
        self.next_raw += 1
        self.handles[raw] = {"size": size, "refs": 1, "fill": [0xAB] * (size // G)}
        self.used += size
        return R.CUDA_SUCCESS, raw

    def _unref(self, raw: int) -> None:
        h = self.handles[raw]
        h["refs"] -= 1
        if not h["refs"]:
            del self.handles[raw]
            self.used -= h["size"]

    def cuMemRelease(self, raw: int) -> Any:
        if raw not in self.handles:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        self._unref(raw)
        return (R.CUDA_SUCCESS,)

    def cuMemRetainAllocationHandle(self, addr: int) -> Any:
        m = self._at(addr)
        if m is None:
            return R.CUDA_ERROR_INVALID_VALUE, 0
        raw = self.maps[m][1]
        self.handles[raw]["refs"] += 1
        return R.CUDA_SUCCESS, raw

    # -- mappings
    def _at(self, va: int) -> int | None:
        for s, (n, _, _) in self.maps.items():
            if s <= va < s + n:
                return s
        return None

    def _tiles(self, va: int, size: int) -> list[int] | None:
        out, pos = [], va
        while pos < va + size:
            m = self.maps.get(pos)
            if m is None or pos + m[0] > va + size:
                return None
            out.append(pos)
            pos += m[0]
        return out

    def cuMemMap(self, va: int, size: int, off: int, raw: int, flags: int) -> Any:
        h = self.handles.get(raw)
        if h is None:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        if off or size != h["size"]:
            return (R.CUDA_ERROR_NOT_SUPPORTED,)
        if any(s < va + size and va < s + n for s, (n, _, _) in self.maps.items()):
            return (R.CUDA_ERROR_INVALID_VALUE,)
        self.maps[va] = (size, raw, 0)
        h["refs"] += 1
        return (R.CUDA_SUCCESS,)

    def cuMemUnmap(self, va: int, size: int) -> Any:
        starts = self._tiles(va, size)
        if starts is None:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        for s in starts:
            self._unref(self.maps.pop(s)[1])
        return (R.CUDA_SUCCESS,)

    def cuMemSetAccess(self, va: int, size: int, descs: list[Any], n: int) -> Any:
        starts = self._tiles(va, size)
        if starts is None:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        for s in starts:
            n_, raw, _ = self.maps[s]
            self.maps[s] = (n_, raw, descs[0].flags)
        return (R.CUDA_SUCCESS,)

    def cuMemsetD8(self, va: int, value: int, n: int) -> Any:
        for g in range(va, va + n, G):
            if not self.write(g, value):
                return (R.CUDA_ERROR_INVALID_VALUE,)
        return (R.CUDA_SUCCESS,)

    # -- what a kernel would see
    def read(self, va: int) -> int | None:
        """The fill byte at ``va``; None where a read faults."""
        s = self._at(va)
        if s is None or not self.maps[s][2] & 1:
            return None
        _, raw, _ = self.maps[s]
        return int(self.handles[raw]["fill"][(va - s) // G])

    def write(self, va: int, value: int) -> bool:
        s = self._at(va)
        if s is None or self.maps[s][2] != 3:
            return False
        _, raw, _ = self.maps[s]
        self.handles[raw]["fill"][(va - s) // G] = value
        return True


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    from kvvmm.driver import cuda as cuda_mod

    f = FakeCuda()
    monkeypatch.setattr(cuda_mod, "_drv", f)
    monkeypatch.setenv("KVVMM_CUDA_FASTPATH", "0")
    return f


def _open(fake: FakeCuda, zero_page: Any = True) -> Any:
    from kvvmm.driver.cuda import CudaDriver

    return CudaDriver(zero_page=zero_page)


@pytest.mark.parametrize("zero_page", [False, True])
@pytest.mark.parametrize("fast", [False, True])
def test_the_hot_calls_are_chosen_once_c_where_it_runs_and_the_zero_cover_maps_and_unmaps(
        fake: FakeCuda, monkeypatch: pytest.MonkeyPatch, fast: bool, zero_page: bool) -> None:
    # Issue 47 item 7: fields set at construction, not a rewritten __dict__. C's functions
    # are the calls themselves (no Python frame), except map and unmap with the zero cover.
    import ctypes

    from kvvmm.driver import cuda_fast

    if fast:
        _cudafast = pytest.importorskip("kvvmm.driver._cudafast")
        # Addresses only: Fast stores them, and nothing here makes a hot call.
        keep = [ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 0) for _ in cuda_fast._FAST_FUNCTIONS]
        fns = tuple(ctypes.cast(f, ctypes.c_void_p).value or 0 for f in keep)
        monkeypatch.setattr(cuda_fast, "_libcuda_functions", lambda: fns)
        monkeypatch.setenv("KVVMM_CUDA_FASTPATH", "1")
    d = _open(fake, zero_page=zero_page)
    assert d.fast_path is fast and "map" not in vars(d)
    if fast:
        assert isinstance(d._b, _cudafast.Fast)
    for call in ("create", "release", "set_access", "map", "unmap"):
        zero = zero_page and call in ("map", "unmap")
        want = (getattr(d, f"_zp_{call}") if zero else getattr(d._b, call) if fast
                else getattr(d, f"_py_{call}"))
        assert getattr(d, call) == want, call
    d.close()


def _all_readable(fake: FakeCuda, d: Any) -> None:
    """Every granule of every reservation reads: zeros unless really mapped."""
    real = {s: h.size for s, h in d._maps.items()}
    for va, size in d._res.items():
        for g in range(va, va + size, G):
            got = fake.read(g)
            inside = any(s <= g < s + n for s, n in real.items())
            assert got is not None or inside, f"{g - va:#x} faults"
            if not inside:
                assert got == 0, f"{g - va:#x} reads {got}"


def _fake_matches_book(fake: FakeCuda, d: Any) -> None:
    zero = set(d._zraw.values())
    book = {s: n for s, n in d._zero}
    fake_zero = {s: n for s, (n, raw, _) in fake.maps.items() if raw in zero}
    assert fake_zero == book
    fake_real = {s: n for s, (n, raw, _) in fake.maps.items() if raw not in zero}
    assert fake_real == {s: h.size for s, h in d._maps.items()}


def test_cuda_zero_page_arguments(fake: FakeCuda) -> None:
    for bad in ("yes", 1.5, None, 0, -G, 3 * G, G + 4096):
        with pytest.raises(ArgumentError, match="zero_page"):
            _open(fake, bad)
    assert fake.used == 0 and not fake.res  # a refused block size leaves nothing behind
    d = _open(fake, False)
    assert d.zero_page == 0 and d.zero_stats() is None and not fake.handles
    d.close()
    d = _open(fake, True)
    zs = d.zero_stats()
    assert d.zero_page == 64 * MiB and zs.piece_sizes[0] == G and zs.block == 64 * MiB
    assert zs.zero_bytes == 2 * 64 * MiB - G == fake.used
    assert "zero_page=67108864" in repr(d)
    d.close()
    assert fake.used == 0 and not fake.maps and not fake.res
    d = _open(fake, G)
    assert d.zero_stats().piece_sizes == (G,)
    d.close()


@pytest.mark.parametrize("block", [G, 8 * G])
def test_cuda_zero_cover_through_reserve_map_unmap_free(fake: FakeCuda, block: int) -> None:
    d = _open(fake, block)
    va = d.reserve(37 * G)
    assert va % block == 0
    _all_readable(fake, d)
    _fake_matches_book(fake, d)
    assert d.stats().mappings == 0 and d.stats().physical_bytes == 0
    hs = {}
    for off, n in [(0, 1), (3, 2), (8, 8), (20, 1), (36, 1), (17, 3)]:
        h = d.create(n * G)
        d.map(va + off * G, n * G, h)
        d.set_access(va + off * G, n * G)
        assert fake.write(va + off * G, off + 1)
        hs[off] = (h, n)
        _all_readable(fake, d)
        _fake_matches_book(fake, d)
    with pytest.raises(DriverError, match="already mapped"):
        d.map(va + 9 * G, G, d.create(G))
    for off in hs:
        assert fake.read(va + off * G) == off + 1
    for off in (8, 0, 36):
        h, n = hs.pop(off)
        d.unmap(va + off * G, n * G)
        d.release(h)
        _all_readable(fake, d)
        _fake_matches_book(fake, d)
    zs = d.zero_stats()
    assert zs.covered_bytes + d.stats().mapped_bytes == 37 * G and zs.uncovered_bytes == 0
    with pytest.raises(DriverError, match="mappings are still in it"):
        d.free(va, 37 * G)
    for h, _ in hs.values():
        d.release(h)  # released while mapped: the unmap must still work
    d.unmap(va + 3 * G, 2 * G)
    d.unmap(va + 17 * G, 4 * G)  # two adjacent real mappings at once
    _all_readable(fake, d)
    d.free(va, 37 * G)
    assert len(d._zero) == 0 and not fake.res
    d.close()
    assert fake.used == 0 and not fake.maps


def _inject(d: Any, name: str, k: int) -> tuple[list[int], Any]:
    """Make the k-th call of ``d._<name>`` (from now) fail; return a call counter and the
    function that puts the real call back."""
    real = getattr(d, "_" + name)
    seen = [0]

    def call(*a: Any) -> Any:
        seen[0] += 1
        if seen[0] == k:
            return (R.CUDA_ERROR_UNKNOWN,) if name != "cuMemRetainAllocationHandle" else (
                R.CUDA_ERROR_UNKNOWN, 0)
        return real(*a)

    setattr(d, "_" + name, call)
    return seen, lambda: setattr(d, "_" + name, real)


FAULTY = ("cuMemMap", "cuMemUnmap", "cuMemSetAccess")


def _run(d: Any, op: str, va: int, va2: int, h: int) -> None:
    """The operation under test (the setup: real mappings at granules 20, and 10-11 for an
    unmap; blocks of 8 granules)."""
    if op == "map_middle":
        d.map(va + 3 * G, 2 * G, h)
    elif op == "map_edge":  # straddles two blocks
        d.map(va + 7 * G, 2 * G, h)
    elif op == "map_exact":  # at a block's start
        d.map(va + 16 * G, 2 * G, h)
    elif op in ("unmap", "unmap_released"):
        d.unmap(va + 10 * G, 2 * G)
    elif op == "free":
        d.free(va2, 27 * G)
    else:
        d.reserve(27 * G)


def _state(fake: FakeCuda, d: Any) -> Any:
    return (d.stats(), list(d._zero), dict(fake.maps), d.zero_stats())


@pytest.mark.parametrize("op", ["map_middle", "map_edge", "map_exact", "unmap",
                                "unmap_released", "free", "reserve"])
def test_cuda_zero_cover_undoes_every_failure(fake: FakeCuda, op: str) -> None:
    for name in FAULTY:
        k = 1
        while True:
            d = _open(fake, 8 * G)
            va = d.reserve(32 * G)
            keep = d.create(G)
            d.map(va + 20 * G, G, keep)
            d.set_access(va + 20 * G, G)
            fake.write(va + 20 * G, 7)
            h = d.create(2 * G)
            if op in ("unmap", "unmap_released"):
                d.map(va + 10 * G, 2 * G, h)
                d.set_access(va + 10 * G, 2 * G)
                fake.write(va + 10 * G, 9)
                if op == "unmap_released":
                    d.release(h)
            va2 = d.reserve(27 * G) if op == "free" else 0
            before = _state(fake, d)
            seen, restore = _inject(d, name, k)
            try:
                _run(d, op, va, va2, h)
            except DriverError as e:
                assert e.cuda_error == "CUDA_ERROR_UNKNOWN", e
                assert not getattr(e, "__notes__", None), e.__notes__
                assert _state(fake, d) == before, (name, k)
                _all_readable(fake, d)
                _fake_matches_book(fake, d)
                if op in ("unmap", "unmap_released"):
                    assert fake.read(va + 10 * G) == 9  # the bytes are back, accessible
                assert fake.read(va + 20 * G) == 7
                failed = True
            else:
                failed = False
                _all_readable(fake, d)
                _fake_matches_book(fake, d)
            restore()
            d.close()
            assert fake.used == 0 and not fake.maps and not fake.res, (op, name, k)
            if not failed:
                assert seen[0] < k  # every call of this kind was made to fail once
                break
            k += 1
        # Every operation makes calls of each kind, except these three.
        none = {("free", "cuMemMap"), ("free", "cuMemSetAccess"), ("reserve", "cuMemUnmap")}
        assert (k > 1) == ((op, name) not in none), (op, name, k)


def test_cuda_zero_cover_on_an_arena(fake: FakeCuda) -> None:
    from kvvmm.arena import Arena

    d = _open(fake, 8 * G)
    a = Arena(d, reserve_bytes=50 * G)
    off = a.allocate(21 * G, "x")
    a.commit(off, 5 * G)
    _all_readable(fake, d)
    _fake_matches_book(fake, d)
    a.commit(off, 13 * G)
    a.decommit(off, 3 * G) if hasattr(a, "decommit") else None
    _all_readable(fake, d)
    _fake_matches_book(fake, d)
    a.close()
    assert d.stats().clean and len(d._zero) == 0
    d.close()
    assert fake.used == 0


def test_a_failed_undo_leaves_a_hole_the_book_and_the_error_name(fake: FakeCuda) -> None:
    d = _open(fake, 8 * G)
    va = d.reserve(32 * G)
    h = d.create(2 * G)
    real = d._cuMemMap
    calls = [0]

    def broken(*a: Any) -> Any:  # the first map (a re-cover piece) works, then none
        calls[0] += 1
        return real(*a) if calls[0] == 1 else (R.CUDA_ERROR_UNKNOWN,)

    d._cuMemMap = broken
    with pytest.raises(DriverError) as e:
        d.map(va + 3 * G, 2 * G, h)
    d._cuMemMap = real
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert e.value.cuda_error == "CUDA_ERROR_UNKNOWN" and "left uncovered" in notes, notes
    _fake_matches_book(fake, d)  # the book says exactly what is mapped
    zs = d.zero_stats()
    assert zs.uncovered_bytes > 0
    assert zs.covered_bytes + zs.uncovered_bytes == 32 * G
    d.map(va + 3 * G, 2 * G, h)  # a map over the hole works
    d.set_access(va + 3 * G, 2 * G)
    _fake_matches_book(fake, d)
    d.unmap(va + 3 * G, 2 * G)
    d.release(h)
    d.close()
    assert fake.used == 0 and not fake.maps and not fake.res


def test_an_unmap_whose_recover_and_undo_fail_says_what_is_gone(fake: FakeCuda) -> None:
    d = _open(fake, 8 * G)
    va = d.reserve(16 * G)
    h = d.create(2 * G)
    d.map(va + 4 * G, 2 * G, h)
    d.set_access(va + 4 * G, 2 * G)
    real = d._cuMemMap
    d._cuMemMap = lambda *a: (R.CUDA_ERROR_UNKNOWN,)
    with pytest.raises(DriverError) as e:
        d.unmap(va + 4 * G, 2 * G)
    d._cuMemMap = real
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert e.value.cuda_error == "CUDA_ERROR_UNKNOWN"
    assert "that mapping is gone" in notes and "left uncovered" in notes, notes
    _fake_matches_book(fake, d)
    assert d.stats().mappings == 0 and d.stats().physical_bytes == 2 * G  # h is still live
    assert d.zero_stats().uncovered_bytes == 2 * G
    d.release(h)
    d.close()
    assert fake.used == 0 and not fake.maps and not fake.res


def test_a_failed_free_puts_the_cover_back(fake: FakeCuda) -> None:
    d = _open(fake, 8 * G)
    va = d.reserve(20 * G)
    before = (list(d._zero), d.stats())
    fake.cuMemAddressFree = lambda va, size: (R.CUDA_ERROR_UNKNOWN,)  # type: ignore[method-assign]
    with pytest.raises(DriverError) as e:
        d.free(va, 20 * G)
    assert e.value.cuda_error == "CUDA_ERROR_UNKNOWN"
    assert not getattr(e.value, "__notes__", None)
    assert (list(d._zero), d.stats()) == before
    _all_readable(fake, d)
    del fake.cuMemAddressFree  # the class's again
    d.close()
    assert fake.used == 0 and not fake.maps and not fake.res


def test_open_driver_passes_zero_page_through(fake: FakeCuda) -> None:
    from kvvmm.driver import open_driver

    d: Any = open_driver("cuda", zero_page=16 * G)
    assert d.zero_page == 16 * G
    d.close()
    d = open_driver("auto", zero_page=True)
    assert d.kind == "cuda" and d.zero_page == 64 * MiB
    d.close()
    assert fake.used == 0


def test_auto_drops_zero_page_for_the_host_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from kvvmm.driver import open_driver

    if not sys.platform.startswith("linux"):
        pytest.skip("the host driver is Linux only")
    from kvvmm.driver import cuda as cuda_mod

    monkeypatch.setattr(cuda_mod, "_drv", None)  # no cuda-python: auto falls back to host
    d: Any = open_driver("auto", zero_page=True)
    try:
        assert d.kind == "host"
    finally:
        d.close()


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 10**6), st.integers(1, 12)),
                    max_size=25),
       block_log=st.integers(0, 3))
def test_random_commits_on_the_driver_keep_every_unbacked_granule_readable(
    ops: list[tuple[bool, int, int]], block_log: int
) -> None:
    import os

    from kvvmm.driver import cuda as cuda_mod

    f = FakeCuda()
    saved, saved_env = cuda_mod._drv, os.environ.get("KVVMM_CUDA_FASTPATH")
    cuda_mod._drv = f
    os.environ["KVVMM_CUDA_FASTPATH"] = "0"  # the C path would call the real libcuda
    try:
        d = cuda_mod.CudaDriver(zero_page=G << block_log)
        granules = 40
        va = d.reserve(granules * G + G)  # not a multiple of any block
        real: dict[int, tuple[int, int]] = {}  # first granule -> (n, handle)
        for is_map, where, n in ops:
            if is_map:
                first = where % granules
                n = min(n, granules - first)
                if any(s < first + n and first < s + m for s, (m, _) in real.items()):
                    continue
                h = d.create(n * G)
                d.map(va + first * G, n * G, h)
                d.set_access(va + first * G, n * G)
                assert f.write(va + first * G, 1 + first % 250)
                real[first] = (n, h)
            elif real:
                first = sorted(real)[where % len(real)]
                n, h = real.pop(first)
                if where % 2:
                    d.release(h)  # released while mapped, then unmapped
                    d.unmap(va + first * G, n * G)
                else:
                    d.unmap(va + first * G, n * G)
                    d.release(h)
            _all_readable(f, d)
            _fake_matches_book(f, d)
            for first in real:
                assert f.read(va + first * G) == 1 + first % 250
        d.close()
        assert f.used == 0 and not f.maps and not f.res
    finally:
        cuda_mod._drv = saved
        if saved_env is None:
            os.environ.pop("KVVMM_CUDA_FASTPATH", None)
        else:
            os.environ["KVVMM_CUDA_FASTPATH"] = saved_env
