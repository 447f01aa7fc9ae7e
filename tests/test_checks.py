"""The one argument-check policy: exact exception types and messages."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from omnicache.checks import (
    check_bool,
    check_int,
    check_number,
    check_optional_int,
    check_optional_str,
    check_str,
    type_name,
)


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda: check_int("n", 3), 3),
        (lambda: check_int("n", 0, minimum=0), 0),
        (lambda: check_int("n", 7, minimum=1, maximum=7), 7),
        (lambda: check_optional_int("n", None, minimum=1), None),
        (lambda: check_optional_int("n", 5, minimum=1), 5),
        (lambda: check_number("x", 2, minimum=0), 2.0),
        (lambda: check_number("x", 0.5, minimum=0, maximum=1), 0.5),
        (lambda: check_bool("b", False), False),
        (lambda: check_str("s", ""), ""),
        (lambda: check_str("s", "a", nonempty=True), "a"),
        (lambda: check_optional_str("s", None), None),
        (lambda: check_optional_str("s", "x"), "x"),
    ],
)
def test_good_values_come_back_unchanged(call: Callable[[], object], expected: object) -> None:
    result = call()
    assert result == expected
    assert type(result) is type(expected)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: check_int("n", 1.0), TypeError, "n: expected int, found float"),
        (lambda: check_int("n", True), TypeError, "n: expected int, found bool"),
        (lambda: check_int("n", "3"), TypeError, "n: expected int, found str"),
        (lambda: check_int("n", 0, minimum=1), ValueError, "n: expected int >= 1, found 0"),
        (lambda: check_int("n", 9, maximum=8), ValueError, "n: expected int <= 8, found 9"),
        (
            lambda: check_int("n", -1, minimum=0, maximum=7),
            ValueError,
            "n: expected int in [0, 7], found -1",
        ),
        (lambda: check_optional_int("n", 1.5), TypeError, "n: expected int or None, found float"),
        (
            lambda: check_optional_int("n", 0, minimum=1),
            ValueError,
            "n: expected int >= 1 or None, found 0",
        ),
        (lambda: check_number("x", True), TypeError, "x: expected a number, found bool"),
        (lambda: check_number("x", "1"), TypeError, "x: expected a number, found str"),
        (
            lambda: check_number("x", -0.5, minimum=0),
            ValueError,
            "x: expected a number >= 0, found -0.5",
        ),
        (
            lambda: check_number("x", float("nan"), minimum=0),
            ValueError,
            "x: expected a number >= 0, found nan",
        ),
        (lambda: check_bool("b", 1), TypeError, "b: expected bool, found int"),
        (lambda: check_str("s", b"x"), TypeError, "s: expected str, found bytes"),
        (
            lambda: check_str("s", "", nonempty=True),
            ValueError,
            "s: expected a non-empty str, found ''",
        ),
        (lambda: check_optional_str("s", 3), TypeError, "s: expected str or None, found int"),
    ],
)
def test_bad_values_raise_the_policy_error(
    call: Callable[[], object], error: type[Exception], message: str
) -> None:
    with pytest.raises(Exception) as info:
        call()
    assert type(info.value) is error
    assert str(info.value) == message


def test_type_name_is_the_bare_class_name() -> None:
    assert [type_name(v) for v in (1, None, [], b"")] == ["int", "NoneType", "list", "bytes"]
