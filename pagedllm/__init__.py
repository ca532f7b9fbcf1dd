"""pagedllm: a paged-KV-cache LLM engine, an OpenAI-compatible server and a PyTorch-native trainer."""
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "Logprob"]
