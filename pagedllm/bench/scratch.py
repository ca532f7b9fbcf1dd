"""A bench's working folder: the one the user named (kept), or a temporary one removed when the bench ends.

Benchmarks write model copies of several GB (a dequantized base, checkpoints, merged folders); a
temporary folder left behind per run fills a shared disk within a day of benchmarking.
"""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def scratch_dir(prefix: str, keep: Path | None = None, keep_failed: bool = False) -> Iterator[Path]:
    """`keep` (created if missing, never removed), else a fresh temporary folder removed on exit —
    also on error, unless `keep_failed` (a failed run's logs are what its user reads next)."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    failed = False
    try:
        yield folder
    except BaseException:
        failed = True
        raise
    finally:
        if not (failed and keep_failed):
            shutil.rmtree(folder, ignore_errors=True)
