"""Request and response bodies with OpenAI's field names (plus vLLM's sampling extensions).

A completion or chat request's unknown top-level fields are logged and ignored, as vLLM does
(clients written for other servers send their own extensions); inside it, and in every other
body, unknown fields are a 400 ("unrecognized request argument"). Ranges are checked once, by `SamplingParams`; the
models here fix the types, the few bounds the engine cannot know about, and how much one request
may carry (limits.py): list lengths, string sizes, valid Unicode — each a 400 naming the field.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from pagedllm.entrypoints.openai import compat
from pagedllm.entrypoints.openai.limits import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_PRIORITY,
    MAX_PROMPTS,
    MAX_STOP,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
    Choice,
    Grammar,
    JsonSchema,
    Name,
    StopString,
    Text,
)

# torch.Generator seeds are 64-bit; larger JSON integers are a client error, not a crash.
Seed = Field(default=None, ge=-(2**63), le=2**64 - 1)


class RequestModel(BaseModel):
    # NaN/Infinity (which Python's JSON parser accepts) would poison sampling: reject them here.
    # Strict types, as the OpenAPI document says: "1" is not an integer, "yes" or 1 not a boolean.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk, not only after the last
    include_obfuscation: Optional[bool] = None  # OpenAI's; streams here are not obfuscated (compat.py)


def _reject_set(values: dict[str, Any], allowed: dict[str, tuple[Any, ...]]) -> None:
    """OpenAI fields we accept in the schema but cannot honour: only their no-op values pass."""
    for name, harmless in allowed.items():
        value = values.get(name)
        if value is not None and value not in harmless:
            raise ValueError(f"{name} is not supported by this server")


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: Annotated[Union[str, dict[str, Any], None], JsonSchema] = Field(default=None, alias="json")  # `json` would shadow BaseModel.json
    regex: Optional[Grammar] = None
    choice: Optional[Annotated[list[Choice], Field(max_length=MAX_CHOICES)]] = None
    grammar: Optional[Grammar] = None
    json_object: Optional[bool] = None


class SamplingFields(RequestModel):
    """The sampling fields completions and chat share (OpenAI's, then vLLM's extensions)."""

    model_config = ConfigDict(extra="allow")  # unknown fields: logged and ignored (compat.note_unknown)

    model: Optional[Name] = Field(default=None, description="served model name; optional when one model is loaded")
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP)], None] = None
    seed: Optional[int] = Seed
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[Name] = None
    # token id (a string, as JSON keys are) -> bias in [-100, 100], added to the logits
    logit_bias: Optional[Annotated[dict[Annotated[str, Field(max_length=32)], float], Field(max_length=MAX_LOGIT_BIAS)]] = None
    # vLLM extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Optional[Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(max_length=MAX_STOP_TOKEN_IDS)]] = None
    allowed_token_ids: Optional[Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]],
                                          Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)]] = None
    # beam search (vLLM's fields): n (completions: best_of, when given) beams, the n best returned
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: Optional[StructuredOutputs] = None
    # vLLM's older spellings of the same constraints
    guided_json: Annotated[Union[str, dict[str, Any], None], JsonSchema] = None
    guided_regex: Optional[Grammar] = None
    guided_choice: Optional[Annotated[list[Choice], Field(max_length=MAX_CHOICES)]] = None
    guided_grammar: Optional[Grammar] = None
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1)  # keep the prompt's last k tokens (-1: max_model_len)
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:N"
    request_id: Optional[Name] = None  # the response's id is built from it
    # Accepted and ignored (OpenAI's and vLLM's fields that mean nothing here, compat.py) ...
    store: Optional[bool] = None
    metadata: Optional[Annotated[dict[Name, Text], Field(max_length=16)]] = None
    service_tier: Optional[Name] = None
    prompt_cache_key: Optional[Name] = None
    safety_identifier: Optional[Name] = None
    guided_decoding_backend: Optional[Name] = None
    guided_whitespace_pattern: Optional[Grammar] = None
    cache_salt: Optional[Name] = None
    kv_transfer_params: Optional[dict[Name, Any]] = None
    vllm_xargs: Optional[dict[Name, Any]] = None
    spaces_between_special_tokens: Optional[bool] = None
    # ... and refused when set, as ignoring them would give a wrong answer
    logits_processors: Optional[list[Any]] = None

    @model_validator(mode="after")
    def _unsupported(self) -> "SamplingFields":
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (max_model_len) or a positive integer")
        refused = compat.unsupported(self.__dict__)
        if refused is not None:
            raise ValueError(refused)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def final_usage(self) -> bool:
        return self.stream_options is not None and (self.stream_options.include_usage or self.continuous_usage)


# ---- completions -------------------------------------------------------------------------------
PromptInput = Union[Text, Annotated[list[Text], Field(max_length=MAX_PROMPTS)], list[int],
                    Annotated[list[list[int]], Field(max_length=MAX_PROMPTS)]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: Optional[int] = Field(default=16, ge=0)
    best_of: Optional[int] = None
    logprobs: Optional[int] = Field(default=None, ge=0)
    echo: bool = False
    suffix: Optional[str] = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _completion_rules(self) -> "CompletionRequest":
        _reject_set(self.__dict__, {"suffix": ("",)})
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 is only allowed with echo=true (to score the prompt)")
        return self


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


# ---- chat --------------------------------------------------------------------------------------
class TextContentPart(RequestModel):
    type: Literal["text"]
    text: Text


class FunctionCallParam(RequestModel):
    name: Name
    arguments: Text  # JSON text, as the API returned it


class ToolCallParam(RequestModel):
    id: Name
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, Annotated[list[TextContentPart], Field(max_length=MAX_CONTENT_PARTS)], None] = None
    name: Optional[Name] = None
    tool_calls: Optional[Annotated[list[ToolCallParam], Field(max_length=MAX_TOOLS)]] = None  # an assistant's earlier calls
    tool_call_id: Optional[Name] = None  # which call a tool message answers

    @model_validator(mode="after")
    def _roles(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool messages, and only they, carry tool_call_id")
        return self

    def text(self) -> Optional[str]:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[Text] = None
    parameters: Annotated[Optional[dict[str, Any]], JsonSchema] = None
    strict: Optional[bool] = None


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: Name


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(RequestModel):
    name: Name
    description: Optional[Text] = None
    schema_: Annotated[Optional[dict[str, Any]], JsonSchema] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(RequestModel):
    """OpenAI's: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM: the template leaves the last (assistant) message open
    add_special_tokens: bool = False  # vLLM: the template places BOS itself
    chat_template_kwargs: Optional[dict[Name, Any]] = None  # extra variables for the template
    chat_template: Optional[Grammar] = None  # a template is code: refused unless --trust-request-chat-template
    documents: Optional[Annotated[list[dict[Name, Text]], Field(max_length=MAX_MESSAGES)]] = None  # for RAG templates
    # OpenAI's deprecated function calling, converted to tools / tool_choice
    functions: Optional[Annotated[list[FunctionDefinition], Field(max_length=MAX_TOOLS)]] = None
    function_call: Union[Literal["none", "auto"], NamedFunction, None] = None
    # accepted and ignored (compat.py) ...
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None
    prediction: Optional[dict[Name, Any]] = None
    # ... and refused when they ask for what this server cannot do
    modalities: Optional[list[Literal["text", "audio"]]] = None
    audio: Optional[dict[Name, Any]] = None
    web_search_options: Optional[dict[Name, Any]] = None

    @model_validator(mode="before")
    @classmethod
    def _functions_as_tools(cls, data: Any) -> Any:
        """OpenAI's deprecated `functions` / `function_call` become `tools` / `tool_choice`."""
        if not isinstance(data, dict) or (data.get("functions") is None and data.get("function_call") is None):
            return data
        if data.get("tools") is not None or data.get("tool_choice") is not None:
            raise ValueError("give either functions / function_call or tools / tool_choice, not both")
        data = dict(data)
        if data.get("functions") is not None:
            data["tools"] = compat.tools_from_functions(data["functions"])
        if data.get("function_call") is not None:
            data["tool_choice"] = compat.tool_choice_from_function_call(data["function_call"])
        return data

    @model_validator(mode="after")
    def _chat_rules(self) -> "ChatCompletionRequest":
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice is only allowed when tools are specified")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaToolCall(ToolCall):
    index: int


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler):  # OpenAI's deltas carry only the keys that changed
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


# ---- models, tokenization, health ------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedllm"
    status: Literal["ready", "loading", "failed"] = "ready"
    max_model_len: Optional[int] = None
    error: Optional[str] = None
    root: Optional[str] = None  # where it was loaded from (a LoRA adapter's folder)
    parent: Optional[str] = None  # a LoRA adapter's base model (vLLM's field); None for a base model


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/load_lora_adapter (`model`: the base, when more than one is loaded)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=255)
    lora_path: str = Field(min_length=1, max_length=4096)
    model: Optional[str] = None


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/unload_lora_adapter (lora_int_id accepted and ignored, as vLLM does)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=255)
    lora_int_id: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ModelStatus(BaseModel):
    status: Literal["loading", "ready", "unloaded"]


# ---- embeddings ----------------------------------------------------------------------------------
class EmbeddingRequest(RequestModel):
    """OpenAI's embeddings request (and vLLM's `add_special_tokens`); unknown top-level fields are
    logged and ignored, as for completions."""

    model_config = ConfigDict(extra="allow")

    model: Optional[Name] = Field(default=None, description="served model name; optional when one model is loaded")
    input: PromptInput = Field(description="a string, a list of strings, a list of token ids, or a list of such lists")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(default=None, description="only the model's hidden size is supported (no "
                                                                "Matryoshka truncation): any other value is a 400")
    user: Optional[Annotated[str, Field(max_length=256)]] = None
    add_special_tokens: bool = True


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: Union[list[float], str] = Field(description="floats, or base64 of little-endian float32 values")


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class TokenizeRequest(RequestModel):
    model: Optional[Name] = None
    prompt: Text
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(RequestModel):
    model: Optional[Name] = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    model: str
    tokenizer_class: str
    eos_token: Optional[str] = None
    bos_token: Optional[str] = None
    pad_token: Optional[str] = None
    unk_token: Optional[str] = None
    chat_template: Optional[str] = None
    model_max_length: int
    vocab_size: int  # the tokenizer's, special tokens included


class ReplicaHealth(BaseModel):
    replica: int
    alive: bool
    pid: Optional[int] = None
    node_id: Optional[str] = None  # the Ray node (--cluster ray)
    restarts: int = 0


class ModelHealth(BaseModel):
    status: Literal["healthy", "degraded", "unhealthy"]
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    reason: Optional[str] = None
    replicas: Optional[list[ReplicaHealth]] = None  # --data-parallel-size > 1


class LiveRequest(BaseModel):
    """An engine request's state, timings and counts (the platform's InferenceRequest fields)."""

    id: str  # the response's id, then "-{prompt index}"
    model: str
    status: Literal["queued", "prefilling", "decoding", "preempted", "completed", "failed"]
    priority: int
    arrival_time: float  # seconds since the epoch, as every time here
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    queue_time_s: float  # arrival to first scheduled (to now, while still queued)
    num_prompt_tokens: int
    num_generated_tokens: int
    num_samples: int
    num_preemptions: int


class LiveRequestList(BaseModel):
    object: Literal["list"] = "list"
    data: list[LiveRequest]


class HealthResponse(BaseModel):
    status: Literal["healthy", "degraded", "unhealthy"]
    models: dict[str, ModelHealth] = Field(default_factory=dict)
