"""Requests that do not decode: what is wrong with them, in words a client can act on.

grpc runs a method's request deserializer before any handler, and an exception there ends the call with UNKNOWN
("Unexpected <class 'google.protobuf.message.DecodeError'>") and an ERROR log line. The error interceptor
(specdec_rpc/interceptor.py) deserializes inside the handler instead and, for bytes that do not parse, ends the
call with INVALID_ARGUMENT and the message `describe` gives: the string field that is not valid UTF-8, or where
the wire bytes stop making sense.
"""
from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError

from specdec.common.errors import InvalidRequestError

_MAX_DEPTH = 32


class UndecodableRequest(InvalidRequestError):
    """The request's bytes are not a valid message of the method's request type (→ INVALID_ARGUMENT)."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data) or shift > 63:
            raise IndexError(pos)
        b = data[pos]
        value |= (b & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not b & 0x80:
            return value, pos


def _walk(descriptor, data: bytes, prefix: str, depth: int) -> str | None:
    """The first problem found in `data` as a `descriptor` message (None: none found)."""
    if depth > _MAX_DEPTH:
        return f"the message nests deeper than {_MAX_DEPTH} levels"
    pos = 0
    while pos < len(data):
        start = pos
        try:
            tag, pos = _varint(data, pos)
            number, wire = tag >> 3, tag & 7
            if number == 0:
                return f"field number 0 at byte {start} of {prefix.rstrip('.') or 'the message'}"
            if wire == 0:
                _, pos = _varint(data, pos)
                continue
            if wire in (1, 5):
                pos += 8 if wire == 1 else 4
                if pos > len(data):
                    raise IndexError(pos)
                continue
            if wire != 2:
                return f"unsupported wire type {wire} at byte {start} of {prefix.rstrip('.') or 'the message'}"
            size, pos = _varint(data, pos)
            payload = data[pos:pos + size]
            if len(payload) < size:
                raise IndexError(pos)
            pos += size
        except IndexError:
            return f"the bytes end inside a field (at byte {start} of {prefix.rstrip('.') or 'the message'})"
        field = descriptor.fields_by_number.get(number) if descriptor is not None else None
        if field is None:
            continue  # an unknown field: protobuf keeps it as it is
        name = prefix + field.name
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                payload.decode("utf-8")
            except UnicodeDecodeError:
                return f"field `{name}` is not valid UTF-8"
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            found = _walk(field.message_type, payload, name + ".", depth + 1)
            if found:
                return found
    return None


def describe(descriptor, data: bytes) -> str:
    """Why `data` is not a valid `descriptor` message, naming the field where it can."""
    found = None
    try:
        found = _walk(descriptor, bytes(data), "", 0)
    except Exception:  # noqa: BLE001 - the description is best effort; the generic one follows
        found = None
    what = descriptor.full_name if descriptor is not None else "the request type"
    return (f"the request is not a valid {what}: {found}" if found else
            f"the request is not a valid {what} (malformed protobuf wire bytes)")


def deserialize(deserializer, data: bytes):
    """`deserializer(data)`, or UndecodableRequest saying what is wrong with the bytes."""
    try:
        return deserializer(data)
    except (DecodeError, UnicodeDecodeError, ValueError, RuntimeError) as e:
        descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
        message = describe(descriptor, data) if descriptor is not None else f"the request does not decode ({e})"
        raise UndecodableRequest("request", message) from None
