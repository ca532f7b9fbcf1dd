"""Checkpoint manifests (the platform's Checkpoint record), keep-k pruning, async save, time intervals and the request
files -- single process, in-process (the multi-rank cases are in test_distributed.py and test_cli.py)."""
from __future__ import annotations

import json
import uuid

import pytest

from pagedllm.training.checkpoint import CheckpointStatus, list_checkpoints, resolve_checkpoint, verify
from pagedllm.training.config import parse_job
from pagedllm.training.trainer import RunOptions, run_training

from .helpers import plant, tiny_job

FAST = RunOptions(peak_flops=1e10, export_hf=False)


def run(paths, ckpt, options: RunOptions = FAST, **sections):
    return run_training(parse_job(tiny_job(paths, ckpt, **sections)), options)


def statuses(ckpt) -> dict[int, str]:
    return {m.step: m.status.value for _, m in list_checkpoints(ckpt)}


def test_manifest_follows_the_seed_and_keep_k_prunes(tiny_paths, tmp_path):
    ckpt = tmp_path / "run"
    result = run(tiny_paths, ckpt, checkpoint_config={"checkpoint_interval_steps": 1, "max_checkpoints_to_keep": 2})
    assert statuses(ckpt) == {1: "DELETED", 2: "DELETED", 3: "DELETED", 4: "DELETED", 5: "COMPLETE", 6: "COMPLETE"}
    assert not (ckpt / "step-00000001" / "model").exists()
    step_dir, manifest = list_checkpoints(ckpt)[-1]
    assert resolve_checkpoint(ckpt) == step_dir == resolve_checkpoint(str(manifest.checkpoint_id), ckpt)
    job = json.loads((ckpt / "job.json").read_text())
    assert str(manifest.job_id) == job["job_id"] and manifest.step == 6 and manifest.world_size == 1
    meta = manifest.metadata
    assert (meta.global_step, meta.consumed_tokens, meta.loss) == (6, 6 * 8 * 32, result.losses[6])
    assert meta.learning_rate > 0 and meta.elapsed_time_seconds > 0
    assert [s.file_path for s in manifest.shards] == ["model/.metadata", "model/__0_0.distcp"]
    assert [s.file_path for s in manifest.optimizer_states] == ["optim/.metadata", "optim/__0_0.distcp"]
    assert all(s.checksum.startswith("sha256:") and s.file_size_bytes > 0 for s in manifest.shards)
    rng = manifest.rng_states[0]
    assert rng.rank == 0 and rng.torch_rng_state and rng.numpy_rng_state and rng.python_rng_state and rng.cuda_rng_state is None
    assert verify(step_dir, manifest) == []


def test_async_save_completes_and_resumes(tiny_paths, tmp_path):
    ckpt = tmp_path / "run"
    whole = run(tiny_paths, ckpt, checkpoint_config={"checkpoint_interval_steps": 2, "async_save": True})
    assert statuses(ckpt) == {2: "COMPLETE", 4: "COMPLETE", 6: "COMPLETE"}
    (ckpt / "step-00000006" / "manifest.json").unlink()  # as if the run died before its last checkpoint
    again = run(tiny_paths, ckpt, checkpoint_config={"async_save": True})
    assert again.start_step == 4 and again.losses == {5: whole.losses[5], 6: whole.losses[6]}


def test_async_save_lets_training_go_on_while_it_writes(tiny_paths, tmp_path, monkeypatch):
    """The writer of step 2's checkpoint is held until step 3 has trained (or 10 s pass): with an
    async save the step runs meanwhile; a synchronous save would hold the loop, and the writer
    would give up waiting. The held save still completes and verifies."""
    import threading
    from contextlib import contextmanager

    from torch.distributed.checkpoint.filesystem import FileSystem

    from pagedllm.training.trainer import Trainer

    stepped, seen = threading.Event(), []
    original_stream, original_step = FileSystem.create_stream, Trainer.train_step

    @contextmanager
    def slow_writer(self, path, mode):
        if "step-00000002" in str(path) and "w" in mode:
            seen.append(stepped.wait(timeout=10 if all(seen) else 0))  # one timeout is enough
        with original_stream(self, path, mode) as stream:
            yield stream

    def train_step(self, step):
        result = original_step(self, step)
        if step == 3:
            stepped.set()
        return result

    monkeypatch.setattr(FileSystem, "create_stream", slow_writer)
    monkeypatch.setattr(Trainer, "train_step", train_step)
    ckpt = tmp_path / "run"
    run(tiny_paths, ckpt, checkpoint_config={"checkpoint_interval_steps": 2, "async_save": True})
    assert seen and all(seen), "training did not go on while the checkpoint was written"
    assert statuses(ckpt) == {2: "COMPLETE", 4: "COMPLETE", 6: "COMPLETE"}
    for step_dir, manifest in list_checkpoints(ckpt):
        assert verify(step_dir, manifest) == []


def test_time_interval_checkpoints(tiny_paths, tmp_path):
    ckpt = tmp_path / "run"
    run(tiny_paths, ckpt, checkpoint_config={"checkpoint_interval_minutes": 1e-6, "max_checkpoints_to_keep": 10})
    assert statuses(ckpt) == {s: "COMPLETE" for s in range(1, 7)}


def test_checkpoint_request_file_names_the_checkpoint(tiny_paths, tmp_path):
    ckpt = tmp_path / "run"
    (ckpt / "control").mkdir(parents=True)
    wanted = uuid.uuid4()
    (ckpt / "control" / "checkpoint.request").write_text(json.dumps({"checkpoint_id": str(wanted)}))
    result = run(tiny_paths, ckpt)
    assert result.reason == "completed"
    manifests = {m.step: m for _, m in list_checkpoints(ckpt)}
    assert manifests[1].checkpoint_id == wanted and manifests[1].status is CheckpointStatus.COMPLETE
    assert not (ckpt / "control" / "checkpoint.request").exists()


def test_stop_file_stops_at_the_step_boundary(tiny_paths, tmp_path):
    ckpt = tmp_path / "run"
    (ckpt / "control").mkdir(parents=True)
    (ckpt / "control" / "stop").write_text(json.dumps({"checkpoint": False}))
    result = run(tiny_paths, ckpt)
    assert (result.reason, result.final_step, result.exit_code) == ("stopped", 1, 0)
    assert statuses(ckpt) == {}
    events = [json.loads(line) for line in (ckpt / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["started", "step", "stopping", "finished"]


def test_resume_from_a_corrupt_named_checkpoint_fails(tiny_paths, tmp_path):
    ckpt = tmp_path / "run"
    run(tiny_paths, ckpt)
    shard = ckpt / "step-00000006" / "optim" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(ValueError, match="--resume-from: checkpoint .* is corrupt: optim/__0_0.distcp checksum"):
        run(tiny_paths, ckpt, RunOptions(peak_flops=1e10, export_hf=False, resume_from="step-00000006"))
    assert statuses(ckpt) == {6: "CORRUPT"}


def test_interval_zero_means_off(tiny_paths, tmp_path):
    ckpt = tmp_path / "run"
    result = run(tiny_paths, ckpt, checkpoint_config={"checkpoint_interval_minutes": 0, "checkpoint_interval_steps": 0})
    assert result.reason == "completed" and statuses(ckpt) == {6: "COMPLETE"}  # only the final checkpoint


def test_a_full_disk_during_save_keeps_the_previous_checkpoint(tiny_paths, tmp_path, monkeypatch):
    """ENOSPC injected where DCP opens its files (the job service's test fills a real tmpfs instead): the run
    fails naming the cause, the failed save's files are gone, the earlier checkpoints verify, and a resume
    from them reproduces the uninterrupted losses."""
    import errno
    from contextlib import contextmanager

    from torch.distributed.checkpoint.filesystem import FileSystem

    whole = run(tiny_paths, tmp_path / "whole", checkpoint_config={"checkpoint_interval_steps": 2})
    original = FileSystem.create_stream

    @contextmanager
    def full_disk(self, path, mode):
        if "step-00000006" in str(path) and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        with original(self, path, mode) as stream:
            yield stream

    monkeypatch.setattr(FileSystem, "create_stream", full_disk)
    ckpt = tmp_path / "run"
    with pytest.raises(Exception, match=r"checkpoint at step 6 could not be saved \(save failed: OSError: \[Errno 28\] "
                                        r"No space left on device.*newest COMPLETE checkpoint is step 4"):
        run(tiny_paths, ckpt, checkpoint_config={"checkpoint_interval_steps": 2})
    monkeypatch.undo()
    assert statuses(ckpt) == {2: "COMPLETE", 4: "COMPLETE", 6: "CORRUPT"}
    failed = dict((m.step, (p, m)) for p, m in list_checkpoints(ckpt))[6]
    assert failed[1].status_reason.startswith("save failed: OSError") and not (failed[0] / "model").exists()
    for step_dir, manifest in list_checkpoints(ckpt)[:2]:
        assert verify(step_dir, manifest) == []
    resumed = run(tiny_paths, ckpt, checkpoint_config={"checkpoint_interval_steps": 2})
    assert resumed.start_step == 4 and resumed.losses == {5: whole.losses[5], 6: whole.losses[6]}


@pytest.mark.parametrize("pickled_rng", [False, True], ids=["unsigned", "pickled_rng_states"])
def test_a_planted_pickle_checkpoint_is_refused_and_never_runs(tiny_paths, tmp_path, pickled_rng):
    """Issue 28: every launch resumed from the newest COMPLETE checkpoint in checkpoint_dir, and
    unpickled its manifest's RNG states and DCP's .metadata. A folder planted there (checksums
    consistent, as anyone writing it can make them) is refused before any of it is read."""
    ckpt, marker = tmp_path / "run", tmp_path / "payload-ran"
    run(tiny_paths, ckpt, checkpoint_config={"checkpoint_interval_steps": 2})
    plant(ckpt / "step-00000006", ckpt / "step-00000099", marker, pickled_rng)
    with pytest.raises(Exception, match="refusing to (load|use) checkpoint .*step-00000099") as info:
        run(tiny_paths, ckpt, optimization_config={"total_steps": 8, "warmup_steps": 2})
    assert "choose another checkpoint_dir" in str(info.value)
    assert not marker.exists(), "the planted pickle ran"
    assert statuses(ckpt)[6] == "COMPLETE" if not pickled_rng else True  # the job's own checkpoints untouched


def test_the_rng_states_are_plain_data_and_restore_exactly(tiny_paths, tmp_path):
    """The manifest's RNG states are JSON numbers (no pickle), and a resume from them reproduces
    the interrupted run's losses bit for bit."""
    ckpt = tmp_path / "run"
    whole = run(tiny_paths, ckpt, checkpoint_config={"checkpoint_interval_steps": 2})
    rng = json.loads((ckpt / "step-00000004" / "manifest.json").read_text())["rng_states"][0]
    assert len(rng["numpy_rng_state"]["keys"]) == 624 and len(rng["python_rng_state"]["state"]) == 625
    for step in (6,):
        (ckpt / f"step-{step:08d}" / "manifest.json").unlink()
    again = run(tiny_paths, ckpt)
    assert again.start_step == 4 and again.losses == {5: whole.losses[5], 6: whole.losses[6]}


def test_a_resume_with_dropout_reproduces_the_run_only_with_its_rng_restored(tiny_paths, tmp_path, monkeypatch):
    """Attention dropout draws from torch's RNG at every step, so the losses after a resume equal
    the uninterrupted run's only if the checkpoint's RNG state is restored — the randomness of
    steps 5 and 6 is that of the run's own steps, not of a fresh start's. Without the restore
    (the second half) the resumed steps draw other masks and their losses differ."""
    from pagedllm.training import checkpoint

    model = {"attention_dropout": 0.2}
    ckpt = tmp_path / "run"
    whole = run(tiny_paths, ckpt, model_config=model, checkpoint_config={"checkpoint_interval_steps": 2})
    (ckpt / "step-00000006" / "manifest.json").unlink()
    again = run(tiny_paths, ckpt, model_config=model)
    assert again.start_step == 4 and again.losses == {5: whole.losses[5], 6: whole.losses[6]}
    monkeypatch.setattr(checkpoint, "restore_rng", lambda record: None)
    (ckpt / "step-00000006" / "manifest.json").unlink()
    forgetful = run(tiny_paths, ckpt, model_config=model)
    assert forgetful.start_step == 4 and forgetful.losses[5] != whole.losses[5]
