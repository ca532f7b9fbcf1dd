"""Test-only stand-in for a full disk, for machines where the test cannot mount a small tmpfs.

Python imports this module at start-up when this folder is on PYTHONPATH (the job processes inherit it
from the server the test starts). Active only when PAGEDLLM_TEST_FULL_DISK names a JSON file
{"path": FOLDER}: opening a file for writing under FOLDER then fails with ENOSPC, where the real disk
would. The file is read at every open, so the test "frees space" by writing {"path": null}.
"""
import builtins
import errno
import io
import json
import os

_SPEC = os.environ.get("PAGEDLLM_TEST_FULL_DISK")

if _SPEC:
    _real_open = io.open

    def _full(file, mode: str) -> bool:
        if not any(flag in mode for flag in "wax+"):
            return False
        try:
            with _real_open(_SPEC) as spec:
                folder = json.load(spec).get("path")
        except (OSError, ValueError):
            return False
        return bool(folder) and os.path.abspath(os.fsdecode(os.fspath(file))).startswith(folder + os.sep)

    def _open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and _full(file, mode):
            raise OSError(errno.ENOSPC, "No space left on device", os.fsdecode(os.fspath(file)))
        return _real_open(file, mode, *args, **kwargs)

    io.open = builtins.open = _open
