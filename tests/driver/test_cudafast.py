"""The C fast path of CudaDriver (``kvvmm/driver/_cudafast.c``), on a CPU.

``_cudafast.Fast`` calls libcuda through eight function addresses. Here they are ctypes
callbacks that play libcuda (record each call, answer as told), and the "driver" is a stand-in
with the slow-path methods, so every branch runs without a GPU: the common case done in C,
everything else handed to Python untouched, CUDA's errors raised through ``_fast_failed``,
nothing recorded for a call that failed. ``tests/gpu`` runs the real CudaDriver both ways.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
from ctypes import CFUNCTYPE, POINTER, c_int, c_size_t, c_uint64, c_void_p
from typing import Any

import pytest

if os.environ.get("KVVMM_REQUIRE_FASTPATH") == "1":  # CI builds it: its absence is a failure
    from kvvmm.driver import _cudafast
else:
    _cudafast = pytest.importorskip("kvvmm.driver._cudafast")

G = 2 << 20
CTX = 0xC0C0
PROP = 0x9000
ACC = 0xA000
OOM = 2
CAPTURE_IMPLICIT = 906


class FakeLibcuda:
    """libcuda's eight entry points as ctypes callbacks that record every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail: dict[str, int] = {}  # entry point -> error code it returns (once)
        self.current = CTX  # what cuCtxGetCurrent answers
        self.capturing: set[int] = set()  # streams cuStreamIsCapturing says are capturing
        self.legacy_error = 0  # what it returns for the legacy stream
        self.next_raw = 0x1000
        self.on_map: Any = None  # called inside cuMemMap (with the GIL released by C)

        def ret(name: str) -> int:
            return self.fail.pop(name, 0)

        def mem_map(va: int, size: int, off: int, h: int, flags: int) -> int:
            self.calls.append(("cuMemMap", va, size, off, h, flags))
            if self.on_map is not None:
                self.on_map()
            return ret("cuMemMap")

        def mem_unmap(va: int, size: int) -> int:
            self.calls.append(("cuMemUnmap", va, size))
            return ret("cuMemUnmap")

        def mem_create(out: Any, size: int, prop: int, flags: int) -> int:
            self.calls.append(("cuMemCreate", size, prop, flags))
            err = ret("cuMemCreate")
            if not err:
                out[0] = self.next_raw
                self.next_raw += 0x10
            return err

        def mem_release(h: int) -> int:
            self.calls.append(("cuMemRelease", h))
            return ret("cuMemRelease")

        def set_access(va: int, size: int, desc: int, count: int) -> int:
            self.calls.append(("cuMemSetAccess", va, size, desc, count))
            return ret("cuMemSetAccess")

        def get_current(out: Any) -> int:
            self.calls.append(("cuCtxGetCurrent",))
            out[0] = self.current
            return 0

        def sync() -> int:
            self.calls.append(("cuCtxSynchronize",))
            return ret("cuCtxSynchronize")

        def is_capturing(stream: int | None, out: Any) -> int:
            stream = stream or 0
            self.calls.append(("cuStreamIsCapturing", stream))
            out[0] = 1 if stream in self.capturing else 0
            return self.legacy_error if stream == 1 else 0

        self._callbacks = [
            CFUNCTYPE(c_int, c_uint64, c_size_t, c_size_t, c_uint64, c_uint64)(mem_map),
            CFUNCTYPE(c_int, c_uint64, c_size_t)(mem_unmap),
            CFUNCTYPE(c_int, POINTER(c_uint64), c_size_t, c_void_p, c_uint64)(mem_create),
            CFUNCTYPE(c_int, c_uint64)(mem_release),
            CFUNCTYPE(c_int, c_uint64, c_size_t, c_void_p, c_size_t)(set_access),
            CFUNCTYPE(c_int, POINTER(c_void_p))(get_current),
            CFUNCTYPE(c_int)(sync),
            CFUNCTYPE(c_int, c_void_p, POINTER(c_int))(is_capturing),
        ]
        self.fns = tuple(int(ctypes.cast(cb, c_void_p).value or 0) for cb in self._callbacks)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


class CudaFailed(Exception):
    pass


class StandIn:
    """What Fast needs of a CudaDriver: the slow paths and the error hook."""

    def __init__(self) -> None:
        self.slow: list[tuple[Any, ...]] = []

    def _record(self, name: str, *args: Any, **kw: Any) -> str:
        self.slow.append((name, args, kw))
        return "slow"

    def _py_map(self, *a: Any, **kw: Any) -> str:
        return self._record("map", *a, **kw)

    def _py_unmap(self, *a: Any, **kw: Any) -> str:
        return self._record("unmap", *a, **kw)

    def _py_create(self, *a: Any, **kw: Any) -> str:
        return self._record("create", *a, **kw)

    def _py_release(self, *a: Any, **kw: Any) -> str:
        return self._record("release", *a, **kw)

    def _py_set_access(self, *a: Any, **kw: Any) -> str:
        return self._record("set_access", *a, **kw)

    def _fast_failed(self, call: str, fn: str, args: tuple[int, ...], err: int) -> None:
        raise CudaFailed(call, fn, args, err)


@pytest.fixture
def env() -> Any:
    lib, drv = FakeLibcuda(), StandIn()
    handles: dict[int, Any] = {}
    maps: dict[int, Any] = {}
    fast = _cudafast.Fast(lib.fns, CTX, PROP, ACC, G, handles, maps, drv, _cudafast.Handle)

    class Env:
        pass

    e = Env()
    e.lib, e.drv, e.fast, e.handles, e.maps = lib, drv, fast, handles, maps  # type: ignore[attr-defined]
    return e


BASE = 0x7F00_0000_0000


def test_create_records_a_live_handle_and_its_bytes(env: Any) -> None:
    h = env.fast.create(4 * G)
    assert h == 1 and env.fast.next_handle == 2
    rec = env.handles[1]
    assert (rec.raw, rec.size, rec.maps, rec.live, rec.imported) == (0x1000, 4 * G, 0, True, False)
    assert env.fast.physical_bytes == 4 * G
    assert env.lib.calls == [("cuMemCreate", 4 * G, PROP, 0)]
    assert env.fast.create(G) == 2


@pytest.mark.parametrize("size", [0, -G, G + 4096, True, 2.0 * G, 1 << 70])
def test_create_hands_anything_unusual_to_python(env: Any, size: Any) -> None:
    assert env.fast.create(size) == "slow"
    assert env.drv.slow == [("create", (size,), {})]
    assert env.lib.calls == [] and env.handles == {} and env.fast.physical_bytes == 0


def test_a_failed_create_raises_through_the_driver_and_records_nothing(env: Any) -> None:
    env.lib.fail["cuMemCreate"] = OOM
    with pytest.raises(CudaFailed) as e:
        env.fast.create(G)
    assert e.value.args == ("create", "cuMemCreate", (G,), OOM)
    assert env.handles == {} and env.fast.next_handle == 1 and env.fast.physical_bytes == 0


def test_map_inside_the_hot_reservation_runs_in_c(env: Any) -> None:
    h = env.fast.create(2 * G)
    assert env.fast.map(BASE, 2 * G, h) == "slow"  # no reservation known yet: Python checks
    env.fast.hot_lo, env.fast.hot_hi = BASE, BASE + 8 * G
    assert env.fast.map(BASE + 2 * G, 2 * G, h) is None
    assert env.lib.calls[-1] == ("cuMemMap", BASE + 2 * G, 2 * G, 0, 0x1000, 0)
    assert env.maps == {BASE + 2 * G: env.handles[h]} and env.handles[h].maps == 1


@pytest.mark.parametrize("case", ["past_end", "before_start", "misaligned", "other_size",
                                  "unknown_handle", "bool_va", "negative", "keyword"])
def test_map_hands_every_doubtful_case_to_python(env: Any, case: str) -> None:
    h = env.fast.create(2 * G)
    env.fast.hot_lo, env.fast.hot_hi = BASE, BASE + 8 * G
    args: tuple[Any, ...] = {
        "past_end": (BASE + 7 * G, 2 * G, h), "before_start": (BASE - 2 * G, 2 * G, h),
        "misaligned": (BASE + 4096, 2 * G, h), "other_size": (BASE, G, h),
        "unknown_handle": (BASE, 2 * G, 99), "bool_va": (True, 2 * G, h),
        "negative": (-BASE, 2 * G, h), "keyword": (BASE, 2 * G),
    }[case]
    kw = {"handle": h} if case == "keyword" else {}
    n = len(env.lib.calls)
    assert env.fast.map(*args, **kw) == "slow"
    assert env.drv.slow[-1] == ("map", args, kw)
    assert len(env.lib.calls) == n and env.maps == {}


def test_a_failed_map_raises_and_records_nothing(env: Any) -> None:
    h = env.fast.create(G)
    env.fast.hot_lo, env.fast.hot_hi = BASE, BASE + 8 * G
    env.lib.fail["cuMemMap"] = 1
    with pytest.raises(CudaFailed) as e:
        env.fast.map(BASE, G, h)
    assert e.value.args == ("map", "cuMemMap", (BASE, G, h), 1)
    assert env.maps == {} and env.handles[h].maps == 0


def test_a_handle_released_by_another_thread_during_a_map_stays_valid(env: Any) -> None:
    # C drops the GIL around cuMemMap; another thread may drop the record meanwhile.
    h = env.fast.create(G)
    env.fast.hot_lo, env.fast.hot_hi = BASE, BASE + 8 * G
    done = threading.Event()

    def drop() -> None:
        del env.handles[h]
        gc.collect()
        done.set()

    env.lib.on_map = lambda: threading.Thread(target=drop).start() or done.wait(5)
    env.fast.map(BASE, G, h)
    assert done.is_set()
    assert env.maps[BASE].maps == 1 and env.maps[BASE].raw == 0x1000


def mapped(env: Any, n: int = 1) -> list[int]:
    env.fast.hot_lo, env.fast.hot_hi = BASE, BASE + 64 * G
    hs = []
    for i in range(n):
        h = env.fast.create(G)
        env.fast.map(BASE + i * G, G, h)
        hs.append(h)
    env.lib.calls.clear()
    return hs


def test_set_access_of_one_whole_mapping_runs_in_c(env: Any) -> None:
    mapped(env)
    assert env.fast.set_access(BASE, G) is None
    assert env.lib.calls == [("cuMemSetAccess", BASE, G, ACC, 1)]


def test_set_access_for_devices_or_over_several_mappings_goes_to_python(env: Any) -> None:
    mapped(env, 2)
    assert env.fast.set_access(BASE, G, devices=(0, 1)) == "slow"
    assert env.fast.set_access(BASE, G, (0,)) == "slow"
    assert env.fast.set_access(BASE, 2 * G) == "slow"
    assert env.fast.set_access(BASE + 4 * G, G) == "slow"
    assert [s[0] for s in env.drv.slow] == ["set_access"] * 4
    assert env.drv.slow[0] == ("set_access", (BASE, G), {"devices": (0, 1)})
    assert env.lib.calls == []


def test_a_failed_set_access_raises(env: Any) -> None:
    mapped(env)
    env.lib.fail["cuMemSetAccess"] = 1
    with pytest.raises(CudaFailed):
        env.fast.set_access(BASE, G)


TORCH_STREAM = 0x5000


def test_unmap_goes_to_python_until_the_capture_check_is_known(env: Any) -> None:
    mapped(env)
    assert env.fast.unmap(BASE, G) == "slow"
    env.fast.capture_check = lambda: TORCH_STREAM  # torch's current stream on the device
    assert env.fast.unmap(BASE, G) is None
    # Look for a capture on torch's stream and the legacy one, confirm our context,
    # synchronize, then unmap.
    assert env.lib.calls[:2] == [("cuStreamIsCapturing", TORCH_STREAM),
                                 ("cuStreamIsCapturing", 1)]  # CU_STREAM_LEGACY
    assert env.lib.names()[2:] == ["cuCtxGetCurrent", "cuCtxSynchronize", "cuMemUnmap"]
    assert env.maps == {} and env.handles[1].maps == 0


def test_an_older_torchs_yes_or_no_capture_check_works_too(env: Any) -> None:
    mapped(env, 2)
    env.fast.capture_check = lambda: False
    assert env.fast.unmap(BASE, G) is None
    assert env.lib.names() == ["cuStreamIsCapturing", "cuCtxGetCurrent", "cuCtxSynchronize",
                               "cuMemUnmap"]
    env.fast.capture_check = lambda: True
    assert env.fast.unmap(BASE + G, G) == "slow"


@pytest.mark.parametrize("case", ["torch_capturing", "torch_stream_odd", "legacy_capturing",
                                  "implicit", "other_context", "part", "several", "released"])
def test_unmap_hands_captures_other_contexts_and_odd_cases_to_python(env: Any, case: str) -> None:
    hs = mapped(env, 2)
    env.fast.capture_check = lambda: TORCH_STREAM
    size = G
    if case == "torch_capturing":
        env.lib.capturing.add(TORCH_STREAM)
    elif case == "torch_stream_odd":  # neither a pointer nor a bool: Python judges
        env.fast.capture_check = lambda: "stream?"
    elif case == "legacy_capturing":
        env.lib.capturing.add(1)
    elif case == "implicit":
        env.lib.legacy_error = CAPTURE_IMPLICIT
    elif case == "other_context":
        env.lib.current = 0xBEEF
    elif case == "part":
        size = G // 2
    elif case == "several":
        size = 2 * G
    elif case == "released":
        env.fast.release(hs[0])
        env.lib.calls.clear()
    assert env.fast.unmap(BASE, size) == "slow"
    assert env.drv.slow[-1] == ("unmap", (BASE, size), {})
    assert "cuCtxSynchronize" not in env.lib.names() and "cuMemUnmap" not in env.lib.names()
    assert BASE in env.maps


def test_a_failed_synchronize_unmaps_nothing(env: Any) -> None:
    mapped(env)
    env.fast.capture_check = lambda: False
    env.lib.fail["cuCtxSynchronize"] = 700
    with pytest.raises(CudaFailed) as e:
        env.fast.unmap(BASE, G)
    assert e.value.args == ("unmap", "cuCtxSynchronize", (BASE, G), 700)
    assert "cuMemUnmap" not in env.lib.names() and BASE in env.maps


def test_an_error_in_the_capture_check_propagates(env: Any) -> None:
    mapped(env)

    def boom() -> bool:
        raise ValueError("no")

    env.fast.capture_check = boom
    with pytest.raises(ValueError):
        env.fast.unmap(BASE, G)
    assert BASE in env.maps and env.lib.calls == []


def test_release_of_an_unmapped_handle_gives_its_bytes_back(env: Any) -> None:
    h = env.fast.create(3 * G)
    rec = env.handles[h]
    assert env.fast.release(h) is None
    assert h not in env.handles and rec.live is False and env.fast.physical_bytes == 0
    assert env.lib.calls[-1] == ("cuMemRelease", 0x1000)
    assert env.fast.release(h) == "slow"  # no longer live: Python refuses it


def test_release_while_mapped_keeps_the_bytes_until_the_unmap(env: Any) -> None:
    (h,) = mapped(env)
    env.fast.release(h)
    assert env.fast.physical_bytes == G and env.maps[BASE].live is False


def test_a_failed_release_keeps_the_handle(env: Any) -> None:
    h = env.fast.create(G)
    env.lib.fail["cuMemRelease"] = 1
    with pytest.raises(CudaFailed):
        env.fast.release(h)
    assert env.handles[h].live and env.fast.physical_bytes == G


def test_the_driver_is_held_weakly(env: Any) -> None:
    env.drv = None
    gc.collect()
    with pytest.raises(RuntimeError, match="gone"):
        env.fast.create(G + 1)  # a slow-path call needs the driver


def test_bad_construction_is_refused() -> None:
    lib, drv = FakeLibcuda(), StandIn()
    with pytest.raises(ValueError, match="8 function addresses"):
        _cudafast.Fast(lib.fns[:7], CTX, PROP, ACC, G, {}, {}, drv, _cudafast.Handle)
    with pytest.raises(ValueError, match="non-null"):
        _cudafast.Fast(lib.fns, 0, PROP, ACC, G, {}, {}, drv, _cudafast.Handle)
    with pytest.raises(ValueError, match="gran"):
        _cudafast.Fast(lib.fns, CTX, PROP, ACC, 0, {}, {}, drv, _cudafast.Handle)
    with pytest.raises(TypeError):
        _cudafast.Fast(lib.fns, CTX, PROP, ACC, G, [], {}, drv, _cudafast.Handle)


def test_handle_records_take_only_what_python_may_change() -> None:
    h = _cudafast.Handle(7, G)
    h.maps += 2
    h.live = False
    assert (h.raw, h.size, h.maps, h.live, h.imported) == (7, G, 2, False, False)
    assert _cudafast.Handle(7, G, imported=True).imported is True
    with pytest.raises(AttributeError):
        h.size = 1  # type: ignore[misc]
