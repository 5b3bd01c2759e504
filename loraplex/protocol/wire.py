"""One decoder for every payload: a frozen dataclass built from its JSON form (what `json.loads` / `orjson.loads`
give) by the dataclass's own type hints, so a new payload declares its fields and nothing else.

Supported hints: int, float (an int is taken and made a float), str, bool, None and unions with None (`X | None`),
`tuple[X, ...]` and `list[X]` (a JSON array), `dict[str, X]` (a JSON object), `Any` or `object` (taken as it is), StrEnums, and
nested dataclasses (an object; an instance already built is taken as it is). A bool is never an int here. A value
that does not fit is a ValueError naming its path (`data[0].model_input[3]: expected int, got str`); a field the
dataclass lacks, or a required one that is missing, too. Stdlib only: the worker ranks decode with it."""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
from collections.abc import Callable, Hashable, Mapping
from typing import Any, ClassVar, TypeVar, Union, cast, get_args, get_origin, get_type_hints

T = TypeVar("T")
_MISSING = dataclasses.MISSING


def from_json(cls: type[T], data: object, where: str = "") -> T:
    """`data` (the JSON form of a `cls`) as a `cls`; ValueError naming the path when it does not fit. `where`: the
    path of `data` itself in messages ("" at the top: fields are named bare)."""
    decoded: T = _decoder(cast(Hashable, cls))(data, where)
    return decoded


def describe(hint: Any) -> str:
    """A hint as messages name it: `int`, `list[int]`, `str or None`, `object`."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return "anything"
    if hint is type(None):
        return "None"
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin is tuple or origin is list:
        return f"list[{describe(args[0])}]" if args else "list"
    if origin is dict or hint is dict or dataclasses.is_dataclass(hint):
        return "object"
    return getattr(hint, "__name__", str(hint))


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _got(value: object) -> str:
    return "a bool" if isinstance(value, bool) else type(value).__name__


def _fail(where: str, hint: Any, value: object) -> ValueError:
    return ValueError(f"{where or 'value'}: expected {describe(hint)}, got {_got(value)}")


Decoder = Callable[[object, str], Any]


@functools.cache
def _decoder(hint: Any) -> Decoder:
    """The decoder of one hint, built once per hint (the hot path is one call per field)."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any or hint is object:
        return lambda value, where: value
    if hint is bool:
        return _exact(bool, hint)
    if hint is int:
        return _exact(int, hint)
    if hint is str:
        return _exact(str, hint)
    if hint is float:
        return _float
    if hint is type(None):
        return _none
    if origin in (Union, types.UnionType):
        return _union(args, hint)
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"wire: only tuple[X, ...] is supported, not {hint}")
        return _sequence(args[0], hint, tuple)
    if origin is list:
        return _sequence(args[0] if args else Any, hint, list)
    if origin is dict or hint is dict:
        if args and args[0] is not str:
            raise TypeError(f"wire: only dict[str, X] is supported, not {hint}")
        return _mapping(args[1] if args else Any, hint)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass(hint)
    raise TypeError(f"wire: no decoder for {hint!r}")


def _exact(kind: type, hint: Any) -> Decoder:
    def decode(value: object, where: str) -> Any:
        if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
            return value
        raise _fail(where, hint, value)

    return decode


def _float(value: object, where: str) -> float:
    if type(value) is float:
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise _fail(where, float, value)


def _none(value: object, where: str) -> None:
    if value is not None:
        raise _fail(where, None, value)


def _union(args: tuple[Any, ...], hint: Any) -> Decoder:
    optional = type(None) in args
    options = [_decoder(a) for a in args if a is not type(None)]

    def decode(value: object, where: str) -> Any:
        if value is None and optional:
            return None
        for option in options:
            try:
                return option(value, where)
            except ValueError as exc:
                if not str(exc).startswith(f"{where or 'value'}: expected"):
                    raise  # a deeper field's error says more than "expected X or Y"
        raise _fail(where, hint, value)

    return decode


def _sequence(item: Any, hint: Any, make: type) -> Decoder:
    if item is Any:

        def loose(value: object, where: str) -> Any:
            if type(value) is make:
                return value
            if isinstance(value, list | tuple):
                return make(value)
            raise _fail(where, hint, value)

        return loose
    decode_item = _decoder(item)
    plain = item if item in (int, str, bool) else None

    def decode(value: object, where: str) -> Any:
        if not isinstance(value, list | tuple):
            raise _fail(where, hint, value)
        if plain is not None and all(type(v) is plain for v in value):  # the common case: no copy, no call per item
            return value if type(value) is make else make(value)
        return make(decode_item(v, f"{where}[{i}]") for i, v in enumerate(value))

    return decode


def _mapping(item: Any, hint: Any) -> Decoder:
    decode_item = None if item is Any else _decoder(item)

    def decode(value: object, where: str) -> Any:
        if not isinstance(value, Mapping):
            raise _fail(where, hint, value)
        out: dict[str, Any] = {}
        for key, v in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where or 'value'}: keys must be strings, got {_got(key)}")
            out[key] = v if decode_item is None else decode_item(v, _join(where, key))
        return out

    return decode


def _enum(hint: type[enum.Enum]) -> Decoder:
    def decode(value: object, where: str) -> Any:
        try:
            return hint(value)
        except ValueError:
            names = ", ".join(str(m.value) for m in hint)
            raise ValueError(f"{where or 'value'}: {value!r} is not one of {names}") from None

    return decode


def _dataclass(cls: type) -> Decoder:
    hints = get_type_hints(cls)
    specs: list[tuple[str, Decoder, bool]] = []  # (name, decoder, required)
    for f in dataclasses.fields(cls):
        if not f.init or get_origin(hints[f.name]) is ClassVar:
            continue
        required = f.default is _MISSING and f.default_factory is _MISSING
        specs.append((f.name, _decoder(hints[f.name]), required))
    known = frozenset(name for name, _, _ in specs)
    label = getattr(cls, "KIND_NAME", cls.__name__)

    def decode(value: object, where: str) -> Any:
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{where or label}: expected an object, got {_got(value)}")
        unknown = [k for k in value if k not in known]
        if unknown:
            raise ValueError(f"{where or label}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
        kwargs: dict[str, Any] = {}
        for name, decode_field, required in specs:
            if name in value:
                kwargs[name] = decode_field(value[name], _join(where, name))
            elif required:
                raise ValueError(f"{_join(where, name)}: missing")
        return cls(**kwargs)

    return decode
