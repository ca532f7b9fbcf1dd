"""The default model served as users run it: `pagedllm serve` with no model serves
SmolLM2-135M-Instruct from its GGUF file, and the official openai client talks to it: a factual
question answered correctly, the same answer streamed, a json_schema response that parses, and
n-gram speculation and beam search on the GGUF model."""
from __future__ import annotations

import json

import openai
import pytest
from server_process import start_server
from tiny_models import stdlib_text

from pagedllm.paths import DEFAULT_MODEL_NAME

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2_client(tmp_path_factory):
    server = start_server(["--kv-cache-memory", str(160 << 20), "--max-model-len", "4096"],
                          tmp_path_factory.mktemp("gguf-logs") / "server.log")
    yield openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
    server.stop()
    assert "Traceback" not in server.log.read_text()


def test_answers_a_factual_question(smollm2_client):
    """The first request of the server, so that nothing of its prompt is cached: with int8
    activations (the default) a prompt prefilled in other pieces (a prefix-cache hit) is computed
    in another order, and this question's first token is a near-tie (docs/engine.md, "int8
    activations")."""
    reply = smollm2_client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION, max_tokens=32, temperature=0)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason == "stop", (choice.message.content, choice.finish_reason)


def test_a_document_longer_than_one_steps_budget_is_summarised(smollm2_client):
    """A prompt longer than the default step budget (2,048 tokens): its first chunk samples
    nothing, which once killed the engine. The answer comes, and the server goes on."""
    document = stdlib_text(9_000)
    messages = [{"role": "user", "content": f"Summarise this file in one sentence.\n\n{document}"}]
    reply = smollm2_client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
    assert reply.usage.prompt_tokens > 2048 and reply.choices[0].finish_reason in ("stop", "length")
    assert reply.choices[0].message.content.strip()
    after = smollm2_client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION, max_tokens=8, temperature=0)
    assert after.choices[0].message.content.strip()


def test_the_default_model_is_served(smollm2_client):
    assert [m.id for m in smollm2_client.models.list().data] == [DEFAULT_MODEL_NAME]


def test_streams_the_same_answer(smollm2_client):
    whole = smollm2_client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION, max_tokens=32, temperature=0)
    chunks = list(smollm2_client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION, max_tokens=32,
                                                         temperature=0, stream=True))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 3 and "".join(pieces) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_schema_response_parses(smollm2_client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Name the capital of France and its country as JSON."}]
    reply = smollm2_client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}})
    answer = json.loads(reply.choices[0].message.content)
    assert set(answer) == {"city", "country"} and "Paris" in answer["city"], answer


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_tool_call_round_trip_with_the_default_model(smollm2_client):
    """SmolLM2's template knows no tools: the fallback (tool_prompt.py) shows them, "required" guides
    the call, and the tool's result goes back through the template to an answer that uses it."""
    first = smollm2_client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=WEATHER_QUESTION, tools=[WEATHER],
                                                   tool_choice="required", parallel_tool_calls=False, max_tokens=48, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and "Paris" in json.loads(call.function.arguments)["city"], call
    history = WEATHER_QUESTION + [choice.message.model_dump(exclude_none=True),
                                  {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 23 degrees Celsius"}]
    reply = smollm2_client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=history, tools=[WEATHER],
                                                   tool_choice="none", max_tokens=40, temperature=0)
    answer = reply.choices[0].message
    assert not answer.tool_calls and "23" in answer.content, answer


def test_streamed_tool_call_deltas_with_the_default_model(smollm2_client):
    kwargs = dict(model=DEFAULT_MODEL_NAME, messages=WEATHER_QUESTION, tools=[WEATHER], tool_choice="required",
                  parallel_tool_calls=False, max_tokens=48, temperature=0)
    whole = smollm2_client.chat.completions.create(**kwargs).choices[0]
    chunks = list(smollm2_client.chat.completions.create(**kwargs, stream=True))
    deltas = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.type, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "function", c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert deltas[0].id.startswith("call_") and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


EMBED_TEXTS = ["The capital of France is Paris.", "def reverse(s):\n    return s[::-1]", "Bonjour"]


@pytest.fixture(scope="module")
def transformers_smollm2():
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.paths import default_model

    path = default_model()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_embeddings_equal_transformers_last_hidden_state(smollm2_client, transformers_smollm2):
    """/v1/embeddings through the openai client (which asks for base64 and decodes it): one
    576-float unit vector per input, equal to transformers' final-norm state at the last token
    (normalized) on the same GGUF; token-id input gives the same vector as its text; usage counts
    the input tokens."""
    import torch

    reply = smollm2_client.embeddings.create(model=DEFAULT_MODEL_NAME, input=EMBED_TEXTS)
    import httpx

    tokenize = str(smollm2_client.base_url).removesuffix("v1/") + "tokenize"
    tokens = [httpx.post(tokenize, json={"prompt": t}).json()["tokens"] for t in EMBED_TEXTS]
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.model == DEFAULT_MODEL_NAME
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, tokens))
    for data, ids in zip(reply.data, tokens):
        ours = torch.tensor(data.embedding)
        assert ours.shape == (576,) and torch.linalg.vector_norm(ours).item() == pytest.approx(1.0, abs=1e-5)
        with torch.no_grad():
            ref = transformers_smollm2.model(torch.tensor([ids])).last_hidden_state[0, -1]
        torch.testing.assert_close(ours, torch.nn.functional.normalize(ref, dim=-1), atol=1e-4, rtol=1e-3)
    by_ids = smollm2_client.embeddings.create(model=DEFAULT_MODEL_NAME, input=tokens[1], encoding_format="float")
    assert by_ids.data[0].embedding == pytest.approx(reply.data[1].embedding, abs=1e-6)


def test_embeddings_bad_input_is_a_400_naming_the_field(smollm2_client):
    cases = [({"input": "hi", "dimensions": 64}, "dimensions"), ({"input": []}, "input"),
             ({"input": [[1, 2], [10**7]]}, "input"), ({"input": "hi", "encoding_format": "int8"}, "encoding_format")]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            smollm2_client.post("/embeddings", body={"model": DEFAULT_MODEL_NAME, **body}, cast_to=dict)
        assert info.value.status_code == 400 and param in str(info.value.body), (body, info.value.body)
    ok = smollm2_client.embeddings.create(model=DEFAULT_MODEL_NAME, input="hi", dimensions=576, encoding_format="float")
    assert len(ok.data[0].embedding) == 576


def test_embeddings_mid_stream_leave_the_stream_unchanged(smollm2_client):
    """An embedding computed while a chat streams (between two of its steps): the stream's text
    is that of the same chat run alone."""
    whole = smollm2_client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION, max_tokens=24, temperature=0)
    stream = smollm2_client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION, max_tokens=24,
                                                    temperature=0, stream=True)
    pieces = [next(stream).choices[0].delta.content or ""]
    smollm2_client.embeddings.create(model=DEFAULT_MODEL_NAME, input=EMBED_TEXTS)
    pieces += [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == whole.choices[0].message.content
