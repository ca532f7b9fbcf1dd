"""The tokenizer a GGUF describes in its metadata, built as a transformers fast tokenizer, so a
GGUF file needs no tokenizer folder beside it.

llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`), the BPE merges, each token's type
(control tokens such as <|im_start|> are 3, user-defined ones 4), the special token ids, whether
to add BOS, and the chat template. Byte-level BPE vocabularies (`tokenizer.ggml.model` "gpt2":
GPT-2, Llama 3, Qwen, SmolLM) are built here with the `tokenizers` library; the text is split
before BPE the way llama.cpp splits it for the file's `tokenizer.ggml.pre` (SmolLM and StarCoder,
for example, cut every digit apart, which transformers' own GGUF loader does not do: the merges
were learnt on such splits). SentencePiece vocabularies ("llama": Llama 2, Mistral) go through
transformers' GGUF converter, which rebuilds their merges from the token scores.
"""
from __future__ import annotations

import logging

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from pagedllm.load_errors import ModelLoadError
from pagedllm.gguf.file import GGUFModel

logger = logging.getLogger("pagedllm.gguf")

CONTROL, USER_DEFINED = 3, 4
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regexes llama.cpp applies one after the other (llama-vocab.cpp).
PRE_TOKENIZERS = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo", "jais"), (_GPT2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), (r"\p{N}", _GPT2)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), (_QWEN2,)),
}


def gguf_tokenizer(model: GGUFModel):
    """A transformers fast tokenizer for the file, with its special tokens and chat template."""
    meta = model.metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{model.path}: GGUF metadata has no tokenizer (tokenizer.ggml.tokens)")
    if kind == "gpt2":
        backend = _byte_level(model, tokens)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        backend, add_bos = _sentencepiece(model)
    else:
        raise ModelLoadError(f"{model.path}: tokenizer model {kind!r} is not supported (gpt2, llama)")
    _add_special_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type") or [])
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    special = {name: _token(tokens, meta.get(f"tokenizer.ggml.{key}"))
               for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                                 ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
    backend.post_processor = _post_processor(add_bos and _special(meta, tokens, "bos_token_id"),
                                             add_eos and _special(meta, tokens, "eos_token_id"))
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False, add_bos_token=add_bos, add_eos_token=add_eos,
        **{name: token for name, token in special.items() if token is not None})
    tokenizer.name_or_path = model.path
    return tokenizer


def _token(tokens: list[str], token_id) -> str | None:
    return tokens[int(token_id)] if token_id is not None and 0 <= int(token_id) < len(tokens) else None


def _special(meta: dict, tokens: list[str], key: str) -> tuple[str, int] | None:
    token_id = meta.get(f"tokenizer.ggml.{key}")
    return (tokens[int(token_id)], int(token_id)) if _token(tokens, token_id) is not None else None


def _byte_level(model: GGUFModel, tokens: list[str]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in model.metadata.get("tokenizer.ggml.merges") or []]
    if not merges:
        raise ModelLoadError(f"{model.path}: a byte-level BPE tokenizer needs tokenizer.ggml.merges")
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    pre = model.metadata.get("tokenizer.ggml.pre", "default")
    splits = PRE_TOKENIZERS.get(pre)
    if splits is None:
        logger.warning("%s: unknown tokenizer.ggml.pre %r; splitting text as GPT-2 does", model.path, pre)
        splits = (_GPT2,)
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
    backend.pre_tokenizer = pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(model: GGUFModel) -> tuple[Tokenizer, bool]:
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, config = get_gguf_tokenizer(model.path)
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return backend, bool(config.get("add_bos_token", True))


def _add_special_tokens(backend: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens are matched whole and are special (skipped when decoding with
    skip_special_tokens); user-defined ones are matched whole but are ordinary text."""
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types) if kind == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, types) if kind == USER_DEFINED])


def _post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None):
    """BOS before and EOS after the text, where the file asks for them."""
    first = f"{bos[0]}:0 " if bos else ""
    last = f" {eos[0]}:0" if eos else ""
    return processors.TemplateProcessing(single=f"{first}$A:0{last}", pair=f"{first}$A:0{last} {first}$B:1{last}",
                                         special_tokens=[t for t in (bos, eos) if t])
