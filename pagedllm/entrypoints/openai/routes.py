"""HTTP routes. Handlers only resolve the model and hand over to the serving modules.

`inference_router`: the OpenAI API, model management and tokenization (behind the API key).
`ops_router`: /health and /metrics (always open, for probes and scrapers).
"""
from __future__ import annotations

import time

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel
from starlette.responses import PlainTextResponse, Response

from pagedllm.entrypoints.openai.health import server_health
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.models import ModelRegistry
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    HealthResponse,
    LiveRequest,
    LiveRequestList,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    ModelStatus,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    UnloadLoRAAdapterRequest,
)
from pagedllm.entrypoints.openai.serving_chat import create_chat_completion
from pagedllm.entrypoints.openai.serving_completions import create_completion
from pagedllm.entrypoints.openai.serving_embedding import create_embedding
from pagedllm.entrypoints.openai.serving_tokenization import detokenize, tokenize, tokenizer_info
from pagedllm.http_errors import error_responses

inference_router = APIRouter(responses=error_responses(400, 404, 503))
# vLLM's adapter routes answer a text line; their errors stay JSON (the route's default class), so
# the schema documents both media types
PLAIN_TEXT_OK: dict = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}
ops_router = APIRouter()

# Before Open API 3.2, an event stream's `schema` describes one event (as Schemathesis reads it).
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON chunk (`*.chunk` objects, OpenAI's streaming format), an "
                                              "`{\"error\": ...}` object if the request fails mid-stream, or `[DONE]`"},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
GENERATION_DOC = {
    200: {"description": "JSON, or `text/event-stream` chunks when stream=true",
          "content": {"text/event-stream": {"schema": SSE_EVENT}}},
    **error_responses(504),
}


def models(request: Request) -> ModelRegistry:
    return request.app.state.models


def json_response(body: BaseModel | Response, status_code: int = 200) -> Response:
    if isinstance(body, Response):
        return body
    return Response(body.model_dump_json(), status_code=status_code, media_type="application/json")


# ---- OpenAI API ------------------------------------------------------------------------------
@inference_router.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_DOC)
async def completions(body: CompletionRequest, request: Request) -> Response:
    return json_response(await create_completion(body, models(request).get(body.model), request))


@inference_router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_DOC)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return json_response(await create_chat_completion(body, models(request).get(body.model), request))


@inference_router.post("/v1/embeddings", response_model=EmbeddingResponse)
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    """Each input's pooled hidden state (last token, after the final norm, L2-normalized)."""
    return json_response(await create_embedding(body, models(request).get(body.model)))


@inference_router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> Response:
    """The loaded models, then the LoRA adapters served over them (each with its `parent`)."""
    registry = models(request)
    return json_response(ModelList(data=[served.card() for served in registry.ready() + registry.adapters()]))


@inference_router.post("/v1/load_lora_adapter", responses=PLAIN_TEXT_OK)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
    """vLLM's route: serve the PEFT adapter at `lora_path` as model `lora_name` (engine started
    with --enable-lora); a bad adapter is a 400 saying why, and the server keeps serving."""
    await models(request).load_lora_adapter(body.lora_name, body.lora_path, body.model)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@inference_router.post("/v1/unload_lora_adapter", responses=PLAIN_TEXT_OK)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
    """vLLM's route: stop serving adapter `lora_name` (requests already running with it finish)."""
    await models(request).unload_lora_adapter(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@inference_router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def retrieve_model(model_id: str, request: Request) -> Response:
    return json_response(models(request).card(model_id))


@inference_router.post("/v1/models/{model_id:path}/load", response_model=ModelStatus, responses={
    202: {"model": ModelStatus, "description": "loading has started (without ?wait=true)"}, **error_responses(409)})
async def load_model(
    model_id: str, request: Request,
    wait: bool = Query(False, description="answer only once the model is ready (or failed)"),
) -> Response:
    status = await models(request).load(model_id, wait=wait)
    return json_response(ModelStatus(status=status), 200 if status == "ready" else 202)


@inference_router.delete("/v1/models/{model_id:path}", response_model=ModelStatus)
async def unload_model(model_id: str, request: Request) -> Response:
    await models(request).unload(model_id)
    return json_response(ModelStatus(status="unloaded"))


@inference_router.get("/v1/requests", response_model=LiveRequestList)
async def live_requests(request: Request) -> Response:
    """Every unfinished request of every loaded model with its state (behind the API key: ids and
    timings of other clients' requests are the operator's to see)."""
    now = time.time()
    rows = []
    for served in models(request).ready():
        for row in await served.engine.request_states():
            scheduled = row["first_scheduled_time"]
            rows.append(LiveRequest(model=served.name, queue_time_s=(scheduled or now) - row["arrival_time"], **row))
    return json_response(LiveRequestList(data=sorted(rows, key=lambda r: r.arrival_time)))


# ---- tokenization --------------------------------------------------------------------------
@inference_router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize_route(body: TokenizeRequest, request: Request) -> Response:
    return json_response(await tokenize(body, models(request).get(body.model)))


@inference_router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize_route(body: DetokenizeRequest, request: Request) -> Response:
    return json_response(await detokenize(body, models(request).get(body.model)))


@inference_router.get("/tokenizer_info", response_model=TokenizerInfo)
async def tokenizer_info_route(request: Request, model: str | None = None) -> Response:
    return json_response(tokenizer_info(models(request).get(model)))


# ---- operations ----------------------------------------------------------------------------
@ops_router.get("/health", response_model=HealthResponse, responses={503: {"description": "an engine loop died"}})
async def health(request: Request) -> Response:
    report = server_health(models(request).ready(), request.app.state.settings)
    return json_response(report, 503 if report.status == "unhealthy" else 200)


@ops_router.get("/version")
async def version() -> dict[str, str]:
    """vLLM's /version: the server's package version (open, as /health is)."""
    import importlib.metadata

    return {"version": importlib.metadata.version("pagedllm")}


@ops_router.get("/metrics", response_class=Response, responses={
    200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    server_metrics: ServerMetrics = request.app.state.metrics
    return Response(server_metrics.render(), media_type=CONTENT_TYPE_LATEST)
