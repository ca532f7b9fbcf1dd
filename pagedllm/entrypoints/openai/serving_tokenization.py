"""/tokenize, /detokenize, /tokenizer_info: the shapes vLLM serves and lm-evaluation-harness's
remote tokenizer reads, so clients can count and split tokens exactly as the server does."""
from __future__ import annotations

from pagedllm.entrypoints.openai.models import ServedModel
from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from pagedllm.entrypoints.openai.serving import encode
from pagedllm.http_errors import BadRequestError


def _tokenizer(served: ServedModel):
    if served.tokenizer is None:
        raise BadRequestError(f"model {served.name!r} has no tokenizer", "model")
    return served.tokenizer


async def tokenize(req: TokenizeRequest, served: ServedModel) -> TokenizeResponse:
    """On the model's tokenizer thread, after the prompt's length check (serving.encode)."""
    _tokenizer(served)
    ids = await encode(served, req.prompt, "prompt", req.add_special_tokens)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=served.max_model_len)


async def detokenize(req: DetokenizeRequest, served: ServedModel) -> DetokenizeResponse:
    tok = _tokenizer(served)
    vocab = served.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise BadRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
    return DetokenizeResponse(prompt=await served.on_tokenizer_thread(tok.decode, req.tokens))


def tokenizer_info(served: ServedModel) -> TokenizerInfo:
    tok = _tokenizer(served)
    return TokenizerInfo(
        model=served.name,
        tokenizer_class=type(tok).__name__,
        eos_token=tok.eos_token,
        bos_token=tok.bos_token,
        pad_token=tok.pad_token,
        unk_token=tok.unk_token,
        chat_template=getattr(tok, "chat_template", None),
        model_max_length=served.max_model_len,
        vocab_size=len(tok),
    )
