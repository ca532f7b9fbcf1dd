"""Where a training job submitted over HTTP may read and write.

The job service runs jobs with the server's own rights, so every path a caller names is taken as a
request, not an order: it is resolved to its real path (symlinks followed, `..` folded) and must lie
under one of the allowed roots — the server's data dir, plus the folders the operator listed with
`pagedllm serve --allowed-path DIR`. Otherwise a caller could write checkpoints into system folders,
or train on (and read back through the model) files nobody meant to share. Relative paths are taken
under the data dir: the server's working directory means nothing to a remote caller. `@stdlib` (the
interpreter's own standard library, a public corpus) stays allowed as a dataset, and
`@pagedllm-py-tiny` (the repository's own model's tokenizer, only read) as a tokenizer.

Paths are stored resolved, so a symlink changed after submission cannot redirect the job; and they
are checked again before each launch, against the roots of the server that launches it. A dataset
folder is confined file by file: every file its glob takes (the default `**/*` too) must lie under an
allowed root once its links are followed, else the job is refused naming the file; the trainer, given
the roots, skips any that a link planted later leads out (training/corpus.py). The service's own files
in the data dir (its job store, its checkpoint key) are never a job's data.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from pagedllm.jobs.body import encodable
from pagedllm.training.config import DEFAULT_BASE_MODEL, ConfigError
from pagedllm.training.corpus import STDLIB_ALIAS, folder_files
from pagedllm.training.provenance import SERVICE_KEY_FILE
from pagedllm.training.tokenizer import BUNDLED_TOKENIZER_ALIAS

CHECKPOINT_DIR = "checkpoint_config.checkpoint_dir"
DATASET_PATH = "data_config.dataset_path"
TOKENIZER_PATH = "data_config.tokenizer_path"
BASE_MODEL = "finetune_config.base_model"
CACHE_DIR = "data_config.cache_dir"
FILE_GLOB = "data_config.file_glob"
# The job service's own files in its data dir, never a job's data.
SERVICE_FILES = ("jobs.db", "jobs.db-wal", "jobs.db-shm", "service.lock", SERVICE_KEY_FILE)


def real_path(path: str | Path) -> Path:
    """`path` with `~` expanded, symlinks resolved and `..` folded (the path need not exist)."""
    return Path(os.path.realpath(Path(path).expanduser()))


class AllowedRoots:
    """The folders jobs may use; the first is the data dir, which relative paths are taken under."""

    def __init__(self, data_dir: str | Path, extra: Iterable[str | Path] = ()) -> None:
        self.data_dir = real_path(data_dir)
        roots = [self.data_dir]
        for root in extra:
            resolved = real_path(root)
            if resolved not in roots:
                roots.append(resolved)
        self.roots = tuple(roots)

    def describe(self) -> str:
        extra = ", ".join(str(r) for r in self.roots[1:])
        return f"the data dir {self.data_dir}" + (f" and --allowed-path {extra}" if extra else " (no --allowed-path given)")

    def resolve(self, field: str, value: str) -> Path:
        """The real path `value` stands for; ConfigError naming `field` unless it is under an allowed root."""
        if not value or "\x00" in value:
            raise ConfigError(field, "must be a non-empty path without NUL characters")
        path = Path(value).expanduser()
        try:
            resolved = real_path(path if path.is_absolute() else self.data_dir / path)
            looped = any(part.is_symlink() for part in (resolved, *resolved.parents))  # realpath stops inside a loop
        except (OSError, ValueError, RuntimeError) as exc:  # e.g. a name too long
            raise ConfigError(field, f"cannot be resolved: {type(exc).__name__}: {exc.args[-1] if exc.args else ''}") from exc
        if looped:
            raise ConfigError(field, f"{value!r} cannot be resolved: it goes through a symlink loop")
        if not self.holds(resolved):
            raise ConfigError(field, f"{value!r} is outside the folders this server lets jobs use: {self.describe()} "
                                     "(symlinks are followed; the operator can add a folder with pagedllm serve --allowed-path)")
        return resolved

    def holds(self, resolved: Path) -> bool:
        """Whether a real path (links already followed) lies under an allowed root."""
        return any(resolved == root or resolved.is_relative_to(root) for root in self.roots)

    def private(self, path: Path) -> bool:
        """Whether `path` (its links followed) is one of the job service's own files."""
        return real_path(path) in {self.data_dir / name for name in SERVICE_FILES}

    def check_unchanged(self, field: str, value: str) -> None:
        """A stored (resolved) path still resolves to itself under an allowed root: checked before each launch."""
        if self.resolve(field, value) != Path(value):
            raise ConfigError(field, f"{value!r} now resolves elsewhere (a symlink changed since the job was submitted)")


MAX_GLOB_CHARS = 512


def check_file_glob(pattern: str) -> None:
    """A dataset folder's glob must stay in the folder (relative, without `..`), be one pathlib
    accepts (`**` only as a whole component: `a**` was a 500 at the walk), name files (not `.`), and
    recurse at most once: each further `**` multiplies the walk by the folder's depth."""
    if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_GLOB_CHARS:
        raise ConfigError(FILE_GLOB, f"must be a non-empty pattern of at most {MAX_GLOB_CHARS} characters")
    path = PurePosixPath(pattern)
    if not encodable(pattern):  # a row stored before text was checked (body.py)
        raise ConfigError(FILE_GLOB, f"{pattern!r} must be valid Unicode (it contains a lone surrogate)")
    if "\x00" in pattern or path.is_absolute() or ".." in path.parts or "\\" in pattern or not path.parts:
        raise ConfigError(FILE_GLOB, f"{pattern!r} must be a relative pattern naming files, without '..' (e.g. '**/*.py')")
    if any("**" in part and part != "**" for part in path.parts):
        raise ConfigError(FILE_GLOB, f"{pattern!r}: '**' can only be a whole path component (e.g. '**/*.py', not 'a**')")
    if path.parts.count("**") > 1:
        raise ConfigError(FILE_GLOB, f"{pattern!r} has more than one '**': one recursive component at most")


def confine_data(data: dict, roots: AllowedRoots) -> dict:
    """The data_config section with its paths resolved under the allowed roots."""
    check_file_glob(data.get("file_glob", "**/*"))
    updates = {}
    if data.get("tokenizer_path") not in (None, BUNDLED_TOKENIZER_ALIAS):  # None: a fine-tune's base model's
        updates["tokenizer_path"] = str(_data_path(roots, TOKENIZER_PATH, data["tokenizer_path"]))
    if data["dataset_path"] != STDLIB_ALIAS:
        updates["dataset_path"] = str(_data_path(roots, DATASET_PATH, data["dataset_path"]))
        check_dataset_files(updates["dataset_path"], data.get("file_glob", "**/*"), roots)
    if data.get("cache_dir"):
        updates["cache_dir"] = str(roots.resolve(CACHE_DIR, data["cache_dir"]))
    return {**data, **updates}


def confine_base_model(value: str, roots: AllowedRoots) -> str:
    """A fine-tune's base model (folder or .gguf) resolved under the allowed roots; `@default`, the
    installed default model, is only read, like @stdlib."""
    return value if value == DEFAULT_BASE_MODEL else str(_data_path(roots, BASE_MODEL, value))


def _data_path(roots: AllowedRoots, field: str, value: str) -> Path:
    resolved = roots.resolve(field, value)
    if roots.private(resolved):
        raise ConfigError(field, f"{value!r} is one of the job service's own files, not data")
    return resolved


def check_dataset_files(dataset_path: str, file_glob: str, roots: AllowedRoots) -> None:
    """Every file a dataset folder's glob takes lies under an allowed root once its links are
    followed, and none is the service's own; ConfigError naming the first that does not.

    Only a file reached through a link (itself, or a folder on its way from the dataset folder) is
    resolved: the others are where they are, inside the (resolved) folder. Resolving every file
    took 5 of the 6.7 s that checking 50,000 files did."""
    folder = real_path(dataset_path)
    if not folder.is_dir():
        return  # a single file: resolved already; a missing path is reported by the trainer's own checks
    linked: dict[Path, bool] = {folder: False}
    for file in folder_files(folder, file_glob):
        real = real_path(file) if file.is_symlink() or _through_link(file.parent, linked) else file
        if not roots.holds(real):
            raise ConfigError(DATASET_PATH, f"{file} (taken by file_glob {file_glob!r}) is a link to {real}, outside the "
                                            f"folders this server lets jobs use: {roots.describe()}; links pointing out are refused")
        if real.parent == roots.data_dir and real.name in SERVICE_FILES:
            raise ConfigError(DATASET_PATH, f"{file} (taken by file_glob {file_glob!r}) is one of the job service's own files, not data")


def _through_link(folder: Path, linked: dict[Path, bool]) -> bool:
    """Whether `folder` (under the dataset folder, a key of `linked`) is, or lies in, a symlinked folder."""
    if folder not in linked:
        linked[folder] = folder.is_symlink() or _through_link(folder.parent, linked)
    return linked[folder]


def confine_checkpoint_dir(value: str, roots: AllowedRoots) -> Path:
    """checkpoint_dir resolved under the allowed roots, and never a folder holding the service's own files."""
    resolved = roots.resolve(CHECKPOINT_DIR, value)
    if roots.data_dir.is_relative_to(resolved) or resolved == roots.data_dir / "jobs":
        raise ConfigError(CHECKPOINT_DIR, f"{value!r} would hold the job service's own files ({roots.data_dir}); "
                                          "name a folder of its own")
    return resolved


def check_confined(config: dict, roots: AllowedRoots) -> None:
    """Before a launch: every stored path of the job still lies, unchanged, under this server's roots."""
    data = config["data_config"]
    check_file_glob(data.get("file_glob", "**/*"))
    fields = [(CHECKPOINT_DIR, config["checkpoint_config"]["checkpoint_dir"])]
    if data.get("tokenizer_path") not in (None, BUNDLED_TOKENIZER_ALIAS):
        fields.append((TOKENIZER_PATH, data["tokenizer_path"]))
    base = (config.get("finetune_config") or {}).get("base_model")
    if base not in (None, DEFAULT_BASE_MODEL):
        fields.append((BASE_MODEL, base))
    if data["dataset_path"] != STDLIB_ALIAS:
        fields.append((DATASET_PATH, data["dataset_path"]))
    if data.get("cache_dir"):
        fields.append((CACHE_DIR, data["cache_dir"]))
    for field, value in fields:
        roots.check_unchanged(field, value)
    if data["dataset_path"] != STDLIB_ALIAS:
        check_dataset_files(data["dataset_path"], data.get("file_glob", "**/*"), roots)
