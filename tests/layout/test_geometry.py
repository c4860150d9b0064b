"""kvvmm.layout.geometry: descriptor agreement, checked without an arena or a driver."""

from __future__ import annotations

import pytest

from kvvmm.errors import ArgumentError, OutOfRangeError
from kvvmm.layout import (
    agreed_page_size,
    agreed_reserved_tokens,
    check_itemsize,
    growth_targets,
    layer_interleaved,
    mha_token_major,
    page_major,
)

KW = {"layers": 2, "kv_heads": 4, "head_dim": 64, "reserved_tokens": 4096, "dtype": "bfloat16"}


@pytest.mark.parametrize("make", [mha_token_major, page_major, layer_interleaved])
def test_every_preset_agrees_with_itself(make: object) -> None:
    descs = make(page_size=16, **KW)  # type: ignore[operator]
    check_itemsize(descs, "bfloat16", 2)
    ps = agreed_page_size(descs, 16)
    assert ps == 16
    assert agreed_reserved_tokens(descs, ps, None, 2) >= 4096


def test_page_major_descs_state_the_page_size_and_a_given_one_must_agree() -> None:
    descs = page_major(page_size=32, **KW)
    assert agreed_page_size(descs, None) == 32
    with pytest.raises(ArgumentError, match="page_size"):
        agreed_page_size(descs, 16)


def test_token_major_descs_need_the_page_size_given() -> None:
    with pytest.raises(ArgumentError, match="token-major"):
        agreed_page_size(mha_token_major(page_size=16, **KW), None)


def test_a_dtype_of_another_size_is_blamed_when_every_desc_agrees_on_one() -> None:
    descs = mha_token_major(page_size=16, **KW)
    with pytest.raises(ArgumentError, match="dtype") as e:
        check_itemsize(descs, "float32", 4)
    assert "2 bytes per element" in str(e.value)


def test_the_token_bound_is_what_every_buffer_holds_with_its_padded_page() -> None:
    descs = mha_token_major(page_size=16, **KW)
    most = agreed_reserved_tokens(descs, 16, None, 2)
    assert agreed_reserved_tokens(descs, 16, most, 2) == most
    with pytest.raises(OutOfRangeError, match="reserved_tokens"):
        agreed_reserved_tokens(descs, 16, most + 1, 2)
    with pytest.raises(ArgumentError, match="page_size"):
        agreed_reserved_tokens(descs, 16, 8, 2)


def test_growth_targets_check_every_span_first_then_every_answer_of_the_policy() -> None:
    from kvvmm.policy import Exact

    g = 2 << 20
    names, reserved, limits = ["k0", "v0"], [10 * g, 10 * g], [10 * g, 10 * g]
    # only the buffer whose span passes what it has backed grows, to the policy's answer
    assert growth_targets(Exact(), names, [3 * g, g], reserved, limits, [g, g], g) == [
        (0, g, 3 * g)]
    with pytest.raises(OutOfRangeError, match="span of 'v0'"):
        growth_targets(Exact(), names, [3 * g, 11 * g], reserved, limits, [0, 0], g)

    class Short(Exact):
        def target_bytes(self, backed: int, need: int, limit: int, gran: int) -> int:
            return need - gran

    with pytest.raises(ArgumentError, match="buffer 'k0'"):
        growth_targets(Short(), names, [3 * g, 0], reserved, limits, [0, 0], g)
