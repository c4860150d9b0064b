"""Units, formatting and the error hierarchy: the vocabulary every message is written in."""

from __future__ import annotations

import inspect
import pickle

import pytest

import kvvmm
from kvvmm import errors
from kvvmm.driver.base import driver_error
from kvvmm.errors import (
    AlignmentError,
    ArgumentError,
    ClosedError,
    DriverError,
    DriverOutOfMemoryError,
    DriverUnavailableError,
    KvvmmError,
    OutOfRangeError,
    ReservationExhaustedError,
    TraceFormatError,
    UnknownDtypeError,
)
from kvvmm.units import GiB, KiB, MiB, TiB, align_down, align_up, fmt_bytes, fmt_range

# -- units ------------------------------------------------------------------------------------


def test_units_are_powers_of_two() -> None:
    assert (KiB, MiB, GiB, TiB) == (2**10, 2**20, 2**30, 2**40)


@pytest.mark.parametrize(
    ("value", "alignment", "up", "down"),
    [
        (0, 2 * MiB, 0, 0),
        (1, 2 * MiB, 2 * MiB, 0),
        (2 * MiB - 1, 2 * MiB, 2 * MiB, 0),
        (2 * MiB, 2 * MiB, 2 * MiB, 2 * MiB),
        (2 * MiB + 1, 2 * MiB, 4 * MiB, 2 * MiB),
        (7, 3, 9, 6),
        (10**15 + 1, 2 * MiB, (10**15 // (2 * MiB) + 1) * 2 * MiB, 10**15 // (2 * MiB) * 2 * MiB),
    ],
)
def test_align_up_and_down_round_to_the_nearest_multiple(
    value: int, alignment: int, up: int, down: int
) -> None:
    assert align_up(value, alignment) == up
    assert align_down(value, alignment) == down
    assert align_down(value, alignment) <= value <= align_up(value, alignment)


@pytest.mark.parametrize("alignment", [0, -2 * MiB])
def test_align_refuses_an_alignment_that_is_not_positive(alignment: int) -> None:
    with pytest.raises(ValueError, match=f"alignment={alignment}"):
        align_up(4096, alignment)
    with pytest.raises(ValueError, match=f"alignment={alignment}"):
        align_down(4096, alignment)


def test_align_up_refuses_a_negative_value() -> None:
    with pytest.raises(ValueError, match="value=-1"):
        align_up(-1, 4096)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (KiB, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (2 * MiB, "2.0 MiB"),
        (int(139.8 * GiB), "139.8 GiB"),
        (3 * TiB, "3.0 TiB"),
        (-2 * MiB, "-2.0 MiB"),
    ],
)
def test_fmt_bytes_picks_the_largest_unit_that_fits(nbytes: int, text: str) -> None:
    assert fmt_bytes(nbytes) == text


def test_fmt_range_is_half_open_and_hex() -> None:
    assert fmt_range(0x7F00_0020_0000, 0x7F00_0040_0000) == "[0x7f0000200000, 0x7f0000400000)"
    assert fmt_range(0, 2 * MiB) == "[0x0, 0x200000)"


# -- the error hierarchy ----------------------------------------------------------------------

ERROR_CLASSES = [getattr(errors, name) for name in errors.__all__]


def test_every_error_class_is_exported_at_the_top_level_and_is_a_kvvmm_error() -> None:
    assert len(ERROR_CLASSES) >= 10
    for cls in ERROR_CLASSES:
        assert issubclass(cls, KvvmmError), cls
        assert getattr(kvvmm, cls.__name__) is cls


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_class_has_its_own_docstring_saying_why_it_exists(cls: type) -> None:
    doc = cls.__dict__.get("__doc__")  # its own, not inherited
    assert doc and len(inspect.cleandoc(doc)) >= 40, f"{cls.__name__} needs a docstring"
    assert doc != KvvmmError.__doc__ or cls is KvvmmError


def test_input_errors_are_also_the_builtin_errors_callers_already_catch() -> None:
    for cls in (ArgumentError, AlignmentError, OutOfRangeError, UnknownDtypeError,
                TraceFormatError):
        assert issubclass(cls, ValueError)
    assert issubclass(UnknownDtypeError, TypeError)
    assert issubclass(DriverOutOfMemoryError, DriverError)
    for cls in (ClosedError, ReservationExhaustedError, DriverUnavailableError, DriverError):
        assert not issubclass(cls, ValueError)


def test_an_argument_error_names_the_value_and_the_limit() -> None:
    err = OutOfRangeError("n", 5000, "<= reserved_tokens (4096)", "buffer 'k0'")
    assert str(err) == "n=5000 is invalid: must be <= reserved_tokens (4096) (buffer 'k0')"
    assert (err.name, err.value, err.limit) == ("n", 5000, "<= reserved_tokens (4096)")


def test_a_driver_error_shows_addresses_in_hex_and_sizes_in_decimal() -> None:
    err = driver_error("map", {"va": 0x7F00_0020_0000, "size": 2 * MiB, "handle": 3},
                       "CUDA_ERROR_INVALID_VALUE", "size 2097152 != the handle's 4194304 bytes")
    text = str(err)
    assert text.startswith("map(va=0x7f0000200000, size=2097152, handle=3) failed: ")
    assert "CUDA_ERROR_INVALID_VALUE" in text and "4194304" in text
    assert type(err) is DriverError
    assert err.call == "map" and err.cuda_error == "CUDA_ERROR_INVALID_VALUE"


def test_an_out_of_memory_driver_error_is_its_own_class() -> None:
    err = driver_error("create", {"size": 4 * GiB}, "CUDA_ERROR_OUT_OF_MEMORY", "x")
    assert type(err) is DriverOutOfMemoryError
    assert str(err).startswith(f"create(size={4 * GiB}) failed: CUDA_ERROR_OUT_OF_MEMORY")


@pytest.mark.parametrize("cuda_error", ["CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_OUT_OF_MEMORY"])
def test_a_driver_error_survives_pickling(cuda_error: str) -> None:
    err = driver_error("unmap", {"va": 0x7F00_0000_0000, "size": 2 * MiB}, cuda_error,
                       "part of a mapping")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert str(back) == str(err)
    assert (back.call, back.call_args, back.cuda_error, back.reason) == (
        err.call, err.call_args, err.cuda_error, err.reason)


def test_a_driver_error_keeps_its_notes_through_pickling() -> None:
    err = driver_error("map", {"va": 0x7F00_0000_0000, "size": 2 * MiB, "handle": 1},
                       "CUDA_ERROR_OUT_OF_MEMORY", "injected")
    err.add_note("undo release(handle=1) also failed: ...")
    back = pickle.loads(pickle.dumps(err))
    assert getattr(back, "__notes__", None) == err.__notes__


@pytest.mark.parametrize(
    "err",
    [ClosedError("arena 'kv': commit after close()"), ReservationExhaustedError("no room"),
     DriverUnavailableError("no GPU"), TraceFormatError("bad"), KvvmmError("x")],
    ids=lambda e: type(e).__name__,
)
def test_message_only_errors_survive_pickling(err: KvvmmError) -> None:
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)


@pytest.mark.parametrize(
    "err",
    [ArgumentError("page_size", 0, ">= 1"), AlignmentError("offset", 12345, "a multiple"),
     OutOfRangeError("n", 5000, "<= 4096", "detail"), UnknownDtypeError("dtype", "f64", "x")],
    ids=lambda e: type(e).__name__,
)
def test_argument_errors_survive_pickling(err: ArgumentError) -> None:
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)
    assert (back.name, back.value, back.limit) == (err.name, err.value, err.limit)
