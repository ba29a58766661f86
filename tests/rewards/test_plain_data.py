"""The plain-data codec between the code reward's two processes: exact round trips (types and float bits), a
subclass crossing as its base type (so a faked ``__eq__`` stays behind), strict rejection of anything else, and
in-place updates of the caller's arguments."""

from __future__ import annotations

import json
import math
import struct
import sys

import pytest

from lightning_grpo.rewards.plain_data import PlainDataError, assign, dumps, encode, loads


def _same(a, b) -> bool:
    """Equal in type and value, recursively; floats bit for bit (NaN and -0.0 included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, complex):
        return _same(a.real, b.real) and _same(a.imag, b.imag)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


VALUES = [
    None, True, False, 0, -7, 10 ** 5000, 0.1, 1 / 3, -0.0, float("inf"), float("-inf"), float("nan"), 1e-320,
    complex(1.5, -2.0), "", "naïve\n\"quoted\"\t\ud800", b"\x00\xff", bytearray(b"ab"), [], [1, [2, [3]]], (), (1,),
    ([1], (2, 3)), {}, {1: "a", "1": 1, (2, 3): [4], None: True, 2.5: frozenset({1})}, {1, 2, "x"}, frozenset(),
    [(1.0, 2), {"k": (None,)}],
]


@pytest.fixture
def any_int_size():
    """The harnesses lift the interpreter's digit limit of int <-> str (both sandboxed processes do)."""
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    yield
    sys.set_int_max_str_digits(limit)


@pytest.mark.parametrize("value", VALUES, ids=[f"v{i}" for i in range(len(VALUES))])
def test_plain_values_come_back_exactly(value, any_int_size):
    text = dumps(value)
    assert "\n" not in text
    assert _same(loads(text), value)


def test_an_int_past_the_digit_limit_is_an_error_not_a_crash():
    with pytest.raises(PlainDataError, match="cannot write the value"):
        dumps(10 ** 5000)
    with pytest.raises(PlainDataError, match="not JSON"):
        loads("1" * 5000)


def test_lists_tuples_and_dicts_stay_apart():
    assert loads(dumps([1, 2])) != (1, 2) and loads(dumps((1, 2))) == (1, 2)
    assert json.loads(dumps({"a": 1})) == {"dict": [["a", 1]]}
    assert json.loads(dumps((1, [2.5]))) == {"tuple": [1, [2.5]]}


def test_a_subclass_crosses_as_its_base_type():
    class AlwaysEqual(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    class Shouting(str):
        def __eq__(self, other):
            return True

        __hash__ = str.__hash__

    value = loads(dumps([AlwaysEqual(13), Shouting("no")]))
    assert value == [13, "no"] and type(value[0]) is int and type(value[1]) is str
    assert value[0] != 5 and value[1] != "yes"


@pytest.mark.parametrize("value", [object(), lambda: 1, iter([1]), {1: object()}, [print], type])
def test_anything_else_is_refused(value):
    with pytest.raises(PlainDataError, match="not plain data"):
        encode(value)


def test_a_value_that_holds_itself_is_refused():
    loop: list = []
    loop.append(loop)
    with pytest.raises(PlainDataError, match="nested too deeply"):
        dumps(loop)


@pytest.mark.parametrize("text", [
    "", "{", '{"tuple": [1], "set": [2]}', '{"object": []}', '{"tuple": 1}', '{"dict": [[1]]}', '{"dict": [1, 2]}',
    '{"set": [[1]]}', '{"dict": [[[1], 2]]}', '{"bytes": "zz"}', '{"bytes": 1}', '{"complex": [1, "2"]}',
    '{"complex": [1]}', "[" * 100000 + "]" * 100000,
])
def test_decoding_is_strict(text):
    with pytest.raises(PlainDataError):
        loads(text)


def test_assign_updates_the_callers_containers_in_place():
    inner = [3, 1]
    outer = [inner, {"k": [1]}, (5, [9])]
    keep = outer[1]["k"]
    assert assign(outer, [[1, 3], {"k": [1, 2], "new": 0}, (5, [8, 9])])
    assert outer == [[1, 3], {"k": [1, 2], "new": 0}, (5, [8, 9])]
    assert outer[0] is inner and outer[1]["k"] is keep and inner == [1, 3] and keep == [1, 2]
    numbers = {1, 2}
    assert assign(numbers, {3}) and numbers == {3}
    raw = bytearray(b"ab")
    assert assign(raw, bytearray(b"xyz")) and raw == b"xyz"
    shorter = [1, 2, 3]
    assert assign(shorter, [7]) and shorter == [7]
    assert not assign((1, 2), (1, 3)) and not assign(1, 2) and assign(math.pi, math.pi)
