"""Bounded in `make test`, full size in `make soak`: the reliability tests read their budget here and
leave their figures where `make soak` collects them for docs/reliability.md.

(tests/ is on sys.path, see tests/conftest.py.)"""
from __future__ import annotations

import json
import os
from pathlib import Path

SOAK = os.environ.get("PAGEDLLM_SOAK") == "1"


def budget(bounded: int, soak: int) -> int:
    return soak if SOAK else bounded


def record(name: str, figures: dict) -> None:
    """Print the figures; with $PAGEDLLM_SOAK_REPORT_DIR, also keep them as <dir>/<name>.json."""
    print(f"\n{name}: {json.dumps(figures)}")
    folder = os.environ.get("PAGEDLLM_SOAK_REPORT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.json").write_text(json.dumps({"soak": SOAK, **figures}, indent=2) + "\n")
