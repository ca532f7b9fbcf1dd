"""POST /v1/embeddings: inputs → token ids → the engine's pooled hidden states (worker/pooler.py).

Each input's embedding is the last token's hidden state after the model's final norm,
L2-normalized (vLLM's default for a decoder model with no pooler config; docs/serving.md says
why). The inputs are tokenized here, on the model's tokenizer thread, as completions' prompts
are; the forward passes run on the engine thread between two steps (AsyncEngine.call), so
they neither wait for nor disturb the requests being generated.
"""
from __future__ import annotations

import base64
from typing import Any

import numpy as np

from pagedllm.entrypoints.openai.async_engine import AsyncEngine
from pagedllm.entrypoints.openai.models import ServedModel
from pagedllm.entrypoints.openai.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, UsageInfo
from pagedllm.entrypoints.openai.serving import api_error, encode, new_id, now
from pagedllm.entrypoints.openai import compat
from pagedllm.http_errors import BadRequestError
from pagedllm.outputs import EmbeddingRequestOutput

INPUT = "input"


async def input_token_ids(req: EmbeddingRequest, served: ServedModel) -> list[list[int]]:
    """The input field's four shapes as token-id lists (strings tokenized as completions' prompts)."""
    raw: Any = req.input
    if isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw)):
        raw = [raw]
    if not raw:
        raise BadRequestError("input must not be empty", INPUT)
    lists = []
    for item in raw:
        if isinstance(item, str):
            if served.tokenizer is None:
                raise BadRequestError(f"model {served.name!r} has no tokenizer; send the input as token ids", INPUT)
            if not item:
                raise BadRequestError("input must not contain an empty string", INPUT)
            lists.append(await encode(served, item, INPUT, req.add_special_tokens))
        else:
            lists.append(list(item))
    return lists


def embed_on_engine(token_lists: list[list[int]], dimensions: int | None):
    """What runs on the engine thread: `dimensions` checked against the hidden size, then the
    pooled embeddings (LLMEngine.embed validates the token ids and lengths)."""
    def run(engine) -> list[EmbeddingRequestOutput]:
        hidden = engine.model_config.hidden_size
        if dimensions is not None and dimensions != hidden:
            raise BadRequestError(f"dimensions={dimensions} is not supported: the model's embeddings have {hidden} "
                                  "dimensions and it was not trained to be truncated (no Matryoshka representation)",
                                  "dimensions")
        return engine.embed([{"prompt_token_ids": ids} for ids in token_lists])

    return run


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's `base64`: the float32 values' little-endian bytes, base64-encoded."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def create_embedding(req: EmbeddingRequest, served: ServedModel) -> EmbeddingResponse:
    compat.note_unknown(req.model_extra)
    if not isinstance(served.engine, AsyncEngine):
        raise BadRequestError(f"model {served.name!r} runs as data-parallel replicas, which do not compute embeddings; "
                              "serve it with --data-parallel-size 1 for /v1/embeddings", "model")
    token_lists = await input_token_ids(req, served)
    try:
        outputs = await served.engine.call(embed_on_engine(token_lists, req.dimensions))
    except Exception as exc:
        raise api_error(exc, INPUT) from exc
    data = [EmbeddingData(index=i, embedding=encoded(o.outputs.embedding, req.encoding_format)) for i, o in enumerate(outputs)]
    tokens = sum(len(ids) for ids in token_lists)
    return EmbeddingResponse(id=new_id("embd"), created=now(), model=served.name, data=data,
                             usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))
