"""driver_for and notebook_driver_kind on a real card: a profile names the sim, not
the GPU; a notebook about real memory gets the CUDA driver where a GPU is usable."""

from __future__ import annotations

from kvvmm.driver import DRIVER_ENV, driver_for, get_profile, notebook_driver_kind
from kvvmm.driver.cuda import CudaDriver
from kvvmm.growth import decode_growth
from kvvmm.policy import Exact


def _card_total_bytes() -> int:
    d = CudaDriver()
    try:
        return d.mem_info()[1]
    finally:
        d.close()


def test_driver_for_opens_the_card_as_it_is_whatever_profile_it_names() -> None:
    card = _card_total_bytes()
    other = next(k for k in ("b200", "h100", "h200")
                 if abs(get_profile(k).capacity_bytes - card) > 4 << 30)
    d = driver_for("cuda", profile=other, device=0)
    try:
        assert d.kind == "cuda" and d.device == 0
        assert d.mem_info()[1] == card  # the card's memory, not the named profile's
    finally:
        d.close()


def test_a_notebook_about_real_memory_runs_on_cuda_where_a_gpu_is_usable() -> None:
    kind = notebook_driver_kind(real_memory=True, environ={})
    assert kind == "auto"
    d = driver_for(kind)
    try:
        assert d.kind == "cuda"
    finally:
        d.close()
    assert notebook_driver_kind(environ={DRIVER_ENV: "cuda"}) == "cuda"


def test_decode_growth_on_cuda_opens_through_driver_for_and_runs_on_the_card() -> None:
    (res,) = decode_growth([Exact()], driver="cuda", profile="h200", layers=1, tokens=4096,
                           step_tokens=1024)
    assert res.driver == "cuda" and res.sim_us == 0 and res.handles >= 1
