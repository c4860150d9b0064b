"""CudaDriver's handle-type choice, checked where there is no GPU.

``handle_type=`` is checked before CUDA is touched, so it is testable on any machine. The
choice itself (``_pick_handle_type``) is a function of the probe it is given: here the probe
is a table of CUDA's answers, so the order
SGLang 0.5.23 tries, the fallback and the refusals are proven without a card. The probe on a
real card (an H200: FABRIC refused, POSIX fd taken) is ``tests/gpu/test_gpu_handle_type.py``.
"""

from __future__ import annotations

import ast
import os
import warnings
from pathlib import Path

import pytest

from kvvmm.driver import open_driver
from kvvmm.driver.base import CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_OUT_OF_MEMORY, HANDLE_TYPES
from kvvmm.driver.cuda import AUTO_HANDLE_ORDER, CudaDriver, _pick_handle_type
from kvvmm.errors import (
    ArgumentError,
    DriverError,
    DriverOutOfMemoryError,
    DriverUnavailableError,
)

REPO = Path(__file__).resolve().parents[2]
SGLANG_DIR = Path(os.environ.get("KVVMM_SGLANG_DIR", REPO / ".venv" / "sglang-0.5.23"))

#: What CUDA answers a FABRIC create on a GPU outside an NVLink fabric (an H200 here).
NOT_PERMITTED = "CUDA_ERROR_NOT_PERMITTED"


def _cuda_usable() -> bool:
    try:
        CudaDriver().close()
    except DriverUnavailableError:
        return False
    return True


no_gpu = pytest.mark.skipif(_cuda_usable(), reason="a GPU is usable here (tests/gpu covers it)")


class Card:
    """A probe over a table of CUDA's answers: ``None`` takes the type, a name refuses it."""

    def __init__(self, **answers: str | None) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def __call__(self, name: str) -> DriverError | None:
        self.asked.append(name)
        refusal = self.answers.get(name)
        if refusal is None:
            return None
        cls = DriverOutOfMemoryError if refusal == CUDA_ERROR_OUT_OF_MEMORY else DriverError
        return cls("create", {"size": 2 << 20}, refusal,
                   f"handle_type={name!r}: cuMemCreate of one granule returned it")


# -- the arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["FABRIC", "posix", "", None, 8, True])
def test_an_unknown_handle_type_is_refused_naming_it_before_cuda_is_touched(bad: object) -> None:
    with pytest.raises(ArgumentError) as info:
        CudaDriver(handle_type=bad)  # type: ignore[arg-type]
    err = info.value
    assert err.name == "handle_type" and err.value == bad
    assert "'posix_fd'" in err.limit and "'fabric'" in err.limit and "'auto'" in err.limit


def test_open_driver_refuses_an_unknown_handle_type_even_where_it_would_fall_back_to_host(
) -> None:
    with pytest.raises(ArgumentError, match="handle_type"):
        open_driver("auto", handle_type="nvlink")


def test_handle_type_alone_gives_no_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            d = CudaDriver(handle_type="posix_fd")
        except DriverUnavailableError:
            return  # no GPU: refused for that, and not for a warning
    try:
        assert d.handle_type == "posix_fd" and d.handle_type_probe == ()
    finally:
        d.close()


@pytest.mark.parametrize("kind", ["cuda", "auto"])
def test_an_option_no_driver_takes_is_refused_before_any_driver_opens(kind: str) -> None:
    with pytest.raises(TypeError, match="exportable"):
        open_driver(kind, exportable=True)


@no_gpu
def test_a_fabric_driver_asked_of_open_driver_auto_falls_back_to_the_host_driver() -> None:
    d = open_driver("auto", handle_type="fabric")
    try:
        assert d.kind == "host" and d.handle_type == "posix_fd"
    finally:
        d.close()


# -- the choice --------------------------------------------------------------------------------


def test_auto_tries_fabric_then_posix_fd_then_none_as_sglang_does() -> None:
    assert AUTO_HANDLE_ORDER == ("fabric", "posix_fd", "none")
    assert set(AUTO_HANDLE_ORDER) == set(HANDLE_TYPES)


def test_auto_takes_fabric_where_cuda_takes_it_and_probes_nothing_else() -> None:
    card = Card()
    assert _pick_handle_type("auto", card) == ("fabric", (("fabric", "ok"),))
    assert card.asked == ["fabric"]


def test_auto_falls_back_to_posix_fd_where_fabric_is_refused_as_on_a_single_h200() -> None:
    card = Card(fabric=NOT_PERMITTED)
    got = _pick_handle_type("auto", card)
    assert got == ("posix_fd", (("fabric", NOT_PERMITTED), ("posix_fd", "ok")))


def test_auto_falls_back_to_no_shareable_handle_and_past_out_of_memory_as_sglang_does() -> None:
    card = Card(fabric=CUDA_ERROR_NOT_SUPPORTED, posix_fd=CUDA_ERROR_OUT_OF_MEMORY)
    name, answers = _pick_handle_type("auto", card)
    assert name == "none" and [a for _, a in answers] == [
        CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_OUT_OF_MEMORY, "ok"]


def test_auto_refused_everything_raises_the_last_refusal_naming_every_type_tried() -> None:
    card = Card(fabric=NOT_PERMITTED, posix_fd=CUDA_ERROR_OUT_OF_MEMORY,
                none=CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(DriverOutOfMemoryError) as info:
        _pick_handle_type("auto", card)
    assert "handle_type='none'" in str(info.value)
    (note,) = info.value.__notes__
    assert f"fabric ({NOT_PERMITTED})" in note and "posix_fd (CUDA_ERROR_OUT_OF_MEMORY)" in note


def test_fabric_asked_for_is_probed_alone_and_refused_with_a_typed_error_naming_it() -> None:
    card = Card(fabric=NOT_PERMITTED)
    with pytest.raises(DriverError) as info:
        _pick_handle_type("fabric", card)
    err = info.value
    assert card.asked == ["fabric"]  # no fallback when it was asked for by name
    assert err.cuda_error == NOT_PERMITTED and "handle_type='fabric'" in str(err)
    assert any("IMEX" in n and "handle_type='auto'" in n for n in err.__notes__)


def test_fabric_asked_for_where_cuda_takes_it_is_what_the_driver_gets() -> None:
    assert _pick_handle_type("fabric", Card()) == ("fabric", (("fabric", "ok"),))


@pytest.mark.parametrize("want", ["posix_fd", "none"])
def test_posix_fd_and_none_are_taken_as_asked_without_a_probe(want: str) -> None:
    card = Card(posix_fd=NOT_PERMITTED, none=NOT_PERMITTED)
    assert _pick_handle_type(want, card) == (want, ())
    assert card.asked == []


def test_the_order_is_sglang_0_5_23s_own_as_its_source_writes_it() -> None:
    src = SGLANG_DIR / "sglang" / "srt" / "utils" / "cuda_vmm_utils.py"
    if not src.is_file():
        pytest.skip(f"the sglang 0.5.23 wheel is not unpacked at {SGLANG_DIR} (`make sglang`)")
    tree = ast.parse(src.read_text())
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
             and n.name == "get_device_allocation_handle_type"]
    (tup,) = [n.value for n in ast.walk(fn) if isinstance(n, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "candidates" for t in n.targets)]
    assert isinstance(tup, ast.Tuple)
    names = {"fabric": "fabric", "posix_fd": "posix_fd"}
    order = tuple(names[e.id] if isinstance(e, ast.Name) else
                  "none" if isinstance(e, ast.Constant) and e.value == 0 else ast.dump(e)
                  for e in tup.elts)
    assert order == AUTO_HANDLE_ORDER
