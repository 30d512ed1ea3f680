"""OpenAI's published OpenAPI document (tests/data/README.md says where it comes from) and a validator of JSON
values against its component schemas."""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC = Path(__file__).parent / "data" / "openai-openapi.json.gz"


@functools.cache
def document() -> dict[str, Any]:
    return _nullable_as_null(json.loads(gzip.decompress(SPEC.read_bytes())))


def _nullable_as_null(node: Any) -> Any:
    """The document says 3.1 but keeps 3.0's `nullable: true` in places, which JSON Schema ignores: turn each into
    the 3.1 form (null among the types), so a documented null validates and an undocumented one still fails."""
    if isinstance(node, list):
        return [_nullable_as_null(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable_as_null(v) for k, v in node.items()}
    if node.pop("nullable", False):
        if isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
            if "enum" in node:
                node["enum"] = [*node["enum"], None]
        else:
            node = {"anyOf": [node, {"type": "null"}]}
    return node


@functools.cache
def _validator(schema_name: str) -> jsonschema.Draft202012Validator:
    doc = document()
    assert schema_name in doc["components"]["schemas"], f"no schema {schema_name} in the document"
    registry = Registry().with_resource("openapi.json", Resource(contents=doc, specification=DRAFT202012))
    return jsonschema.Draft202012Validator({"$ref": f"openapi.json#/components/schemas/{schema_name}"},
                                           registry=registry)


def validate(instance: Any, schema_name: str) -> None:
    """Raise AssertionError naming the first violation's path and rule."""
    error = best_match(_validator(schema_name).iter_errors(instance))
    if error is not None:
        path = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise AssertionError(f"{schema_name} at {path}: {error.message} (rule {error.validator!r})")


def request_properties(schema_name: str) -> set[str]:
    """The top-level properties of a request schema, through its allOf parts."""
    schemas = document()["components"]["schemas"]

    def props(schema: dict[str, Any]) -> set[str]:
        if "$ref" in schema:
            return props(schemas[schema["$ref"].rsplit("/", 1)[1]])
        found = set(schema.get("properties", {}))
        for part in schema.get("allOf", []):
            found |= props(part)
        return found

    return props(schemas[schema_name])


@functools.cache
def _event_schemas() -> dict[str, str]:
    schemas = document()["components"]["schemas"]
    found = {}
    for ref in schemas["ResponseStreamEvent"]["anyOf"]:
        name = ref["$ref"].rsplit("/", 1)[1]
        kind = schemas[name].get("properties", {}).get("type", {})
        for value in kind.get("enum", []) + ([kind["const"]] if "const" in kind else []):
            found[value] = name
    return found


def validate_event(event: dict[str, Any]) -> None:
    """A Responses stream event against the schema of its own type (not merely any of the union)."""
    name = _event_schemas().get(event.get("type", ""))
    assert name is not None, f"no Responses event of type {event.get('type')!r}"
    validate(event, name)
