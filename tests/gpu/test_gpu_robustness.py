"""Robustness on a GPU: the CUDA driver, both paths (C fast path and Python), keeps its book
consistent under threads and refuses close() while a reservation is pinned. Its answers to
every argument it cannot take are compared with sim's and host's in
tests/driver/test_driver_robustness.py, and two threads releasing one handle are raced in
tests/driver/test_driver_threads.py (the CUDA kinds join both where a GPU is usable).

Safe reads of unbacked device VA (``CudaDriver(zero_page=...)``, a read-only zero cover) are
tested in ``test_gpu_zero_page.py``; without it, unbacked device VA faults on read.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest

from kvvmm import BusyError

G = 2 << 20
@pytest.fixture(params=["cuda-c", "cuda-python"])
def cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    from kvvmm.driver import cuda as cuda_mod

    fast = request.param == "cuda-c"
    if fast and cuda_mod._cudafast is None:
        pytest.skip("the C fast path is not built")
    monkeypatch.setenv("KVVMM_CUDA_FASTPATH", "1" if fast else "0")
    d = cuda_mod.CudaDriver()
    assert d.fast_path == fast
    yield d
    d.close()


def test_threads_on_one_cuda_driver_leave_it_clean(cuda: Any) -> None:
    errors: list[BaseException] = []
    vas = [cuda.reserve(64 * G) for _ in range(8)]

    def work(i: int) -> None:
        rng = random.Random(i)
        try:
            for _ in range(100):
                n = rng.randrange(1, 4)
                hs = [cuda.create(G) for _ in range(n)]
                for k, h in enumerate(hs):
                    cuda.map(vas[i] + k * G, G, h)
                cuda.set_access(vas[i], n * G)
                if rng.random() < 0.5:
                    for h in hs:
                        cuda.release(h)
                    cuda.unmap(vas[i], n * G)
                else:
                    cuda.unmap(vas[i], n * G)
                    for h in hs:
                        cuda.release(h)
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not any(t.is_alive() for t in ts)
    assert not errors, errors[:3]
    for va in vas:
        cuda.free(va, 64 * G)
    assert cuda.stats().clean


def test_cuda_close_refuses_while_a_reservation_is_pinned(cuda: Any) -> None:
    va = cuda.reserve(4 * G)
    cuda.pin(va)
    with pytest.raises(BusyError):
        cuda.close()
    with pytest.raises(BusyError):
        cuda.free(va, 4 * G)
    cuda.unpin(va)
    cuda.free(va, 4 * G)
    assert cuda.stats().clean
