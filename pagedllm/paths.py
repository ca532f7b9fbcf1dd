"""Where the repository's embedded default model lives."""
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / "models" / "pagedllm-py-tiny"
# The draft model for speculative decoding (same tokenizer and corpus, 1 layer).
DRAFT_MODEL = REPO_ROOT / "models" / "pagedllm-py-draft"
