"""pagedllm: a paged-KV-cache LLM engine, an OpenAI-compatible server and a PyTorch-native trainer."""
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "LoRARequest", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "RequestMetrics", "Logprob", "BeamSearchOutput", "BeamSearchSequence"]
