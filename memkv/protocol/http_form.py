"""The protocol's answers in the HTTP API's form: the same structs, keys as hex.

A session view, an append's answer and a resume's answer are declared once, in
:mod:`memkv.protocol.services`. The gateway serves those structs as JSON, the
block port as msgpack maps, the client decodes both back into the same structs,
and the OpenAPI document describes them from the same declaration. The only
difference from msgspec's own JSON is the HTTP API's spelling of a block key:
lowercase hex (as in every path, body and log line), not base64.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import msgspec
from msgspec import inspect

__all__ = ["from_builtins", "json_bytes", "schema_components", "to_builtins"]

T = TypeVar("T", bound=msgspec.Struct)

_json = msgspec.json.Encoder()
#: How a key is described in the OpenAPI document (msgspec would say base64).
HEX_KEY_SCHEMA = {"type": "string", "pattern": "^([0-9a-f]{2})*$",
                  "description": "a block key, lowercase hex"}


def to_builtins(message: msgspec.Struct, **given: object) -> dict[str, Any]:
    """``message`` as JSON values, every ``bytes`` value as hex, with ``given`` in place
    of the message's own fields (the gateway answers a tenant's own session id, not the
    router's scoped one)."""
    fields = msgspec.to_builtins(message, builtin_types=(bytes,))
    return {**_hex(fields), **given}


def json_bytes(message: msgspec.Struct, **given: object) -> bytes:
    """:func:`to_builtins`, encoded."""
    return _json.encode(to_builtins(message, **given))


def from_builtins(data: object, kind: type[T]) -> T:
    """A ``kind`` from its HTTP form (decoded JSON or msgpack), keys from hex.

    Raises:
        msgspec.ValidationError: ``data`` is not a ``kind``; the message names the field.
    """
    return msgspec.convert(_unhex(data, _type_info(kind), "$"), kind)


def schema_components(kinds: tuple[type[msgspec.Struct], ...],
                      ref_template: str = "#/components/schemas/{name}"
                      ) -> dict[str, Any]:
    """OpenAPI component schemas of ``kinds`` (and every struct they hold), by name,
    with keys described as hex."""
    _, components = msgspec.json.schema_components(kinds, ref_template=ref_template)
    return {name: _hex_schema(schema) for name, schema in components.items()}


def _hex(value: object) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: _hex(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):  # to_builtins keeps a struct's tuples
        return [_hex(v) for v in value]
    return value


@functools.cache
def _type_info(kind: type) -> inspect.Type:
    return inspect.type_info(kind)


def _unhex(value: object, info: inspect.Type, where: str) -> object:
    """``value`` with each hex string that ``info`` declares bytes made bytes again."""
    if isinstance(info, inspect.BytesType):
        if not isinstance(value, str):
            return value  # msgspec.convert names the type error
        try:
            return bytes.fromhex(value)
        except ValueError:
            raise msgspec.ValidationError(
                f"Expected a hex block key, got {value!r:.40} - at `{where}`"
            ) from None
    if isinstance(info, inspect.StructType) and isinstance(value, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        return {k: _unhex(v, fields[k], f"{where}.{k}") if k in fields else v
                for k, v in value.items()}
    if isinstance(info, (inspect.ListType, inspect.VarTupleType)) and isinstance(value, list):
        return [_unhex(v, info.item_type, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(info, inspect.UnionType):
        for member in info.types:
            if not isinstance(member, inspect.NoneType):
                return _unhex(value, member, where)  # the protocol's unions are X | None
    return value


def _hex_schema(schema: Any) -> Any:
    if isinstance(schema, dict):
        if schema.get("type") == "string" and schema.get("contentEncoding") == "base64":
            return dict(HEX_KEY_SCHEMA)
        return {k: _hex_schema(v) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_hex_schema(v) for v in schema]
    return schema
