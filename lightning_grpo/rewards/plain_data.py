"""Plain data between the two sandboxed processes of the code reward: Python values as JSON, decoded strictly.

The values that cross are ``None``, ``bool``, ``int``, ``float`` (NaN and the infinities included), ``complex``,
``str``, ``bytes``, ``bytearray``, ``list``, ``tuple``, ``dict``, ``set`` and ``frozenset``, nested freely; a
subclass of one of them crosses as that type (an ``int`` subclass as an ``int``: whatever its ``__eq__`` does, the
other side sees the number). ``None``, booleans, numbers, strings and lists are JSON's own; the other types are
one-key objects: ``{"tuple": [...]}``, ``{"set": [...]}``, ``{"frozenset": [...]}``, ``{"dict": [[key, value],
...]}``, ``{"bytes": "<hex>"}``, ``{"bytearray": "<hex>"}``, ``{"complex": [real, imag]}``. Floats are written with
``repr``, so they come back bit for bit. Decoding accepts exactly that and nothing else (:class:`PlainDataError`).

Standard library only, and no ``from __future__`` import or annotation the oldest supported interpreter lacks: this
file's text is also run inside the sandbox, before the code reward's harnesses
(:mod:`lightning_grpo.rewards.code_harness`).
"""

import json


class PlainDataError(ValueError):
    """A value that is not plain data (see the module docstring), or a text that does not decode to it."""


def encode(value):
    """``value`` as JSON-ready data (see the module docstring).

    Raises:
        PlainDataError: a value (or a part of it) of another type, or one nested too deeply (a cycle).
    """
    try:
        return _encode(value)
    except RecursionError:
        raise PlainDataError("the value is nested too deeply (or holds itself)") from None


_SCALARS = ((int, int.__int__), (float, float.__float__), (str, str.__str__))
_COLLECTIONS = ((tuple, "tuple"), (frozenset, "frozenset"), (set, "set"))


def _encode(value):
    if value is None or value is True or value is False:
        return value
    for base, exact in _SCALARS:  # a subclass as its base type: the number or text, not the object
        if isinstance(value, base):
            return exact(value)
    if isinstance(value, list):
        return [_encode(v) for v in value]
    for base, tag in _COLLECTIONS:
        if isinstance(value, base):
            return {tag: [_encode(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if isinstance(value, complex):
        return {"complex": [float(value.real), float(value.imag)]}
    if isinstance(value, (bytes, bytearray)):
        return {"bytearray" if isinstance(value, bytearray) else "bytes": bytes(value).hex()}
    raise PlainDataError("a value of type %s is not plain data" % type(value).__name__)


def decode(data):
    """The value :func:`encode` gave ``data`` for (``data`` as ``json.loads`` returns it).

    Raises:
        PlainDataError: ``data`` is not the output of :func:`encode` (an unknown tag, a malformed body, an
            unhashable set element or key, nesting too deep).
    """
    try:
        return _decode(data)
    except (TypeError, ValueError, RecursionError) as err:
        if isinstance(err, PlainDataError):
            raise
        raise PlainDataError("not plain data: %s: %s" % (type(err).__name__, err)) from None


def _decode(data):
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [_decode(v) for v in data]
    if kind is not dict or len(data) != 1:
        raise PlainDataError("not plain data: a %s" % kind.__name__)
    ((tag, body),) = data.items()
    if tag in ("tuple", "set", "frozenset") and type(body) is list:
        items = [_decode(v) for v in body]
        return tuple(items) if tag == "tuple" else (set(items) if tag == "set" else frozenset(items))
    if tag == "dict" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
        return {_decode(k): _decode(v) for k, v in body}
    if tag in ("bytes", "bytearray") and type(body) is str:
        raw = bytes.fromhex(body)
        return raw if tag == "bytes" else bytearray(raw)
    if tag == "complex" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
        return complex(body[0], body[1])
    raise PlainDataError("not plain data: the tag %r with a %s" % (str(tag)[:40], type(body).__name__))


def dumps(value):
    """:func:`encode` as one line of JSON text (never a newline inside).

    Raises:
        PlainDataError: as :func:`encode`.
    """
    try:
        return json.dumps(encode(value), separators=(",", ":"), allow_nan=True)
    except (ValueError, RecursionError) as err:  # an int past the interpreter's digit limit, say
        if isinstance(err, PlainDataError):
            raise
        raise PlainDataError("cannot write the value: %s" % err) from None


def loads(text):
    """The value of a :func:`dumps` text.

    Raises:
        PlainDataError: ``text`` is not JSON, or not :func:`encode`'s output.
    """
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise PlainDataError("not JSON: %s" % str(err)[:200]) from None
    return decode(data)


def assign(target, value):
    """Make the container ``target`` equal to ``value`` in place, as far as its type allows: lists, dicts, sets and
    bytearrays take ``value``'s contents (elements that are such containers themselves are updated in place, so
    objects the caller still holds see the change); a tuple updates its elements. Returns whether ``target`` equals
    ``value`` afterwards (False for an immutable value that differs: the caller replaces it)."""
    if type(target) is not type(value):
        return False
    update = _UPDATES.get(type(target))
    if update is not None:
        return update(target, value)
    try:
        return bool(target == value)
    except Exception:
        return False


def _assign_list(target, value):
    if len(target) != len(value):
        target[:] = value
        return True
    for i in range(len(value)):
        if not assign(target[i], value[i]):
            target[i] = value[i]
    return True


def _assign_dict(target, value):
    for key in [k for k in target if k not in value]:
        del target[key]
    for key, item in value.items():
        if key not in target or not assign(target[key], item):
            target[key] = item
    return True


def _assign_set(target, value):
    target.clear()
    target.update(value)
    return True


def _assign_bytearray(target, value):
    target[:] = value
    return True


def _assign_tuple(target, value):
    return len(target) == len(value) and all([assign(target[i], value[i]) for i in range(len(value))])


_UPDATES = {list: _assign_list, dict: _assign_dict, set: _assign_set, bytearray: _assign_bytearray,
            tuple: _assign_tuple}
