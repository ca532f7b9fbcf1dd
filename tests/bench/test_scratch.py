"""A bench's temporary working folder is removed when it ends (also on error); a named one is kept."""
from pathlib import Path

import pytest

from pagedllm.bench.scratch import scratch_dir


def test_a_temporary_folder_is_removed_after_the_bench_and_after_an_error():
    with scratch_dir("pagedllm-test-scratch-") as folder:
        (folder / "model.safetensors").write_bytes(b"x" * 1024)
    assert not folder.exists()
    with pytest.raises(RuntimeError), scratch_dir("pagedllm-test-scratch-") as failed:
        (failed / "partial").write_text("...")
        raise RuntimeError("bench failed")
    assert not failed.exists()


def test_a_folder_the_user_named_is_created_and_kept(tmp_path: Path):
    named = tmp_path / "work" / "dir"
    with scratch_dir("pagedllm-test-scratch-", named) as folder:
        (folder / "adapter_config.json").write_text("{}")
    assert folder == named and (named / "adapter_config.json").exists()


def test_a_failed_run_keeps_its_folder_when_asked():
    with pytest.raises(RuntimeError), scratch_dir("pagedllm-test-scratch-", keep_failed=True) as failed:
        (failed / "server.log").write_text("the server's last words")
        raise RuntimeError("bench failed")
    assert (failed / "server.log").exists()
    import shutil

    shutil.rmtree(failed)
    with scratch_dir("pagedllm-test-scratch-", keep_failed=True) as passed:
        pass
    assert not passed.exists()
