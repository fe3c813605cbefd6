"""Typed control-plane messages <-> the plain maps msgpack carries.

A message is a frozen, keyword-only dataclass deriving :class:`Message` whose class-level
``wire_name`` is the map's ``type``; what it nests are :class:`Record` dataclasses (maps
without a ``type``), ``list[...]``, ``tuple[...]`` (a fixed-length array), ``dict[str,
...]`` and the scalars ``int``, ``float``, ``str``, ``bool``, ``bytes`` and ``None``
(``Any`` passes a value through unchecked). The dataclass is the schema: :func:`to_wire`
and :func:`from_wire` walk its field annotations::

    Release(request_id="r1")  --to_wire-->    {"type": "release", "request_id": "r1"}
                              <--from_wire--

Both directions check every field. An unknown ``type``, a missing required field, an
unknown field or a value of the wrong type raises :class:`MalformedMessage` (a
ProtocolError) naming the message kind and the field's path, e.g. ``malformed 'prefill'
message: decode.command: missing``. ``bool`` is not an ``int``; an ``int`` is accepted
(and stored as a float) where a ``float`` is due. A field whose default is None is left
out of the map while it is None. A union of records is told apart by their ``kind``
field (each record class lists its ``kinds``). :func:`encode_message` and
:func:`decode_message` add the signed framing of :mod:`halfmoon.serve.control.protocol`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from halfmoon.serve.control import protocol
from halfmoon.serve.control.protocol import ProtocolError

Convert = Callable[[Any], Any]
R = TypeVar("R", bound="Record")
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what a msgpack integer holds
_ABSENT = object()
_INTS_ONLY = {int}
#: Every message class by its wire name (filled as the classes are defined).
MESSAGE_TYPES: dict[str, type[Message]] = {}


class MalformedMessage(ProtocolError):
    """A message that does not fit its schema. ``msg_id`` and ``request_id`` are the raw
    map's (when they are readable), so a receiver can answer a sender that waits."""

    def __init__(
        self, kind: str, field: str, problem: str, msg_id: int | None = None,
        request_id: str | None = None,
    ) -> None:  # fmt: skip
        where = f"{field}: " if field else ""
        super().__init__(f"malformed {kind!r} message: {where}{problem}")
        self.kind, self.field, self.problem = kind, field, problem
        self.msg_id, self.request_id = msg_id, request_id


class Record:
    """A value nested in a message (a map without ``type``); subclasses are frozen,
    keyword-only dataclasses. A record that is one choice of a union lists the ``kind``
    values it stands for."""

    kinds: ClassVar[tuple[str, ...]] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Message(Record):
    """One control-plane message. ``msg_id``: set by a sender that waits for the answer,
    which echoes it."""

    wire_name: ClassVar[str] = ""
    msg_id: int | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.wire_name in MESSAGE_TYPES or not cls.wire_name:
            raise TypeError(f"{cls.__name__}: wire name {cls.wire_name!r} missing or taken")
        MESSAGE_TYPES[cls.wire_name] = cls


def to_wire(message: Message) -> dict[str, Any]:
    """The message as the map that travels (checked field by field)."""
    cls = type(message)
    if not isinstance(message, Message) or MESSAGE_TYPES.get(cls.wire_name) is not cls:
        raise ProtocolError(f"not a control-plane message: {cls.__name__}")
    try:
        return _encode_record(message, cls)
    except _Invalid as exc:
        raise MalformedMessage(cls.wire_name, exc.field, exc.problem, message.msg_id,
                               getattr(message, "request_id", None)) from None  # fmt: skip


def from_wire(data: Any) -> Message:
    """The message a received map stands for; refuses one that does not fit."""
    if not isinstance(data, dict):
        raise MalformedMessage("?", "", f"a message is a map, not {_name(data)}")
    kind, msg_id, rid = data.get("type"), data.get("msg_id"), data.get("request_id")
    msg_id = msg_id if isinstance(msg_id, int) and not isinstance(msg_id, bool) else None
    rid = rid if isinstance(rid, str) else None
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MalformedMessage(f"{kind!s:.40}", "type", "unknown message type", msg_id, rid)
    try:
        return _decode_record(cls, data)
    except _Invalid as exc:
        raise MalformedMessage(kind, exc.field, exc.problem, msg_id, rid) from None


def record_from_wire(cls: type[R], data: Any) -> R:
    """One nested record from its map, checked like a message's fields."""
    try:
        return _decode_record(cls, data)
    except _Invalid as exc:
        raise MalformedMessage(cls.__name__, exc.field, exc.problem) from None


def record_to_wire(record: Record) -> dict[str, Any]:
    """One nested record's map, as :func:`to_wire` writes it inside a message."""
    try:
        return _encode_record(record, type(record))
    except _Invalid as exc:
        raise MalformedMessage(type(record).__name__, exc.field, exc.problem) from None


def encode_message(message: Message, secret: bytes) -> list[bytes]:
    """Serialise, check and sign one message (the frames after any identity frame)."""
    return protocol.encode(to_wire(message), secret)


def decode_message(frames: Sequence[bytes], secret: bytes) -> Message:
    """Verify and decode one message: :class:`~.protocol.AuthError` for a bad signature,
    ProtocolError for bad framing, :class:`MalformedMessage` for a bad schema."""
    return from_wire(protocol.decode(frames, secret))


# -- the schema walk ------------------------------------------------------------------------------
class _Invalid(Exception):
    """A value that does not fit; its path grows as it climbs out of containers."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.path: list[str] = []

    def at(self, segment: str) -> _Invalid:
        self.path.insert(0, segment)
        return self

    @property
    def field(self) -> str:
        return "".join(self.path).lstrip(".")


@dataclasses.dataclass(frozen=True)
class _Schema:
    """A class's fields as the walk uses them (plain tuples: this is the hot path)."""

    #: (name, encode, omit while None, a scalar type taken as it is)
    encoders: tuple[tuple[str, Convert, bool, type | None], ...]
    #: (name, decode, default maker (None: required), a scalar type taken as it is)
    decoders: tuple[tuple[str, Convert, Callable[[], Any] | None, type | None], ...]
    allowed: frozenset[str]  # the field names (and "type" for a message)
    wire_name: str  # "" for a record
    plain_init: bool  # no __post_init__: fill the instance's __dict__ directly


_SCHEMAS: dict[type, _Schema] = {}


def _schema(cls: type) -> _Schema:
    schema = _SCHEMAS.get(cls)
    if schema is not None:
        return schema
    hints = typing.get_type_hints(cls)
    encoders, decoders = [], []
    for f in dataclasses.fields(cls):
        enc, dec = _converters(hints[f.name])
        if f.default is not dataclasses.MISSING:
            default: Callable[[], Any] | None = lambda value=f.default: value  # noqa: E731
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory
        else:
            default = None
        exact = _exact_scalar(hints[f.name])
        encoders.append((f.name, enc, f.default is None, exact))
        decoders.append((f.name, dec, default, exact))
    wire_name = cls.wire_name if issubclass(cls, Message) else ""
    names = frozenset(f.name for f in dataclasses.fields(cls))
    schema = _SCHEMAS[cls] = _Schema(
        tuple(encoders), tuple(decoders), names | {"type"} if wire_name else names, wire_name,
        not hasattr(cls, "__post_init__"),
    )  # fmt: skip
    return schema


def _encode_record(obj: Any, cls: type) -> dict[str, Any]:
    if type(obj) is not cls:
        raise _Invalid(f"expected {cls.__name__}, got {_name(obj)}")
    schema = _SCHEMAS.get(cls) or _schema(cls)
    out: dict[str, Any] = {"type": schema.wire_name} if schema.wire_name else {}
    values = obj.__dict__
    for name, enc, omit_none, exact in schema.encoders:
        value = values[name]
        if type(value) is exact:  # the common case, without a call
            out[name] = value
            continue
        if value is None and omit_none:
            continue
        try:
            out[name] = enc(value)
        except _Invalid as exc:
            raise exc.at(f".{name}") from None
    if cls.kinds:
        _check_kind(cls, out)
    return out


def _decode_record(cls: type[R], data: Any) -> R:
    if not isinstance(data, dict):
        raise _Invalid(f"expected a map, got {_name(data)}")
    schema = _SCHEMAS.get(cls) or _schema(cls)
    if schema.wire_name and data.get("type") != schema.wire_name:  # a nested message
        raise _Invalid(f"expected a {schema.wire_name!r} message").at(".type")
    unknown = data.keys() - schema.allowed
    if unknown:
        raise _Invalid("unknown field").at(f".{min(map(str, unknown))}")
    values = {}
    for name, dec, default, exact in schema.decoders:
        value = data.get(name, _ABSENT)
        if type(value) is exact:
            values[name] = value
            continue
        if value is _ABSENT:
            if default is None:
                raise _Invalid("missing").at(f".{name}")
            values[name] = default()
            continue
        try:
            values[name] = dec(value)
        except _Invalid as exc:
            raise exc.at(f".{name}") from None
    if cls.kinds:
        _check_kind(cls, values)
    if not schema.plain_init:
        try:
            return cls(**values)
        except ValueError as exc:  # the record's own check (__post_init__)
            raise _Invalid(str(exc)) from None
    obj = object.__new__(cls)  # the frozen dataclass's __init__, without its setattr calls
    obj.__dict__.update(values)
    return obj


def _check_kind(cls: type, values: dict[str, Any]) -> None:
    if cls.kinds and values.get("kind") not in cls.kinds:
        raise _Invalid(f"{values.get('kind')!r} is not one of {cls.kinds}").at(".kind")


def _exact_scalar(tp: Any) -> type | None:
    """The scalar type a value of ``tp`` may have to be taken without a check (a plain
    ``int`` is in range: msgpack checks that); None when every value needs the walk."""
    options = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    if len(options) == 1 and options[0] in (int, float, str, bool, bytes):
        return options[0]
    return None


def _converters(tp: Any) -> tuple[Convert, Convert]:
    """(encode, decode) for values annotated ``tp``."""
    if tp is Any:
        return _same, _same
    if isinstance(tp, type) and issubclass(tp, Record):
        return (lambda v: _encode_record(v, tp)), (lambda v: _decode_record(tp, v))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _union(args)
    if origin is list:
        item_encode, item_decode = _converters(args[0])
        return _list_of(item_encode), _list_of(item_decode)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]
        item_encode, item_decode = _converters(args[0])
        return _tuple_any(item_encode), _tuple_any(item_decode)
    if origin is tuple:
        pairs = [_converters(a) for a in args]
        return _tuple_of([e for e, _ in pairs]), _tuple_of([d for _, d in pairs])
    if origin is dict and args[0] is str:
        value_encode, value_decode = _converters(args[1])
        return _dict_of(value_encode), _dict_of(value_decode)
    if tp in _SCALARS:
        return _SCALARS[tp], _SCALARS[tp]
    raise TypeError(f"no wire form for {tp!r}")


def _union(args: tuple[Any, ...]) -> tuple[Convert, Convert]:
    options = [a for a in args if a is not type(None)]
    nullable = len(options) < len(args)
    if len(options) > 1 and all(isinstance(a, type) and issubclass(a, Record) for a in options):
        by_kind = {kind: cls for cls in options for kind in cls.kinds}

        def encode_tagged(v: Any) -> Any:
            if type(v) not in options:
                raise _Invalid(f"expected one of {[c.__name__ for c in options]}, got {_name(v)}")
            return _encode_record(v, type(v))

        def decode_tagged(v: Any) -> Any:
            kind = v.get("kind") if isinstance(v, dict) else None
            if not isinstance(kind, str) or kind not in by_kind:
                raise _Invalid(f"{kind!r:.40} is not one of {sorted(by_kind)}").at(".kind")
            return _decode_record(by_kind[kind], v)

        pair = (encode_tagged, decode_tagged)
    else:
        pairs = [_converters(a) for a in options]
        label = " | ".join(getattr(a, "__name__", str(a)) for a in options)
        pair = (_first_of([e for e, _ in pairs], label), _first_of([d for _, d in pairs], label))
    return (_or_none(pair[0]), _or_none(pair[1])) if nullable else pair


def _or_none(conv: Convert) -> Convert:
    return lambda v: None if v is None else conv(v)


def _first_of(convs: list[Convert], label: str) -> Convert:
    if len(convs) == 1:
        return convs[0]

    def conv(v: Any) -> Any:
        for c in convs:
            try:
                return c(v)
            except _Invalid:
                continue
        raise _Invalid(f"expected {label}, got {_name(v)}")

    return conv


def _list_of(item: Convert) -> Convert:
    def conv(v: Any) -> list[Any]:
        if not isinstance(v, (list, tuple)):
            raise _Invalid(f"expected a list, got {_name(v)}")
        if item is _int and v and set(map(type, v)) == _INTS_ONLY:  # token ids: hot path
            return list(v)  # (msgpack refuses an int beyond 64 bits: protocol.encode)
        out = []
        for i, x in enumerate(v):
            try:
                out.append(item(x))
            except _Invalid as exc:
                raise exc.at(f"[{i}]") from None
        return out

    return conv


def _tuple_any(item: Convert) -> Convert:
    as_list = _list_of(item)
    return lambda v: tuple(as_list(v))


def _tuple_of(items: list[Convert]) -> Convert:
    def conv(v: Any) -> tuple[Any, ...]:
        if not isinstance(v, (list, tuple)) or len(v) != len(items):
            raise _Invalid(f"expected an array of {len(items)}, got {_name(v)}")
        out = []
        for i, (c, x) in enumerate(zip(items, v, strict=True)):
            try:
                out.append(c(x))
            except _Invalid as exc:
                raise exc.at(f"[{i}]") from None
        return tuple(out)

    return conv


def _dict_of(value: Convert) -> Convert:
    def conv(v: Any) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise _Invalid(f"expected a map, got {_name(v)}")
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise _Invalid(f"expected string keys, got {_name(k)}")
            try:
                out[k] = value(x)
            except _Invalid as exc:
                raise exc.at(f"[{k!r:.40}]") from None
        return out

    return conv


def _same(v: Any) -> Any:
    return v


def _int(v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        if _INT_MIN <= v <= _INT_MAX:
            return v
        raise _Invalid("an int beyond 64 bits")
    raise _Invalid(f"expected int, got {_name(v)}")


def _float(v: Any) -> float:
    if isinstance(v, float):
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return float(_int(v))
    raise _Invalid(f"expected float, got {_name(v)}")


def _scalar(kind: type) -> Convert:
    def conv(v: Any) -> Any:
        if isinstance(v, kind):
            return v
        raise _Invalid(f"expected {kind.__name__}, got {_name(v)}")

    return conv


def _bytes(v: Any) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, (bytearray, memoryview)):
        return bytes(v)
    raise _Invalid(f"expected bytes, got {_name(v)}")


def _none(v: Any) -> None:
    if v is not None:
        raise _Invalid(f"expected None, got {_name(v)}")


def _name(v: Any) -> str:
    return "None" if v is None else type(v).__name__


_SCALARS: dict[Any, Convert] = {
    int: _int, float: _float, str: _scalar(str), bool: _scalar(bool), bytes: _bytes,
    type(None): _none,
}  # fmt: skip
