"""Where training text comes from: a text file, a folder of text files, JSONL with a "text" field, or
`@stdlib` -- the Python standard library of the interpreter running the command, present on every
machine, which is what the embedded default model is trained on.

Documents come out in a deterministic order (sorted relative paths, then line order), which both the
tokenizer trainer and the token cache rely on.

A folder's files are taken after following their links: a job launched by the job service gets the
server's allowed roots in PAGEDLLM_ALLOWED_ROOTS, and a file (or a file in a linked folder) whose real
path lies outside them is skipped, so a link planted in a dataset folder after the service checked it
(jobs/confinement.py) reads nothing outside. `pagedllm train` run by hand has no such roots.
"""
from __future__ import annotations

import json
import logging
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("pagedllm.training")

STDLIB_ALIAS = "@stdlib"
ROOTS_ENV = "PAGEDLLM_ALLOWED_ROOTS"  # os.pathsep-separated real paths, set by the job service's launcher
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


def allowed_roots() -> tuple[Path, ...] | None:
    """The folders a service-launched job may read (PAGEDLLM_ALLOWED_ROOTS); None: no confinement."""
    value = os.environ.get(ROOTS_ENV)
    return tuple(Path(p) for p in value.split(os.pathsep) if p) if value else None


def within(path: Path, roots: tuple[Path, ...]) -> bool:
    """Whether `path`, its links followed, lies under one of `roots` (real paths)."""
    real = Path(os.path.realpath(path))
    return any(real == root or real.is_relative_to(root) for root in roots)


def folder_files(root: Path, file_glob: str) -> list[Path]:
    """The files of a dataset folder the glob takes, sorted, skipping SKIPPED_DIRS and hidden
    files; links are followed (the caller confines them)."""
    files = []
    for file in root.glob(file_glob):
        rel = file.relative_to(root).parts
        if file.is_file() and not any(part in SKIPPED_DIRS or part.startswith(".") for part in rel):
            files.append(file)
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def source_files(path: str, file_glob: str = "**/*", roots: tuple[Path, ...] | None = None) -> list[Path]:
    """The files a dataset path stands for, sorted; with `roots` (by default this process's
    allowed roots, if any) only those whose real path lies under one of them."""
    root = resolve_path(path)
    if not root.is_file() and not root.is_dir():
        raise FileNotFoundError(f"dataset path not found: {path} ({root})")
    files = [root] if root.is_file() else folder_files(root, file_glob)
    roots = roots if roots is not None else allowed_roots()
    if roots is None:
        return files
    if path == STDLIB_ALIAS:
        roots = (*roots, Path(os.path.realpath(root)))
    kept = [file for file in files if within(file, roots)]
    if len(kept) < len(files):
        log.warning("dataset %s: %d file(s) skipped: their links lead outside the allowed folders", path, len(files) - len(kept))
    return kept


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
