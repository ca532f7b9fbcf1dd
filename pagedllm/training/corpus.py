"""Where training text comes from: a text file, a folder of text files, JSONL with a "text" field, or
`@stdlib` -- the Python standard library of the interpreter running the command, present on every
machine, which is what the embedded default model is trained on.

Documents come out in a deterministic order (sorted relative paths, then line order), which both the
tokenizer trainer and the token cache rely on.
"""
from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

STDLIB_ALIAS = "@stdlib"
# Folders that are never corpus text: byte code, installed third-party packages, VCS metadata.
SKIPPED_DIRS = {"__pycache__", "site-packages", "dist-packages", ".git", ".hg", ".svn"}


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str


def resolve_path(path: str) -> Path:
    """`@stdlib` becomes this interpreter's standard-library folder; anything else is a plain path."""
    if path == STDLIB_ALIAS:
        return Path(sysconfig.get_paths()["stdlib"])
    return Path(path).expanduser()


def source_files(path: str, file_glob: str = "**/*") -> list[Path]:
    """The files a dataset path stands for, sorted, skipping SKIPPED_DIRS and hidden files."""
    root = resolve_path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"dataset path not found: {path} ({root})")
    files = []
    for file in root.glob(file_glob):
        rel = file.relative_to(root).parts
        if file.is_file() and not any(part in SKIPPED_DIRS or part.startswith(".") for part in rel):
            files.append(file)
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def iter_documents(path: str, file_glob: str = "**/*") -> Iterator[Document]:
    """Each text file is one document; each JSONL line with a "text" field is one document.
    Files that are not UTF-8 text are skipped (a folder may hold binaries)."""
    root = resolve_path(path)
    for file in source_files(path, file_glob):
        rel = file.relative_to(root).as_posix() if root.is_dir() else file.name
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if file.suffix == ".jsonl":
            yield from _jsonl_documents(rel, text)
        elif text:
            yield Document(rel, text)


def _jsonl_documents(rel: str, text: str) -> Iterator[Document]:
    for number, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{rel} line {number + 1}: expected a JSON object with a string 'text' field")
        if record["text"]:
            yield Document(f"{rel}:{number}", record["text"])
