"""Outside control of a running job, acted on at step boundaries by every rank together.

* SIGTERM / SIGINT: stop at the next step boundary (saving a checkpoint when checkpoint_on_stop),
  then exit with 128 + signal number. A signal repeated more than 5 s later interrupts at once.
* `<checkpoint_dir>/control/checkpoint.request`: save a checkpoint at the next step boundary. The file
  may hold {"checkpoint_id": "<uuid>"} to choose the id (write it elsewhere, then rename it into place).
* `<checkpoint_dir>/control/stop`: stop at the next step boundary like SIGTERM, but exit 0. It may
  hold {"checkpoint": false} to skip the final checkpoint.

Rank 0 reads (and removes) the files; any rank may have caught a signal. One all-reduce per step
makes every rank see the same requests, so all of them save or stop at the same step.
"""
from __future__ import annotations

import json
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

CHECKPOINT_REQUEST = "checkpoint.request"
STOP_REQUEST = "stop"
REPEAT_GRACE_S = 5.0


@dataclass
class Decision:
    """What all ranks do at this step boundary."""

    stop: bool = False
    stop_signal: int = 0  # the signal that asked to stop, 0 for the stop file / --stop-at-step
    checkpoint: bool = False
    checkpoint_id: uuid.UUID | None = None
    checkpoint_on_stop: bool = True


class Controller:
    def __init__(self, control_dir: Path, interval_minutes: float | None, rank: int, group=None) -> None:
        self.dir = control_dir
        self.interval_s = interval_minutes * 60 if interval_minutes else None
        self.rank, self.group = rank, group
        self.signal_received = 0
        self.signal_time = 0.0
        self.last_checkpoint_time = time.monotonic()
        self._previous_handlers: dict[int, object] = {}

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

    def restore_signal_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame) -> None:
        """The first signal asks for a clean stop. Repeats within REPEAT_GRACE_S are the same request
        arriving twice (a signal to the whole process group and torchrun forwarding it); a later one
        means "now"."""
        now = time.monotonic()
        if self.signal_received and now - self.signal_time > REPEAT_GRACE_S:
            raise KeyboardInterrupt(f"signal {signum} again: stopping now")
        if not self.signal_received:
            self.signal_received, self.signal_time = signum, now

    def checkpoint_saved(self) -> None:
        self.last_checkpoint_time = time.monotonic()

    def decide(self, step: int, stop_at_step: int | None) -> Decision:
        """Collective: combine this rank's signal with rank 0's files and clock."""
        stop_file, checkpoint_id, checkpoint_file = self._read_files() if self.rank == 0 else (None, None, False)
        time_due = self.rank == 0 and self.interval_s is not None and time.monotonic() - self.last_checkpoint_time >= self.interval_s
        flags = torch.tensor([
            self.signal_received,
            int(stop_file is not None),
            int(stop_file is None or stop_file.get("checkpoint", True)),
            int(checkpoint_file or time_due),
        ])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        decision = Decision(stop_signal=int(flags[0]), checkpoint=bool(flags[3]))
        decision.stop = bool(flags[0] or flags[1]) or (stop_at_step is not None and step >= stop_at_step)
        decision.checkpoint_on_stop = bool(flags[2]) if flags[1] else True
        if decision.checkpoint:
            box = [checkpoint_id]  # rank 0's requested id (None = choose one); the others' is ignored
            dist.broadcast_object_list(box, src=0, group=self.group)
            decision.checkpoint_id = box[0]
        return decision

    def _read_files(self) -> tuple[dict | None, uuid.UUID | None, bool]:
        stop = _take(self.dir / STOP_REQUEST)
        request = _take(self.dir / CHECKPOINT_REQUEST)
        checkpoint_id = None
        if request is not None and request.get("checkpoint_id"):
            try:
                checkpoint_id = uuid.UUID(str(request["checkpoint_id"]))
            except ValueError:
                checkpoint_id = None
        return stop, checkpoint_id, request is not None


def _take(path: Path) -> dict | None:
    """Read and remove a request file: {} if empty or not JSON, None if absent."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    path.unlink(missing_ok=True)
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        value = {}
    return value if isinstance(value, dict) else {}
