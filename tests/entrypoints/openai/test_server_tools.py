"""Tool calling over HTTP with the official openai client and LangChain's ChatOpenAI: forced calls
(required / named) always parse and follow the function's schema, streamed calls equal the
unstreamed ones, tools and earlier calls/results reach the chat template, errors are 400s."""
from __future__ import annotations

import json

import pytest
from server_process import API_KEY, MAIN, assert_error
from transformers import AutoTokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
                       "required": ["city", "unit"], "additionalProperties": False},
    },
}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {"tz": {"type": "integer", "minimum": -12, "maximum": 14}},
                                                                       "required": ["tz"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and len(args["city"]) <= 12 and args["unit"] in ("C", "F")
    else:
        assert name == "now" and set(args) == {"tz"} and -12 <= args["tz"] <= 14


@pytest.fixture(scope="module")
def tokenizer(serve_models):
    return AutoTokenizer.from_pretrained(serve_models / "tiny-llama")


@pytest.mark.parametrize("seed", range(3))
def test_required_call_parses_and_follows_the_schema(client, seed):
    out = client.chat.completions.create(model=MAIN, messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=seed)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert choice.message.content is None and call.type == "function" and call.id.startswith("call_")
    check_call(call.function.name, call.function.arguments)


def test_parallel_calls(client):
    """With parallel calls allowed a random model keeps calling: every call it closes parses; one
    cut by max_tokens stays text. (The seed is one whose draws make more than one call: since
    tokens are drawn by inverse transform, seeds 1, 2 and 11-14 stop after the first.)"""
    out = client.chat.completions.create(model=MAIN, messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice="required",
                                         max_tokens=150, temperature=1.0, seed=3)
    choice = out.choices[0]
    assert len(choice.message.tool_calls) >= 2
    for call in choice.message.tool_calls:
        check_call(call.function.name, call.function.arguments)
    assert (choice.finish_reason, choice.message.content is None) in (("tool_calls", True), ("length", False))
    assert len({call.id for call in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_named_choice_calls_that_function_once(client):
    out = client.chat.completions.create(model=MAIN, messages=MESSAGES, tools=[WEATHER, CLOCK], max_tokens=120, temperature=0.8, seed=7,
                                         tool_choice={"type": "function", "function": {"name": "now"}})
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "now"
    check_call(call.function.name, call.function.arguments)


def test_streamed_calls_equal_unstreamed(client):
    kwargs = dict(model=MAIN, messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=150, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == list(range(len(whole.message.tool_calls))) and deltas
    assert [(d.function.name, d.function.arguments) for d in deltas] == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (content.strip() or None) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_auto_and_none_show_the_tools_to_the_template(client, tokenizer):
    for choice in ("auto", "none"):
        out = client.chat.completions.create(model=MAIN, messages=MESSAGES, tools=[WEATHER], tool_choice=choice, max_tokens=8, temperature=0)
        rendered = tokenizer.apply_chat_template(MESSAGES, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
        assert "get_weather" in rendered
        assert out.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_results_go_back_through_the_template(client, tokenizer):
    first = client.chat.completions.create(model=MAIN, messages=MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    out = client.chat.completions.create(model=MAIN, messages=history, tools=[WEATHER], max_tokens=5, temperature=0)
    template_history = history[:1] + [{**history[1], "tool_calls": [{"id": call.id, "type": "function",
                                                                     "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]}] + history[2:]
    rendered = tokenizer.apply_chat_template(template_history, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in rendered and call.function.arguments.strip("{}") in rendered.replace('": "', '": "')
    assert out.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


@pytest.mark.parametrize("patch, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "missing"}}, "tools": [WEATHER]}, "tool_choice"),
    ({"tool_choice": "required"}, None),  # a rule across fields: no single param, as top_logprobs without logprobs
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": MESSAGES + [{"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
])
def test_bad_tool_requests_are_400(http, patch, param):
    body = {"model": MAIN, "messages": MESSAGES, "max_tokens": 5, **patch}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400)
    assert (error["param"] or "").split("[")[0].split(".")[0] == (param or ""), error


def test_langchain_bind_tools(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class get_weather(BaseModel):
        """Current weather in a city."""
        city: str = Field(max_length=12)
        unit: str = Field(pattern="^[CF]$")

    llm = ChatOpenAI(model=MAIN, base_url=server.base_url, api_key=API_KEY, max_retries=0, temperature=0.5, seed=3, max_tokens=120)
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    message = bound.invoke([HumanMessage("Weather in Oslo?")])
    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    get_weather(**call["args"])
    streamed = None
    for chunk in bound.stream([HumanMessage("Weather in Oslo?")]):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["name"] for c in streamed.tool_calls] == ["get_weather"]
    get_weather(**streamed.tool_calls[0]["args"])
    reply = bound.bind(tool_choice="none").invoke([HumanMessage("Weather in Oslo?"), message, ToolMessage("rain", tool_call_id=call["id"])])
    assert reply.tool_calls == [] and isinstance(reply.content, str)
