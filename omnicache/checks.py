"""Argument checks: one policy for every public boundary of ``omnicache``.

- A value of the wrong type raises `TypeError`; a value of the right type
  outside its range raises `ValueError`.
- Messages read ``"<name>: expected <what>, found <what was given>"``: the
  type's name for a wrong type, the value for a wrong value.
- ``bool`` is never accepted where an int is expected (``True`` is an int in
  Python, but never a count or an id a caller meant).

Invariants on private paths are asserts, not checks: these functions guard
what a caller hands in. (``hashing`` keeps its own copy of the few it needs:
it must not import ``omnicache``.)
"""

from __future__ import annotations

__all__: list[str] = []


def type_name(value: object) -> str:
    """The name a message gives the type of ``value``."""
    return type(value).__name__


def _range(minimum: int | float | None, maximum: int | float | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def check_int(
    name: str, value: object, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """Returns ``value`` if it is an int (not a bool) in ``[minimum, maximum]``.

    Raises:
        TypeError: Not an int: ``"name: expected int, found float"``.
        ValueError: Out of range: ``"name: expected int >= 1, found 0"``.
    """
    if type(value) is not int:
        raise TypeError(f"{name}: expected int, found {type_name(value)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name}: expected int{_range(minimum, maximum)}, found {value}")
    return value


def check_optional_int(
    name: str, value: object, *, minimum: int | None = None, maximum: int | None = None
) -> int | None:
    """`check_int`, with None allowed (and returned)."""
    if value is None:
        return None
    if type(value) is not int:
        raise TypeError(f"{name}: expected int or None, found {type_name(value)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name}: expected int{_range(minimum, maximum)} or None, found {value}")
    return value


def check_number(
    name: str, value: object, *, minimum: float | None = None, maximum: float | None = None
) -> float:
    """Returns ``value`` as a float if it is an int or float (not a bool) in range.

    NaN is out of every range.
    """
    if type(value) not in (int, float):
        raise TypeError(f"{name}: expected a number, found {type_name(value)}")
    number = float(value)  # type: ignore[arg-type]
    low_ok = minimum is None or number >= minimum
    high_ok = maximum is None or number <= maximum
    if not (low_ok and high_ok) or number != number:
        raise ValueError(f"{name}: expected a number{_range(minimum, maximum)}, found {value}")
    return number


def check_bool(name: str, value: object) -> bool:
    """Returns ``value`` if it is a bool."""
    if type(value) is not bool:
        raise TypeError(f"{name}: expected bool, found {type_name(value)}")
    return value


def check_str(name: str, value: object, *, nonempty: bool = False) -> str:
    """Returns ``value`` if it is a str (non-empty when ``nonempty``)."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected str, found {type_name(value)}")
    if nonempty and not value:
        raise ValueError(f"{name}: expected a non-empty str, found ''")
    return value


def check_optional_str(name: str, value: object) -> str | None:
    """Returns ``value`` if it is a str or None."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name}: expected str or None, found {type_name(value)}")
    return value
