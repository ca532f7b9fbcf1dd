"""`pagedllm tokenizer train`: a byte-level BPE tokenizer written as tokenizer.json + tokenizer_config.json.

Byte-level BPE (GPT-2's scheme) never meets an unknown character, and keeps whitespace exactly, which
matters for code. The special tokens are the end-of-text token (bos = eos, as GPT-2/Qwen) and ChatML's
<|im_start|>/<|im_end|>, used by the chat template so chat requests have a well-defined prompt format.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pagedllm.paths import TINY_MODEL
from pagedllm.training.corpus import iter_documents

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
# ChatML; with `tools`, Hermes-style function calling (the format Qwen2.5 and NousResearch's Hermes
# models speak): the tools as JSON in a system block, calls as <tool_call>{"name", "arguments"}
# </tool_call>, results as <tool_response> blocks in a user turn. Without tools the prompt is
# plain ChatML.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>'
)
CHAT_TEMPLATE = (
    "{%- set first_system = messages and messages[0]['role'] == 'system' -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\n' }}{% if first_system %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '" + TOOLS_PREAMBLE + "' }}{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '" + TOOLS_FORMAT + "<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (tools and loop.first and first_system) -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set arguments = call['function']['arguments'] -%}"
    "{{ ('\n' if message['content'] or not loop.first else '') + '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ arguments if arguments is string else (arguments | tojson) }}{{ '}\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(input_path: str, vocab_size: int, out_dir: str | Path, file_glob: str = "**/*",
                    min_frequency: int = 2) -> Path:
    """Train on every document under `input_path`; returns the path of the written tokenizer.json."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"--vocab-size: must be at least {256 + len(SPECIAL_TOKENS)} (256 bytes + special tokens), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = _texts(input_path, file_glob)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    return out / "tokenizer.json"


def _texts(input_path: str, file_glob: str) -> Iterator[str]:
    count = 0
    for document in iter_documents(input_path, file_glob):
        count += 1
        yield document.text
    if not count:
        raise ValueError(f"--input: no text documents found under {input_path}")


def tokenizer_config() -> dict:
    """What transformers' AutoTokenizer needs to load tokenizer.json with the right special tokens."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
        "chat_template": CHAT_TEMPLATE,
    }


# The tokenizer of the repository's own model (models/pagedllm-py-tiny), as a tokenizer_path: what
# `pagedllm tokenizer train --input @stdlib --glob '**/*.py' --vocab-size 8192` made for it. Like
# `@stdlib` for datasets, a job given to the job service may name it without an --allowed-path:
# it is only read.
BUNDLED_TOKENIZER_ALIAS = "@pagedllm-py-tiny"


def tokenizer_files(tokenizer_path: str | Path) -> tuple[Path, Path | None]:
    """(tokenizer.json, tokenizer_config.json or None) for a tokenizer.json path or its folder
    (or the bundled tokenizer's alias)."""
    if str(tokenizer_path) == BUNDLED_TOKENIZER_ALIAS and not TINY_MODEL.is_dir():
        raise FileNotFoundError(f"{BUNDLED_TOKENIZER_ALIAS} is the tokenizer of the repository's models/pagedllm-py-tiny, "
                                "which an installed package does not include: run from a checkout, or name a tokenizer.json")
    path = TINY_MODEL if str(tokenizer_path) == BUNDLED_TOKENIZER_ALIAS else Path(tokenizer_path).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer not found: {tokenizer_path}")
    config = path.parent / "tokenizer_config.json"
    return path, config if config.is_file() else None


def special_token_ids(tokenizer_path: str | Path) -> dict[str, int | None]:
    """bos/eos/pad token ids: from tokenizer_config.json when present, else the end-of-text token."""
    path, config_path = tokenizer_files(tokenizer_path)
    tokenizer = Tokenizer.from_file(str(path))
    config = json.loads(config_path.read_text()) if config_path else {}
    ids = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        token = config.get(key, EOS_TOKEN)
        if isinstance(token, dict):
            token = token.get("content")
        ids[key] = tokenizer.token_to_id(token) if token else None
    return ids
