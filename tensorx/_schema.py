"""Declarative schemas for what peers send: wire frame headers (:mod:`tensorx._wire`),
region descriptors (:mod:`tensorx.memregion`) and parameter-server messages
(:mod:`tensorx._ps.wire.protocol`). Pure: no I/O, nothing else of tensorx but its errors.

Two forms. A :class:`Packed` record is a fixed binary layout: the headers on every op's
path, a few u64 fields and flags decoded by one ``struct`` call, the layout their bound.
Everything else is a msgpack map (or a list, :meth:`Record.check_row`) checked against a
:class:`Record`, which names its fields and what each must be: a type, a bound (an int's
exclusive upper limit, a string's, bytes', list's or map's length), optionally the values
allowed, the record a map must be or what every list item must be. :meth:`Record.check`
raises :class:`~tensorx.errors.ProtocolError` naming the record and the field, with the
peer's value escaped; nothing is acted on before its record passed. Fields not declared
are let through (a newer peer's additions) unless the record is ``strict``.

Types are exact as msgpack decodes them (a bool is no int here); on the sending side a
subclass of the type passes too, so our own values need no conversion.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tensorx._text import printable
from tensorx.errors import ProtocolError

__all__ = ["Field", "Packed", "Record", "blob", "choice", "flag", "real", "seq", "table",
           "text", "uint"]

U64 = 1 << 64


class Field:
    """What one value must be (build them with the helpers below)."""

    __slots__ = ("item", "limit", "optional", "record", "typ", "values")

    def __init__(self, typ: type, limit: int | None = None, *, optional: bool = False,
                 values: Iterable[Any] | None = None, record: Record | None = None,
                 item: Field | None = None) -> None:
        self.typ = typ
        self.limit = limit
        self.optional = optional  # None (or absent) is accepted too
        self.values = frozenset(values) if values is not None else None
        self.record = record  # a map that must be this record
        self.item = item  # what every list item must be

    def __or__(self, other: None) -> Field:
        """``uint() | None``: the field may also be None or absent."""
        assert other is None
        return Field(self.typ, self.limit, optional=True, values=self.values,
                     record=self.record, item=self.item)

    def problem(self, value: Any) -> str | None:
        """Why ``value`` does not fit, or None."""
        typ = self.typ
        if type(value) is not typ and not (isinstance(value, typ) and type(value) is not bool):
            return None if value is None and self.optional else f"missing or not {typ.__name__}"
        if self.limit is not None:
            why = _out_of_bounds(value, self.limit)
            if why is not None:
                return why
        if self.values is not None and value not in self.values:
            return f"is {printable(value)}, not one of {sorted(self.values)}"
        return self._nested(value) if self.record or self.item else None

    def _nested(self, value: Any) -> str | None:
        if self.record is not None:
            return self.record.problem(value)
        assert self.item is not None
        for i, v in enumerate(value):
            why = self.item.problem(v)
            if why is not None:
                return f"item {i}: {why}"
        return None


def _out_of_bounds(value: Any, limit: int) -> str | None:
    if isinstance(value, int):
        return None if 0 <= value < limit else "out of range"
    return None if len(value) <= limit else f"longer than {limit}"  # str, bytes, list, map


class _Slow:
    """No value is of this type: a field whose check takes more than its type and bound."""


def _fast(spec: Field) -> tuple[type, int | None]:
    """(type, int bound) that alone decide ``spec`` for a value of exactly that type."""
    nested = spec.values is not None or spec.record is not None or spec.item is not None
    if nested or (spec.limit is not None and spec.typ is not int):
        return _Slow, None
    return spec.typ, spec.limit


def uint(bits: int = 64) -> Field:
    """A non-negative int below ``2**bits``."""
    return Field(int, 1 << bits)


def text(limit: int) -> Field:
    return Field(str, limit)


def blob(limit: int) -> Field:
    return Field(bytes, limit)


def flag() -> Field:
    return Field(bool)


def real() -> Field:
    return Field(float)


def choice(*values: str) -> Field:
    """One of these strings."""
    return Field(str, values=values)


def table(limit: int, record: Record | None = None) -> Field:
    """A map of at most ``limit`` entries (that is ``record`` if given)."""
    return Field(dict, limit, record=record)


def seq(limit: int, item: Field | None = None) -> Field:
    """A list of at most ``limit`` items (each an ``item`` if given)."""
    return Field(list, limit, item=item)


class Record:
    """A map (or a fixed-length list, see :meth:`check_row`) with named fields."""

    def __init__(self, what: str, fields: Mapping[str, Field], *,
                 strict: bool = False) -> None:
        self.what = what
        self.fields = dict(fields)
        self.strict = strict  # no fields but these
        self._plan = tuple((name, *_fast(spec), spec) for name, spec in self.fields.items())

    def check(self, msg: Any) -> dict[str, Any]:
        """``msg`` itself, if it is a map that fits; else ProtocolError."""
        why = self.problem(msg)
        if why is not None:
            raise ProtocolError(f"{self.what}: {why}")
        return msg  # type: ignore[no-any-return]

    def problem(self, msg: Any) -> str | None:
        if type(msg) is not dict and not isinstance(msg, dict):
            return "not a map"
        get = msg.get
        for name, typ, bound, spec in self._plan:
            value = get(name)
            # the common case, decided without a call (a frame header's ints); a bound is
            # only given for ints (mypy sees the value narrowed to `object` here)
            if type(value) is typ and (bound is None or 0 <= value < bound):  # type: ignore[operator]
                continue
            why = spec.problem(value)
            if why is not None:
                return f"field {name!r} {why}"
        if self.strict and not msg.keys() <= self.fields.keys():
            extra = sorted(printable(k) for k in msg.keys() - self.fields.keys())
            return f"unexpected field(s) {', '.join(extra)}"
        return None

    def check_row(self, row: Any) -> Sequence[Any]:
        """A list of exactly these fields' values, in order (a compact wire form)."""
        if type(row) is not list or len(row) != len(self._plan):
            raise ProtocolError(f"{self.what}: not a list of {len(self._plan)} fields")
        for (name, typ, bound, spec), value in zip(self._plan, row, strict=True):
            if type(value) is typ and (bound is None or 0 <= value < bound):  # type: ignore[operator]
                continue
            why = spec.problem(value)
            if why is not None:
                raise ProtocolError(f"{self.what}: field {name!r} {why}")
        return row


class Packed:
    """A record in a fixed binary form: ``ints``, unsigned 64-bit big endian, then one byte
    whose low bits are the ``flags`` (booleans), then padding up to ``size`` bytes if given
    (sent as zeros, not read); if the flag named ``tail`` is set, the bytes after the fixed
    part are that field's value, else there must be none.

    The layout is the bound of every int; :meth:`row` and :meth:`unpack` refuse
    (ProtocolError) a header of the wrong length or with a flag bit the layout does not
    know: there is nothing else to check."""

    __slots__ = ("_known", "_tail_bit", "flags", "ints", "names", "size", "struct", "tail",
                 "what")

    def __init__(self, what: str, ints: Sequence[str], flags: Sequence[str] = (),
                 tail: str | None = None, size: int | None = None) -> None:
        assert tail is None or tail in flags
        assert len(flags) <= 8
        self.what = what
        self.ints = tuple(ints)
        self.flags = tuple(flags)
        self.tail = tail
        self.names = self.ints + self.flags  # of the values of a row
        self._tail_bit = self.flags.index(tail) if tail is not None else -1
        fmt = "!" + "Q" * len(ints) + ("B" if flags else "")
        pad = 0 if size is None else size - struct.calcsize(fmt)
        assert pad >= 0, f"{what}: {size} B is less than its fields"
        self.struct = struct.Struct(fmt + (f"{pad}x" if pad else ""))  # padding: zeros
        self.size = self.struct.size
        self._known = (1 << len(flags)) - 1

    def pack(self, fields: Mapping[str, Any]) -> bytes:
        """The bytes of ``fields`` (ProtocolError naming the field that does not fit): for
        tests and tools; the hot paths pack their frames with one ``struct`` of their own."""
        for name in self.ints:
            self._check(name, _U64, fields.get(name))
        bits = 0
        for i, name in enumerate(self.flags):
            value = fields.get(name)
            self._check(name, _TAIL if name == self.tail else _FLAG, value)
            if value is not None and value is not False:  # a tail, or True
                bits |= 1 << i
        tail = fields.get(self.tail) if self.tail is not None else None
        values = [fields[name] for name in self.ints] + ([bits] if self.flags else [])
        return self.struct.pack(*values) + (tail or b"")

    def _check(self, name: str, spec: Field, value: Any) -> None:
        why = spec.problem(value)
        if why is not None:
            raise ProtocolError(f"{self.what}: field {name!r} {why}")

    def row(self, raw: bytes | bytearray | memoryview) -> tuple[Any, ...]:
        """The values of ``raw`` (exactly one header), in order: the ints, then each flag
        (the tail's flag: its bytes, or None). What the transport reads on every op."""
        size = len(raw)
        if size < self.size:
            raise ProtocolError(f"{self.what}: {size} B, not {self.size}")
        values: tuple[Any, ...] = self.struct.unpack_from(raw)
        if not self.flags:
            if size != self.size:
                raise ProtocolError(f"{self.what}: {size} B, not {self.size}")
            return values
        bits = values[-1]
        if bits & ~self._known:
            raise ProtocolError(f"{self.what}: unknown flags {bits:#04x}")
        flags: list[Any] = [bool(bits & 1 << i) for i in range(len(self.flags))]
        if self.tail is not None and flags[self._tail_bit]:
            flags[self._tail_bit] = bytes(raw[self.size:])
        elif size != self.size:
            raise ProtocolError(f"{self.what}: {size} B, not {self.size}")
        elif self.tail is not None:
            flags[self._tail_bit] = None
        return (*values[:-1], *flags)

    def unpack(self, raw: bytes | bytearray | memoryview) -> dict[str, Any]:
        """:meth:`row` as a map (a tail that is absent is left out)."""
        fields = dict(zip(self.names, self.row(raw), strict=True))
        if self.tail is not None and fields[self.tail] is None:
            del fields[self.tail]
        return fields


_U64, _FLAG, _TAIL = uint(64), flag(), Field(bytes, optional=True)
