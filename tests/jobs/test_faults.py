"""Training faults through the job service, on a real job: the disk filling up during a checkpoint save, a
corrupted checkpoint shard found by its checksum when the job is resumed, and the exact resume after both.
(kill -9 of one rank of a 2-rank job is test_lifecycle.py.)

One rank (`pagedllm train` runs it in-process: no torchrun start-up), the tiny model, two launches."""
from __future__ import annotations

import json
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
from soak import record

from .helpers import TERMINAL, JobServer, job_body, job_processes, kill_leftovers

HERE = Path(__file__).parent
DISK_KIB = 2600  # two checkpoints of the tiny job (~1 MiB each with the tokenizer and metrics) fit, a third does not


@contextmanager
def small_disk(folder: Path):
    """A tmpfs of DISK_KIB mounted at `folder`; None where this machine gives no mount rights."""
    folder.mkdir(parents=True)
    mounted = os.environ.get("PAGEDLLM_TEST_FULL_DISK_INJECT") != "1" and subprocess.run(  # "1": try the stand-in
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_KIB}k", "tmpfs", str(folder)], capture_output=True).returncode == 0
    try:
        yield folder if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], check=True)


def grow(folder: Path) -> None:
    """What an operator does about a full disk: make room (here: a bigger tmpfs)."""
    subprocess.run(["mount", "-o", "remount,size=64m", str(folder)], check=True)


@pytest.fixture
def full_disk(tmp_path, tmp_path_factory, server, monkeypatch):
    """(the job server to use, the checkpoint_dir whose disk fills during the third save, how to make room, how).

    With mount rights: a real 2.6 MB tmpfs on the session's server. Without: a server of its own whose job
    processes load full_disk/sitecustomize.py, which fails every write of the third checkpoint's shards
    with ENOSPC (the error a full disk gives) until the test makes room."""
    with small_disk(tmp_path / "disk") as disk:
        if disk is not None:
            yield server, disk / "ckpt", lambda: grow(disk), "tmpfs"
            return
        spec = tmp_path / "full-disk.json"
        ckpt = tmp_path / "disk" / "ckpt"
        spec.write_text(json.dumps({"path": str(ckpt / "step-00000006" / "model")}))  # its manifest still fits
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE / "full_disk"), os.environ.get("PYTHONPATH")])))
        monkeypatch.setenv("PAGEDLLM_TEST_FULL_DISK", str(spec))
        root = tmp_path_factory.mktemp("jobs-full-disk")
        own = JobServer(root / "data", 1, root, allowed=(tmp_path_factory.getbasetemp(),)).start()
        try:
            yield own, ckpt, lambda: spec.write_text(json.dumps({"path": None})), "injected ENOSPC (no mount rights)"
        finally:
            own.stop()
            assert not kill_leftovers(own.data_dir)


def test_full_disk_then_corrupt_checkpoint_then_exact_resume(full_disk, tiny_paths):
    """The disk fills during the third save: the job FAILS naming the cause, the two earlier checkpoints are
    intact. A byte of the newest of them is then flipped and room is made: the resume finds the flip by its
    checksum, marks that checkpoint CORRUPT, says so in the job's history and log, and continues from the one
    before; the steps it trains again give the first run's losses exactly."""
    server, ckpt, make_room, how = full_disk
    body = job_body(tiny_paths, ranks=1, steps=12,
                    checkpoint_config={"checkpoint_dir": str(ckpt), "checkpoint_interval_steps": 2, "max_checkpoints_to_keep": 2})
    job_id = server.submit(body)
    failed = server.wait(job_id, lambda v: v["status"] in TERMINAL, timeout=120, what="the job to end")
    reason = failed["failure_reason"]
    assert failed["status"] == "FAILED", failed
    assert "checkpoint at step 6 could not be saved" in reason and "No space left on device" in reason, reason
    assert "newest COMPLETE checkpoint is step 4" in reason, reason
    assert not job_processes(job_id)
    assert any(f"(step 6) could not be saved and is marked CORRUPT: save failed: OSError" in (h["reason"] or "")
               for h in failed["history"]), failed["history"]

    checkpoints = {c["step"]: c for c in server.client.get(f"/v1/training/jobs/{job_id}/checkpoints").json()}
    assert {s: c["status"] for s, c in checkpoints.items()} == {2: "COMPLETE", 4: "COMPLETE", 6: "CORRUPT"}
    assert checkpoints[6]["status_reason"].startswith("save failed: OSError: [Errno 28]")
    assert not (Path(checkpoints[6]["path"]) / "model").exists()  # the partial save gave its room back
    for step in (2, 4):  # the earlier checkpoints are intact, byte for byte
        assert_intact(checkpoints[step])
    first_run = {m["step"]: m["loss"] for m in server.client.get(f"/v1/training/jobs/{job_id}/metrics").json()["data"]}

    newest, previous = checkpoints[4], checkpoints[2]
    flipped = next(s["file_path"] for s in newest["shards"] if s["file_path"].endswith(".distcp"))  # model weights
    shard = Path(newest["path"]) / flipped
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    shard.write_bytes(bytes(data))

    make_room()
    resumed = server.client.post(f"/v1/training/jobs/{job_id}/resume", json={})  # no id: the newest intact one
    assert resumed.status_code == 200, resumed.text
    done = server.wait_status(job_id, "COMPLETED", timeout=120)
    assert done["metrics"]["step"] == 12 and done["runs"][-1]["outcome"] == "COMPLETED"
    assert (done["runs"][-1]["resumed_from"], done["runs"][-1]["start_step"]) == (previous["checkpoint_id"], 2)
    reasons = [h["reason"] or "" for h in done["history"]]
    corrupt = next(r for r in reasons if f"checkpoint {newest['checkpoint_id']} (step 4) failed verification (an older" in r)
    assert "CORRUPT" in corrupt and "checksum" in corrupt and flipped in corrupt
    assert f"run 2 resumed from checkpoint {previous['checkpoint_id']} at step 2" in reasons
    listed = {c["checkpoint_id"]: c for c in server.client.get(f"/v1/training/jobs/{job_id}/checkpoints").json()}
    assert listed[newest["checkpoint_id"]]["status"] == "CORRUPT"  # (step 4 was saved again, under a new id)
    assert max(listed.values(), key=lambda c: c["step"])["status"] == "COMPLETE"
    log = server.client.get(f"/v1/training/jobs/{job_id}/logs").json()["text"]
    assert "failed verification" in log and "trying the previous one" in log

    # the steps trained again after the fallback give the first run's losses, exactly
    second_run = {m["step"]: m["loss"] for m in server.client.get(f"/v1/training/jobs/{job_id}/metrics").json()["data"]}
    again = [step for step in first_run if step > 2]
    assert again == [3, 4, 5, 6] or again == [3, 4, 5], first_run
    assert all(second_run[step] == first_run[step] for step in again), (first_run, second_run)
    record("faults", {"disk": how, "full_disk": {"failed_at_save_of_step": 6, "job_status": failed["status"],
                                                 "failure_reason": reason, "earlier_checkpoints_intact": [2, 4]},
                      "corrupt_shard": {"flipped_byte_in": f"step 4 {flipped}", "detected": "checksum",
                                        "resumed_from_step": 2},
                      "exact_resume": {"steps_compared": len(again), "losses_equal": True}, "final_status": done["status"]})


def assert_intact(checkpoint: dict) -> None:
    import hashlib

    for record_ in checkpoint["shards"] + checkpoint["optimizer_states"]:
        data = (Path(checkpoint["path"]) / record_["file_path"]).read_bytes()
        assert len(data) == record_["file_size_bytes"]
        assert "sha256:" + hashlib.sha256(data).hexdigest() == record_["checksum"]
