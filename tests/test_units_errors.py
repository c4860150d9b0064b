"""Units, formatting and the error hierarchy: the vocabulary every message is written in."""

from __future__ import annotations

import inspect
import math
import pickle
from typing import Any

import pytest

import kvvmm
from kvvmm import checks, errors
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
    StateError,
    TraceFormatError,
    UnknownDtypeError,
)
from kvvmm.units import (
    MAX_BYTES,
    GiB,
    KiB,
    MiB,
    PiB,
    TiB,
    align_down,
    align_up,
    fmt_bytes,
    fmt_range,
    parse_size,
)

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
    with pytest.raises(ArgumentError, match=f"^alignment={alignment} is invalid: must be > 0$"):
        align_up(4096, alignment)
    with pytest.raises(ArgumentError, match=f"^alignment={alignment} is invalid: must be > 0$"):
        align_down(4096, alignment)


def test_align_up_refuses_a_negative_value() -> None:
    with pytest.raises(ArgumentError, match=r"^value=-1 is invalid: must be >= 0$"):
        align_up(-1, 4096)
    with pytest.raises(ArgumentError, match=r"^value=-1 is invalid: must be >= 0$"):
        align_down(-1, 4096)


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


# -- sizes written as text --------------------------------------------------------------------


@pytest.mark.parametrize(("text", "nbytes"), [
    ("0", 0), ("4096", 4096), ("80GiB", 80 * GiB), ("512 MiB", 512 * MiB), ("2gb", 2 * 10**9),
    ("1.5GiB", 3 * GiB // 2), ("0.5KiB", 512), (" 7 B ", 7), ("1PiB", PiB), ("3TB", 3 * 10**12),
    ("64PiB", MAX_BYTES), (str(MAX_BYTES), MAX_BYTES), (str(MAX_BYTES - 1), MAX_BYTES - 1),
    ("0.000000001GB", 1), ("1." + "0" * 40 + "KiB", KiB),
])
def test_a_size_is_read_exactly_with_no_float_in_between(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", [
    str(MAX_BYTES + 1), "65537TiB", "64.5PiB", str(2**64), str(2**63 - 1), "9" * 64,
])
def test_a_size_past_max_bytes_is_refused_naming_the_value_and_the_limit(text: str) -> None:
    with pytest.raises(OutOfRangeError) as e:
        parse_size(text)
    assert str(MAX_BYTES) in str(e.value) and repr(text) in str(e.value)


def test_a_size_one_byte_past_the_limit_is_not_rounded_to_it() -> None:
    with pytest.raises(OutOfRangeError, match=str(MAX_BYTES + 1)):
        parse_size(str(MAX_BYTES + 1))
    with pytest.raises(OutOfRangeError, match=r"in \[0, 1073741823\]"):
        parse_size("1GiB", hi=GiB - 1)
    with pytest.raises(ArgumentError, match="1, "):
        parse_size("0", lo=1)


@pytest.mark.parametrize(("text", "says"), [
    ("9" * 400, "64 characters"), ("9" * 65, "64 characters"), ("1e300", "exponents"),
    ("1E3", "exponents"), ("-1", "negative"), ("-0", "negative"), ("nan", "finite"),
    ("inf", "finite"), ("+inf", "finite"), ("Infinity", "finite"), ("", "whole number"),
    ("   ", "whole number"), ("1.5B", "whole number of bytes"), ("0.3KiB", "whole number"),
    ("1.GiB", "whole number"), (".5GiB", "whole number"), ("1,024", "whole number"),
    ("1_000", "whole number"), ("0x10", "whole number"), ("10 parsecs", "whole number"),
    ("\x1b[31m", "whole number"), ("\u0663", "whole number"), ("\uff11\uff10", "whole number"),
    ("1GiB\n2", "whole number"),
])
def test_what_is_not_a_size_is_refused_with_one_line_saying_why(text: str, says: str) -> None:
    with pytest.raises(ArgumentError) as e:
        parse_size(text, name="--budget")
    msg = str(e.value)
    assert says in msg and msg.startswith("--budget=") and "\n" not in msg
    assert len(msg) < 500


@pytest.mark.parametrize("value", [None, 4096, 4096.0, b"4096", ["4096"]])
def test_a_size_that_is_not_text_is_refused(value: object) -> None:
    with pytest.raises(ArgumentError):
        parse_size(value)  # type: ignore[arg-type]


def test_the_size_limit_is_the_ledgers() -> None:
    from kvvmm.budget import MAX_BYTES as LEDGER_MAX_BYTES

    assert MAX_BYTES == LEDGER_MAX_BYTES == 64 * PiB


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
    assert issubclass(StateError, RuntimeError) and not issubclass(StateError, ValueError)


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
     DriverUnavailableError("no GPU"), TraceFormatError("bad"), KvvmmError("x"),
     StateError("no open arena: press Reserve first")],
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


# -- the argument checkers (kvvmm.checks) -----------------------------------------------------


@pytest.mark.parametrize("bad", [True, False, "1", None, 1j, [1]], ids=repr)
def test_is_number_and_is_int_refuse_bools_and_what_is_not_a_number(bad: object) -> None:
    assert not checks.is_number(bad) and not checks.is_number(bad, finite=False)
    assert not checks.is_int(bad)


def test_is_number_refuses_nan_always_and_infinity_unless_told() -> None:
    for nan in (math.nan, -math.nan):
        assert not checks.is_number(nan) and not checks.is_number(nan, finite=False)
    for inf in (math.inf, -math.inf, 10**400):
        assert not checks.is_number(inf) and checks.is_number(inf, finite=False)
    assert checks.is_number(0) and checks.is_number(-2.5) and checks.is_number(10**300)


@pytest.mark.parametrize("bad", [True, "0.5", None, math.nan, math.inf, -math.inf, 10**400],
                         ids=repr)
def test_number_arg_refuses_a_bool_a_non_number_nan_and_infinity(bad: object) -> None:
    with pytest.raises(ArgumentError) as e:
        checks.number_arg("q", bad, lo=0, hi=1)
    assert type(e.value) is ArgumentError
    assert (e.value.name, e.value.value, e.value.limit) == ("q", bad, "a number in [0, 1]")


@pytest.mark.parametrize(
    ("kwargs", "bad", "good", "limit"),
    [
        ({"lo": 0, "lo_open": True}, 0, 1e-300, "a finite number > 0"),
        ({"lo": 0}, -1e-300, 0, "a finite number >= 0"),
        ({"hi": 1, "hi_open": True}, 1, 0.999, "a finite number < 1"),
        ({"hi": 1}, 1.0000001, 1, "a finite number <= 1"),
        ({"lo": 1.0, "hi": 1e6, "lo_open": True}, 1.0, 1e6, "a number in (1.0, 1000000.0]"),
        ({"lo": 0, "hi": 1, "hi_open": True, "unit": "of the GPU"}, 1, 0,
         "a number in [0, 1) (of the GPU)"),
    ],
)
def test_number_arg_keeps_its_bounds_and_its_message_names_the_value_and_the_limit(
    kwargs: dict[str, Any], bad: float, good: float, limit: str
) -> None:
    assert checks.number_arg("x", good, **kwargs) == good
    assert type(checks.number_arg("x", good, **kwargs)) is float
    with pytest.raises(ArgumentError) as e:
        checks.number_arg("x", bad, **kwargs)
    assert str(e.value) == f"x={bad!r} is invalid: must be {limit}"
    assert type(e.value) is ArgumentError  # not OutOfRangeError, above hi included


def test_number_arg_states_the_callers_limit_and_lets_infinity_through_when_told() -> None:
    with pytest.raises(ArgumentError, match=r"^factor=0.5 is invalid: must be a number in "
                                            r"\(1, 1e6\]$"):
        checks.number_arg("factor", 0.5, lo=1, lo_open=True, limit="a number in (1, 1e6]")
    assert checks.number_arg("hold_s", math.inf, lo=0, finite=False) == math.inf
    assert checks.number_arg("hold_s", 10**400, lo=0, finite=False) == math.inf
    with pytest.raises(ArgumentError, match="hold_s=-inf is invalid: must be a number >= 0"):
        checks.number_arg("hold_s", -math.inf, lo=0, finite=False)
    with pytest.raises(ArgumentError, match="hold_s=nan"):
        checks.number_arg("hold_s", math.nan, lo=0, finite=False)


def test_int_arg_refuses_a_bool_and_names_the_limit() -> None:
    with pytest.raises(ArgumentError, match=r"^n=True is invalid: must be an int > 0$"):
        checks.int_arg("n", True, lo=1)
    with pytest.raises(OutOfRangeError, match=r"^n=9 is invalid: must be an int in \[1, 8\]$"):
        checks.int_arg("n", 9, lo=1, hi=8)
    assert checks.int_arg("n", 8, lo=1, hi=8) == 8


@pytest.mark.parametrize("bad", [0, 1, None, "True", 1.0, [True]], ids=repr)
def test_bool_arg_takes_true_or_false_only_and_names_the_value(bad: object) -> None:
    assert checks.bool_arg("keep_pool", True) is True
    assert checks.bool_arg("keep_pool", False) is False
    with pytest.raises(ArgumentError) as e:
        checks.bool_arg("keep_pool", bad)
    assert type(e.value) is ArgumentError
    assert (e.value.name, e.value.value, e.value.limit) == ("keep_pool", bad, "True or False")
    with pytest.raises(ArgumentError,
                       match=r"^own=1 is invalid: must be True or False \(mine\?\)$"):
        checks.bool_arg("own", 1, limit="True or False (mine?)")
