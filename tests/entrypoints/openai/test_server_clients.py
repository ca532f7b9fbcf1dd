"""Clients written for OpenAI's and vLLM's servers, unchanged, against the real server: guidellm's
benchmark (which asks every stream for vLLM's continuous_usage_stats: before, every one of its
streaming requests was a 400), LiteLLM, and LangChain's structured output."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest
from server_process import API_KEY, MAIN


def test_guidellm_streams_with_no_failed_request(server, serve_models, tmp_path):
    """guidellm's streaming chat requests carry vLLM's stream_options.continuous_usage_stats (every
    one of them failed with a 400 before it was accepted); 10 s at 6 requests/s. The field on
    /v1/completions: test_server_compat.py::test_continuous_usage_stats_in_every_chunk."""
    route, seconds = "/v1/chat/completions", 10
    report = tmp_path / "guidellm.json"
    guidellm = Path(sys.executable).with_name("guidellm")
    command = [
        str(guidellm), "run", "--disable-console-interactive",
        "--backend", f"kind=openai_http,target={server.url},model={MAIN},request_format={route},api_key={API_KEY}",
        "--profile", "kind=constant,rate=6", "--constraint", f"kind=max_duration,seconds={seconds}",
        "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=8",
        "--tokenizer", f"kind=huggingface_auto,model={serve_models / 'tiny-llama'}",
        "--output", f"kind=json,path={report}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert totals["errored"] == 0 and totals["successful"] >= 3 * seconds, totals  # half the rate at least


def test_litellm_completion_and_stream(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list
    import litellm

    kwargs = dict(model=f"openai/{MAIN}", api_base=server.base_url, api_key=API_KEY, max_tokens=8, temperature=0,
                  messages=[{"role": "user", "content": "Say something."}])
    reply = litellm.completion(**kwargs)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
    chunks = list(litellm.completion(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content


class Verdict(pydantic.BaseModel):
    correct: bool
    confidence: int = pydantic.Field(ge=0, le=9)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server, method):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MAIN, base_url=server.base_url, api_key=API_KEY, max_retries=0, temperature=0.7, seed=5,
                     max_tokens=120)  # the tiny model's tokenizer spells a call's tags out in many tokens
    # strict: the function's schema closes the object (additionalProperties false), as OpenAI's strict
    # mode requires; without it a random tiny model may fill the call with keys of its own
    structured = llm.with_structured_output(Verdict, method=method, strict=True)
    assert isinstance(structured.invoke("Is the sky green?"), Verdict)
