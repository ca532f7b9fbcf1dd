"""Structured output over HTTP with the official openai client: response_format json_schema
(also through the client's pydantic `parse`), json_object, vLLM's guided_* and structured_outputs
fields in extra_body, and 400s for constraints that are wrong or given twice."""
from __future__ import annotations

import json
import re

import openai
import pydantic
import pytest
from server_process import MAIN, assert_error

MESSAGES = [{"role": "user", "content": "Describe a person."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False,
}


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)


def chat(client, max_tokens: int = 80, **kwargs):
    return client.chat.completions.create(model=MAIN, messages=MESSAGES, max_tokens=max_tokens, **kwargs).choices[0]


@pytest.mark.parametrize("seed", range(3))
def test_json_schema_response_format(client, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    choice = chat(client, response_format=fmt, temperature=1.0, seed=seed)
    assert choice.finish_reason == "stop", choice.message.content
    person = json.loads(choice.message.content)
    assert set(person) == {"name", "age"} and len(person["name"]) <= 10 and 0 <= person["age"] <= 120


def test_pydantic_parse(client):
    """The openai client's own structured-output helper turns a pydantic model into a strict schema."""
    completion = client.chat.completions.parse(model=MAIN, messages=MESSAGES, max_tokens=80, temperature=0.8, seed=1, response_format=Person)
    message = completion.choices[0].message
    assert isinstance(message.parsed, Person), message.content


def test_json_object_streams_a_json_prefix(client):
    chunks = list(client.chat.completions.create(model=MAIN, messages=MESSAGES, max_tokens=40, temperature=0.7, seed=2,
                                                 response_format={"type": "json_object"}, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("{")
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_guided_fields_in_completions(client):
    kwargs = dict(model=MAIN, prompt="The answer is", max_tokens=30, temperature=1.0, seed=3)
    text = client.completions.create(**kwargs, extra_body={"guided_regex": r"[0-9]{2}-[a-z]{3}"}).choices[0].text
    assert re.fullmatch(r"[0-9]{2}-[a-z]{3}", text), text
    colours = ["red", "green", "blue"]
    out = client.completions.create(**kwargs, n=4, extra_body={"guided_choice": colours})
    assert {c.text for c in out.choices} <= set(colours)
    text = client.completions.create(**kwargs, extra_body={"structured_outputs": {"json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}).choices[0].text
    assert all(isinstance(v, bool) for v in json.loads(text)) or not text.endswith("]"), text
    text = chat(client, temperature=1.0, seed=4, extra_body={"guided_json": PERSON}).message.content
    assert set(json.loads(text)) == {"name", "age"}


@pytest.mark.parametrize("patch, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_json": {}}, None),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
])
def test_bad_constraints_are_400(http, client, patch, param):
    body = {"model": MAIN, "messages": MESSAGES, "max_tokens": 5, **patch}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)
    assert chat(client, max_tokens=2).message.content is not None  # the engine still serves


def test_bad_constraint_in_a_stream_is_400_before_streaming(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MAIN, prompt="x", max_tokens=4, stream=True, extra_body={"guided_regex": "(unclosed"})
    assert info.value.body["param"] == "guided_regex"
