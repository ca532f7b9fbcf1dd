"""The name a model is served under, the same wherever it is named from (`serve --model`, the
default model, a `--model-dir` entry): a folder's name; a GGUF file's name without `.gguf` and
without its quantization tag (`SmolLM2-135M-Instruct.Q4_1.gguf` is `SmolLM2-135M-Instruct`, which
the default model is served as). Where two files of one folder would share a name (two
quantizations of one model), each keeps its whole file name instead, so no name is ambiguous."""
from __future__ import annotations

import re
from pathlib import Path

# llama.cpp's file-name tags: Q4_1, Q4_K_M, IQ4_XS, Q8_0, F16, BF16, F32 (after ".", "-" or "_")
_QUANT_TAG = re.compile(r"[.\-_](?:I?Q\d\w*|B?F(?:16|32))$", re.IGNORECASE)


def gguf_name(path: Path) -> str:
    stem = path.name.removesuffix(".gguf")
    return _QUANT_TAG.sub("", stem) or stem


def served_name(path: str | Path) -> str:
    """The name a model folder or GGUF file is served under by default."""
    resolved = Path(path).resolve()
    return gguf_name(resolved) if resolved.is_file() else resolved.name


def loadable_models(model_dir: str | Path) -> dict[str, Path]:
    """--model-dir's entries by name: sub-folders with a config.json, and .gguf files."""
    folders, files = {}, {}
    for entry in sorted(Path(model_dir).iterdir()):
        if (entry / "config.json").is_file():
            folders[entry.name] = entry
        elif entry.suffix == ".gguf" and entry.is_file():
            files.setdefault(gguf_name(entry), []).append(entry)
    found = dict(folders)
    for name, group in files.items():
        if len(group) == 1 and name not in found:
            found[name] = group[0]
        else:  # ambiguous without the tag: every file of the group by its whole name
            found.update({f.name.removesuffix(".gguf"): f for f in group})
    return found
