"""The mock answers JSON mode and JSON schemas with JSON that fits them.

Through the mock as a real process, with the official openai and ollama
clients; the generator's edges as a pure function, checked with jsonschema.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import ollama
import openai
import pytest
from pydantic import BaseModel, Field

from nexus_mock import MockBackendProcess, spawn_mock_backend
from nexus_mock.structured import generate_json

pytestmark = pytest.mark.mode_independent


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Address(BaseModel):
    street: str
    postcode: str = Field(min_length=5, max_length=5)


class Person(BaseModel):
    name: str
    age: int = Field(ge=18, le=99)
    score: float = Field(gt=0, lt=1)
    member: bool
    color: Color
    kind: Literal["a", "b"]
    tags: list[str] = Field(min_length=2)
    home: Address
    work: Address | None = None


@pytest.fixture(scope="module")
def process() -> Iterator[MockBackendProcess]:
    process = spawn_mock_backend(
        "--kind", "ollama", "--name", "olla", "--models", "llama3:8b"
    )  # fmt: skip
    yield process
    process.stop()


@pytest.fixture
def client(process: MockBackendProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="x", timeout=10)


def parse_chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    # chat.completions.parse from openai 1.92 on, beta.chat before.
    completions = client.chat.completions
    parse = getattr(completions, "parse", None) or client.beta.chat.completions.parse
    return parse(**kwargs)


def test_parse_gets_an_object_that_fits_the_model(client: openai.OpenAI) -> None:
    completion = parse_chat(
        client,
        model="llama3:8b",
        messages=[{"role": "user", "content": "Describe Ada"}],
        response_format=Person,
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person)
    assert (person.name, person.age, person.color) == ("Describe Ada", 18, Color.RED)
    assert len(person.tags) >= 2 and len(person.home.postcode) == 5


def test_json_mode_answers_an_object_naming_who_answered(
    client: openai.OpenAI,
) -> None:
    for stream in (False, True):
        reply = client.chat.completions.create(
            model="llama3:8b",
            messages=[{"role": "user", "content": "hi there"}],
            response_format={"type": "json_object"},
            stream=stream,
        )
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in reply)
        else:
            text = reply.choices[0].message.content
        assert json.loads(text) == {"answer": "[olla/llama3:8b] echo: hi there"}


def test_a_bad_response_format_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="llama3:8b",
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "yaml"},  # type: ignore[typeddict-item]
        )
    assert raised.value.body["param"] == "response_format.type"  # type: ignore[index]


def test_ollama_format_json_and_schema(process: MockBackendProcess) -> None:
    client = ollama.Client(host=process.base_url, timeout=10)
    messages = [{"role": "user", "content": "Describe Ada"}]
    reply = client.chat(model="llama3:8b", messages=messages, format="json")
    assert json.loads(reply.message.content or "") == {
        "answer": "[olla/llama3:8b] echo: Describe Ada"
    }
    schema = Person.model_json_schema()
    streamed = client.chat(
        model="llama3:8b", messages=messages, format=schema, stream=True
    )
    text = "".join(part.message.content or "" for part in streamed)
    assert Person.model_validate_json(text).name == "Describe Ada"
    generated = client.generate(model="llama3:8b", prompt="Ada", format=schema)
    Person.model_validate_json(generated.response)


def test_ollama_refuses_a_format_that_is_neither(process: MockBackendProcess) -> None:
    reply = httpx.post(
        f"{process.base_url}/api/chat",
        json={
            "model": "llama3:8b",
            "messages": [{"role": "user", "content": "hi"}],
            "format": "yaml",
        },
        timeout=10,
    )
    assert reply.status_code == 400
    assert "invalid format" in reply.json()["error"]


SCHEMAS: list[dict[str, Any]] = [
    {"type": "integer", "minimum": 10, "maximum": 20, "multipleOf": 3},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.5},
    {"type": "integer", "exclusiveMaximum": 0},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "email", "maxLength": 40},
    {"type": "string", "minLength": 50},
    {"type": ["null", "boolean"]},
    {"type": "array", "items": {"type": "string"}, "minItems": 3, "uniqueItems": True},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 0},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"const": "x"}]},
    {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
    {"allOf": [{"$ref": "#/definitions/a"}, {"required": ["b"]}], "definitions": {
        "a": {"type": "object", "properties": {"b": {"type": "boolean"}}}}},
    {"oneOf": [{"type": "integer", "minimum": 5}, {"type": "string"}]},
    {"enum": [3, "three"]},
    {},
]  # fmt: skip


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_generated_json_fits_its_schema(schema: dict[str, Any]) -> None:
    jsonschema.validate(generate_json(schema, "one two three four"), schema)


def test_a_recursive_schema_ends() -> None:
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    "parent": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
                },
                "required": ["name", "children", "parent"],
            }
        },
        "$ref": "#/$defs/node",
    }
    value = generate_json(tree, "x")
    jsonschema.validate(value, tree)
    assert len(json.dumps(value)) < 100_000


def test_a_schema_that_cannot_end_or_asks_too_much_is_bounded() -> None:
    generate_json({"allOf": [{"$ref": "#"}, {"$ref": "#"}]}, "x")  # returns
    huge = {"type": "array", "minItems": 10**9, "items": {"type": "string"}}
    assert len(generate_json(huge, "x")) == 256
