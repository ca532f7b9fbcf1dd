"""The training loop: one process per rank, all ranks running `Trainer.run` in lock-step.

Per step: set the learning rate of the step -> forward/backward over this rank's microbatches (a
plain gradient-accumulation loop, or the pipeline schedule) -> clip the global gradient norm ->
optimizer step -> metrics -> at the step boundary, one collective decision (signals, request files,
checkpoint intervals) on whether to checkpoint or stop. Everything the outside world may read is
described in progress.py (metrics, events) and control.py (signals, request files).
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pagedllm.training.chat_data import IGNORE
from pagedllm.training.checkpoint import CheckpointManager, CheckpointMetadata, step_dir_name
from pagedllm.training.config import Precision, TrainingJob, resolve
from pagedllm.training.control import Controller, Decision
from pagedllm.spec_decode import draft_vocab
from pagedllm.training.data import TrainingData, build_cache, default_cache_dir
from pagedllm.training.export import export_checkpoint
from pagedllm.training.host_memory import fix_mmap_threshold
from pagedllm.training.provenance import continue_job, write_job_file
from pagedllm.training.model import build_model, flops_per_token, num_params
from pagedllm.training.optim import build_optimizer, clip_grad_norm, lr_at, set_lr
from pagedllm.training.parallel import (
    LOW_PRECISION,
    ParallelDims,
    autocast_dtype,
    data_parallel_wrapping,
    parallelize,
    requires_sync_every_microbatch,
    reshard,
)
from pagedllm.training.pipeline import build_pipeline
from pagedllm.training.progress import EventLog, ProgressReporter, plot_loss_curve, truncate_after
from pagedllm.training.run_options import RunOptions
from pagedllm.training.tokenizer import tokenizer_files

log = logging.getLogger("pagedllm.training")

EXIT_COMPLETED = 0
EXIT_FAILED = 1
EXIT_CONFIG_ERROR = 2


@dataclass
class RunResult:
    start_step: int
    final_step: int
    reason: str  # "completed" or "stopped"
    exit_code: int
    losses: dict[int, float] = field(default_factory=dict)
    val_loss: float | None = None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def packed_width(segments: torch.Tensor) -> int:
    """Columns of packed rows that hold any example (padding, segment -1, is each row's tail): a
    micro-batch is computed that wide, not on the padding every row shares."""
    return max(1, int((segments != -1).sum(dim=1).max()))


def init_distributed() -> bool:
    """Join torchrun's process group, or make a one-process group; True if this call created it."""
    if dist.is_initialized():
        return False
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


class Trainer:
    def __init__(self, job: TrainingJob, options: RunOptions) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if job.finetune is not None:  # model_config from the base model (training/pretrained.py)
            from pagedllm.training.pretrained import apply_base_model

            job = apply_base_model(job)
        self.job = resolve(continue_job(job), self.world)
        self.options = options
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if self.device.type == "cpu":  # PAGEDLLM_MALLOC_MMAP_THRESHOLD: freed tensors go back to the OS (host_memory.py)
            fix_mmap_threshold()
        self.dims = ParallelDims.from_config(self.job.parallelism)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.dir = self.job.checkpoint_dir
        events_path = options.events_file or self.dir / "events.jsonl"
        self.events = EventLog(events_path, str(self.job.job_id), self.rank)
        torch.manual_seed(self.job.seed)
        self.data = self._prepare_data()
        self.scaler = self._grad_scaler()  # before the model: a pipeline's loss function scales by it
        self._pipeline_sums = False  # _pipeline_loss: a fine-tune's evaluation sums over tokens
        self._build_model()
        self.ckpt = CheckpointManager(self.job.checkpoint, self.job.job_id, self.job.model_dump_json(indent=2), self.parts,
                                      self.optimizers, self._scaler_state, self._load_scaler_state, on_event=self.events.emit)
        self.controller = Controller(self.dir / "control", self.job.checkpoint.checkpoint_interval_minutes, self.rank)
        self.tokens_per_step = self.job.data.global_batch_size * self.job.data.sequence_length
        self.flops_per_token = flops_per_token(self.job.model, self.job.data.sequence_length)

    # ---- set-up ----

    def _prepare_data(self) -> TrainingData:
        """The local rank 0 of each node tokenizes into the cache; the others wait and read it."""
        if self.job.finetune is not None:
            return self._prepare_chat_data()
        data = self.job.data
        cache = Path(data.cache_dir) if data.cache_dir else default_cache_dir()
        if self.rank == 0:
            (self.dir / "control").mkdir(parents=True, exist_ok=True)
            write_job_file(self.job)
            self._copy_tokenizer()
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            build_cache(data, cache)
        dist.barrier()
        dp_rank = self.mesh["dp"].get_local_rank()
        return TrainingData(data, build_cache(data, cache), dp_rank, self.dims.dp, self.job.seed)

    def _prepare_chat_data(self):
        """A fine-tune's chat examples, tokenized with the base model's tokenizer, which rank 0 also
        keeps next to the checkpoints (export and the written model folders take it from there)."""
        from pagedllm.training.chat_data import ChatData
        from pagedllm.training.pretrained import base_tokenizer, write_tokenizer

        tokenizer = base_tokenizer(self.job.finetune.base_model)
        if self.rank == 0:
            (self.dir / "control").mkdir(parents=True, exist_ok=True)
            write_job_file(self.job)
            write_tokenizer(tokenizer, self.dir / "tokenizer")
        dist.barrier()
        return ChatData(self.job.data, tokenizer, self.mesh["dp"].get_local_rank(), self.dims.dp, self.job.seed)

    def _copy_tokenizer(self) -> None:
        """Keep the tokenizer next to the checkpoints, so export works after the corpus folder moves."""
        out = self.dir / "tokenizer"
        out.mkdir(exist_ok=True)
        tokenizer_json, config_json = tokenizer_files(self.job.data.tokenizer_path)
        if tokenizer_json.resolve() == (out / "tokenizer.json").resolve():
            return  # the job already points at this copy
        shutil.copyfile(tokenizer_json, out / "tokenizer.json")
        if config_json is not None:
            shutil.copyfile(config_json, out / "tokenizer_config.json")

    def _build_model(self) -> None:
        """Every rank builds the same full model from the seed, then keeps and shards its part."""
        if self.job.finetune is not None:
            from pagedllm.training.finetune import build_finetune_model

            model = build_finetune_model(self.job.model, self.job.finetune).to(self.device)
        else:
            model = build_model(self.job.model, self.job.seed).to(self.device)
        self.pipeline = None
        if self.dims.pp > 1:
            data = self.job.data
            microbatches = data.global_batch_size // (data.micro_batch_size * self.dims.dp)
            self.pipeline = build_pipeline(model, self.job.parallelism, self.job.memory, microbatches, self.dims, self.mesh,
                                           self.device, self._pipeline_loss)
            self.parts = self.pipeline.parts
            if self.job.model.architecture == "moe" and self.job.model.router_aux_loss_coef > 0:
                from pagedllm.training.moe_pipeline import add_balance_loss_gradients

                scale = lambda: self.scaler.get_scale() if self.scaler is not None else 1.0  # noqa: E731
                for part in self.parts:
                    add_balance_loss_gradients(part, self.job.model.router_aux_loss_coef, self.job.model.num_layers, scale)
        else:
            self.parts = [parallelize(model, self.job.parallelism, self.job.memory, self.dims, self.mesh)]
        self.optimizers = [build_optimizer(part, self.job.optimization) for part in self.parts]
        if self.job.memory.nvme_offload:
            from pagedllm.training.nvme_offload import NvmeOffloadOptimizer, offload_folder

            folder = self.job.memory.nvme_offload_dir
            self.optimizers = [NvmeOffloadOptimizer(optimizer, offload_folder(self.dir, folder, self.rank, i))
                               for i, optimizer in enumerate(self.optimizers)]
        dtype = autocast_dtype(self.job.memory, self.dims)
        self.autocast = (lambda: torch.autocast(self.device.type, dtype=dtype)) if dtype else nullcontext

    def _pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss; FP16 scales it there, since the schedule runs the backward itself.
        A fine-tune's labels are IGNORE off the assistant's tokens: the mean is over the trained tokens,
        as one process's. While a fine-tune evaluates (`_pipeline_sums`), the unscaled sum instead."""
        if self._pipeline_sums:
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
        loss = cross_entropy(logits, labels)
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def _grad_scaler(self):
        if self.job.memory.precision is not Precision.FP16:
            return None
        if self.dims.pp > 1:
            # every stage must skip (or take) the same step: found_inf is all-reduced over every rank
            # (pipeline stages, replicas and tensor shards), which ShardedGradScaler does over its group
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler(device=self.device.type, process_group=dist.group.WORLD)
            scaler.scale(torch.zeros((), device=self.device))  # creates the scale on stages that compute no loss
            return scaler
        if data_parallel_wrapping(self.job.memory, self.dims) is not None:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(device=self.device.type, process_group=self.dims.data_parallel_mesh(self.mesh).get_group())
        return torch.amp.GradScaler(self.device.type)

    def _scaler_state(self) -> dict:
        return {"grad_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def _load_scaler_state(self, state: dict) -> None:
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])

    # ---- one step ----

    def train_step(self, step: int) -> tuple[float, float]:
        """Forward/backward/optimizer for global step `step`; returns (mean loss, grad norm)."""
        inputs, labels, *segments = (self._local_sequence(t.to(self.device)) for t in self.data.step_batch(step))
        packed = segments[0] if segments else None  # a fine-tune's example boundaries
        if self.pipeline is not None:
            loss = self._pipeline_forward_backward(inputs, labels, packed)
        else:
            loss = self._accumulate(inputs, labels, packed)
        if self.scaler is not None:
            for optimizer in self.optimizers:
                self.scaler.unscale_(optimizer)
        pp_group = self.mesh["pp"].get_group() if self.dims.pp > 1 else None
        ep_group = self.mesh["ep"].get_group() if self.dims.ep > 1 else None
        grad_norm = clip_grad_norm(self.parts, self.job.optimization.gradient_clipping, pp_group, ep_group)
        for optimizer in self.optimizers:
            if self.scaler is not None:
                self.scaler.step(optimizer)
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.update()
        return self._global_mean(loss), grad_norm

    def _local_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """With context parallelism, this rank's load-balanced chunks of each sequence (inputs and
        labels alike: a rank's loss is the mean over its tokens, all ranks holding as many)."""
        if self.dims.cp == 1:
            return t
        from pagedllm.training.context_parallel import shard_sequence

        return shard_sequence(t, self.mesh["cp"].get_local_rank(), self.dims.cp)

    def _accumulate(self, inputs: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """Gradient accumulation over micro_batch_size chunks; gradients average over all of them.
        `segments`: packed fine-tuning examples (no attention across them; labels -100 are not trained)."""
        model = self.parts[0]
        micro = self.job.data.micro_batch_size
        count = inputs.shape[0] // micro
        sync_each = requires_sync_every_microbatch(self.job.memory)
        wrapped = data_parallel_wrapping(self.job.memory, self.dims) is not None
        total = torch.zeros((), device=self.device)
        for i in range(count):
            if wrapped:
                model.set_requires_gradient_sync(sync_each or i == count - 1)
            chunk = slice(i * micro, (i + 1) * micro)
            with self.autocast():
                if segments is None:
                    loss = cross_entropy(model(inputs[chunk]), labels[chunk])
                else:  # only the trained positions reach the output layer (the same mean over them)
                    width = packed_width(segments[chunk]) if self.dims.cp == 1 else inputs.shape[1]  # CP: chunks, not a tail
                    part = (slice(i * micro, (i + 1) * micro), slice(0, width))
                    keep = labels[part] != IGNORE
                    loss = model(inputs[part], segments[part], keep, labels[part][keep])
                aux = model.moe_aux_loss()
                objective = loss + self.job.model.router_aux_loss_coef * aux if aux is not None else loss
            objective = objective / count
            (self.scaler.scale(objective) if self.scaler is not None else objective).backward()
            total += loss.detach()
        return total / count

    def _pipeline_forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor,
                                   segments: torch.Tensor | None = None) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        self._run_schedule(self.pipeline.schedule.step, inputs, labels, losses, segments)
        if self.pipeline.tied is not None:
            self.pipeline.tied.all_reduce()
        return self._from_last_stage(losses)

    def _run_schedule(self, fn, inputs: torch.Tensor, labels: torch.Tensor, losses: list,
                      segments: torch.Tensor | None = None) -> None:
        """`segments` (packed fine-tuning rows) go to every stage as a keyword argument, which the
        schedule cuts into microbatches like the inputs: each stage's attention needs the boundaries."""
        pipe = self.pipeline
        target = labels if pipe.has_last_stage else None
        args = (inputs,) if pipe.has_first_stage else ()
        kwargs = {"segments": segments} if segments is not None else {}
        with self.autocast():
            fn(*args, target=target, losses=losses, **kwargs)

    def _from_last_stage(self, losses: list[torch.Tensor], reduce: str = "mean") -> torch.Tensor:
        """The mean (or sum) of the microbatch losses, computed on the last stage, broadcast to every pipeline rank."""
        pipe = self.pipeline
        loss = torch.zeros((), device=self.device)
        if pipe.has_last_stage:
            stacked = torch.stack([l.detach().float() for l in losses])
            loss = stacked.sum() if reduce == "sum" else stacked.mean()
            if self.scaler is not None and reduce == "mean":
                loss = loss / self.scaler.get_scale()  # _pipeline_loss scaled each microbatch's loss
        last_rank = (pipe.num_stages - 1) % self.dims.pp
        dist.broadcast(loss, group=self.mesh["pp"].get_group(), group_src=last_rank)
        return loss

    def _global_mean(self, loss: torch.Tensor) -> float:
        """Average over data-parallel replicas and context-parallel ranks (gloo has no AVG: sum, then divide)."""
        loss = loss.detach().float().clone()
        replicas = self.dims.dp * self.dims.cp
        if replicas > 1:
            dist.all_reduce(loss, group=self.dims.data_parallel_mesh(self.mesh).get_group())
            loss /= replicas
        return float(loss)

    def evaluate(self) -> float | None:
        """Mean loss over the fixed validation windows, split across data-parallel ranks, with
        dropout off (eval mode) and no draw from the RNG the training steps use."""
        for part in self.parts:
            part.eval()
        try:
            return self._validation_loss()
        finally:
            for part in self.parts:
                part.train()

    @torch.no_grad()
    def _validation_loss(self) -> float | None:
        indices = self.data.val_indices()
        if self.job.finetune is not None:
            return self._evaluate_chat(indices)
        per_chunk = self.job.data.global_batch_size // self.dims.dp
        chunks = len(indices) // per_chunk
        if chunks == 0:
            return None
        total = torch.zeros((), device=self.device)
        for c in range(chunks):
            inputs, labels = self.data.val.batch(indices[c * per_chunk:(c + 1) * per_chunk])
            inputs, labels = self._local_sequence(inputs.to(self.device)), self._local_sequence(labels.to(self.device))
            if self.pipeline is not None:
                losses: list[torch.Tensor] = []
                self._run_schedule(self.pipeline.schedule.eval, inputs, labels, losses)
                total += self._from_last_stage(losses)
            else:
                total += self._eval_chunk(inputs, labels)
        reshard(self.parts)
        return self._global_mean(total / chunks)

    def _evaluate_chat(self, indices) -> float | None:
        """Mean loss per assistant token over every validation row (a fine-tune's split may be smaller than
        a batch). Every data-parallel rank runs as many batches (FSDP's forwards are collective), the
        largest share's; shorter shares and batches are filled with rows that train no token."""
        micro = self.job.data.micro_batch_size
        if self.pipeline is not None:  # the schedule takes whole batches of its microbatch count
            micro *= self.pipeline.microbatches
        largest_share = -(-self.data.val_rows() // self.dims.dp)
        total, count = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        for start in range(0, largest_share, micro):
            inputs, labels, segments = (t.to(self.device) for t in self.data.val.batch(indices[start:start + micro]))
            total += self._chat_loss_sum(inputs, labels, segments, micro)
            count += (labels != IGNORE).sum()
        reshard(self.parts)
        if self.dims.dp > 1:
            dist.all_reduce(total, group=self.mesh["dp"].get_group())
            dist.all_reduce(count, group=self.mesh["dp"].get_group())
        return float(total / count) if count > 0 else None

    def _chat_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor, rows: int) -> torch.Tensor:
        """Summed loss over the assistant tokens of these rows, run as a batch of `rows` (the pipeline
        needs whole batches): a short one is filled with rows that have no trained token (padding, its own segment)."""
        missing = rows - inputs.shape[0]
        if missing:
            inputs, labels, segments = (torch.cat([t, t.new_full((missing, t.shape[1]), fill)])
                                        for t, fill in ((inputs, 0), (labels, IGNORE), (segments, -1)))
        if self.pipeline is None:
            with self.autocast():
                logits = self.parts[0](inputs, segments)
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
        losses: list[torch.Tensor] = []
        self._pipeline_sums = True
        try:
            self._run_schedule(self.pipeline.schedule.eval, inputs, labels, losses, segments)
        finally:
            self._pipeline_sums = False
        return self._from_last_stage(losses, reduce="sum")

    def _eval_chunk(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        micro = self.job.data.micro_batch_size
        count = inputs.shape[0] // micro
        total = torch.zeros((), device=self.device)
        for i in range(count):
            chunk = slice(i * micro, (i + 1) * micro)
            with self.autocast():
                total += cross_entropy(self.parts[0](inputs[chunk]), labels[chunk])
        return total / count

    # ---- the loop ----

    def run(self) -> RunResult:
        resumed = self.ckpt.load(self.options.resume_from)
        start = resumed.step if resumed else 0
        consumed = resumed.metadata.consumed_tokens if resumed else 0
        elapsed_before = resumed.metadata.elapsed_time_seconds if resumed else 0.0
        peak = self._peak_flops()
        total = self.job.optimization.total_steps
        if self.rank == 0:
            truncate_after(self.dir / "metrics.jsonl", start)
        self._emit_started(start, resumed)
        reporter = ProgressReporter(self.dir, total, start, self.job.log_interval_steps, self.rank == 0)
        reporter.info(self._banner(start, resumed))
        result = RunResult(start_step=start, final_step=start, reason="completed", exit_code=EXIT_COMPLETED)
        self.last_saved = start if resumed else -1
        began = time.perf_counter()
        self.controller.install_signal_handlers()
        try:
            step = start
            while step < total:
                step += 1
                lr = lr_at(step, self.job.optimization)
                set_lr(self.optimizers, lr)
                t0 = time.perf_counter()
                loss, grad_norm = self.train_step(step)
                seconds = time.perf_counter() - t0
                consumed += self.tokens_per_step
                record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                          "tokens_per_s": self.tokens_per_step / seconds, "consumed_tokens": consumed,
                          "mfu": self.tokens_per_step * self.flops_per_token / seconds / peak,
                          "elapsed_s": round(elapsed_before + time.perf_counter() - began, 3)}
                if self._eval_due(step):
                    val = self.evaluate()
                    if val is not None:
                        record["val_loss"] = result.val_loss = val
                reporter.step(record)
                self.events.emit("step", **record)
                result.losses[step] = loss
                result.final_step = step
                self.ckpt.poll()
                metadata = CheckpointMetadata(loss=loss, learning_rate=lr, global_step=step, consumed_tokens=consumed,
                                              elapsed_time_seconds=elapsed_before + time.perf_counter() - began)
                decision = self.controller.decide(step, self.options.stop_at_step)
                if decision.stop:
                    self._stop(decision, metadata, result, reporter)
                    break
                interval = self.job.checkpoint.checkpoint_interval_steps
                if decision.checkpoint or (interval and step % interval == 0):
                    self._save(step, metadata, decision.checkpoint_id)
            else:
                self._finish(result, consumed, elapsed_before + time.perf_counter() - began, reporter)
        finally:
            self.controller.restore_signal_handlers()
            reporter.close()
        self.ckpt.wait()
        self.events.emit("finished", reason=result.reason, step=result.final_step, exit_code=result.exit_code)
        return result

    def _eval_due(self, step: int) -> bool:
        every = self.job.data.eval_interval_steps
        return self.job.data.validation_split > 0 and (step == self.job.optimization.total_steps or bool(every and step % every == 0))

    def _save(self, step: int, metadata: CheckpointMetadata, checkpoint_id=None, blocking: bool = False) -> None:
        if step == self.last_saved:
            return
        self.ckpt.save(step, metadata, checkpoint_id, blocking=blocking)
        self.last_saved = step
        self.controller.checkpoint_saved()

    def _stop(self, decision: Decision, metadata: CheckpointMetadata, result: RunResult, reporter: ProgressReporter) -> None:
        self.events.emit("stopping", step=metadata.global_step, signal=decision.stop_signal)
        wanted = self.job.checkpoint.checkpoint_on_stop and decision.checkpoint_on_stop
        if wanted or decision.checkpoint:  # a checkpoint requested at the same boundary is still honoured
            self._save(metadata.global_step, metadata, decision.checkpoint_id, blocking=True)
        result.reason = "stopped"
        result.exit_code = 128 + decision.stop_signal if decision.stop_signal else EXIT_COMPLETED
        reporter.info(f"stopped at step {metadata.global_step}" + (f" on signal {decision.stop_signal}" if decision.stop_signal else ""))

    def _finish(self, result: RunResult, consumed: int, elapsed: float, reporter: ProgressReporter) -> None:
        """Completed: final checkpoint, Hugging Face export to hf-final, loss curve."""
        step = result.final_step
        last_loss = result.losses.get(step)
        metadata = CheckpointMetadata(loss=last_loss, learning_rate=lr_at(step, self.job.optimization), global_step=step,
                                      consumed_tokens=consumed, elapsed_time_seconds=elapsed)
        self._save(step, metadata, blocking=True)
        self.ckpt.wait()
        if self.job.finetune is not None:
            self._export_finetune(step, reporter)
        elif self.rank == 0:
            if self.options.export_hf:
                out = export_checkpoint(self.dir / step_dir_name(step), self.dir / "hf-final")
                draft_vocab.write(out, draft_vocab.rank_tokens(self.data.train.tokens, self.job.model.vocab_size),
                                  len(self.data.train.tokens))  # for serving this model as a draft
                reporter.info(f"exported Hugging Face folder {out}")
                self.events.emit("exported", path=str(out))
            plot_loss_curve(self.dir / "metrics.jsonl", self.dir / "loss_curve.png", self.job.job_name)
        dist.barrier()

    def _export_finetune(self, step: int, reporter: ProgressReporter) -> None:
        """A LoRA / QLoRA job's PEFT adapter folder (adapter-final), a full fine-tune's Hugging Face folder
        (hf-final). Without pipeline stages every rank gathers the whole model (tensor-parallel shards
        are DTensors); with them the stages live on different ranks, and the final checkpoint, which
        holds them all, is exported by rank 0 as `pagedllm export` would."""
        from pagedllm.training.export import write_hf_folder
        from pagedllm.training.finetune import write_adapter
        from pagedllm.training.lora import adapter_state, merged_state

        ft = self.job.finetune
        state = None
        if self.pipeline is None:
            state = adapter_state(self.parts[0]) if ft.adapter else merged_state(self.parts[0])  # every rank gathers
        if self.rank != 0:
            return
        if self.options.export_hf:
            folder = self.dir / ("adapter-final" if ft.adapter else "hf-final")
            if state is None:
                out = export_checkpoint(self.dir / step_dir_name(step), folder)
            elif ft.adapter:
                out = write_adapter(state, ft, folder)
            else:
                out = write_hf_folder(state, self.job.model, self.dir / "tokenizer", folder)
            reporter.info(f"exported {'PEFT adapter' if ft.adapter else 'Hugging Face'} folder {out}")
            self.events.emit("exported", path=str(out))
        plot_loss_curve(self.dir / "metrics.jsonl", self.dir / "loss_curve.png", self.job.job_name)

    def _peak_flops(self) -> float:
        """Per-process matmul peak on the training device in the compute dtype; MFU divides achieved
        FLOP/s by the sum over ranks."""
        if self.options.peak_flops:
            per_rank = self.options.peak_flops
        else:
            from pagedllm.matmul_peak import measure_matmul_peak

            low = LOW_PRECISION.get(self.job.memory.precision)  # bf16/fp16 runs: that dtype's peak
            per_rank = measure_matmul_peak(dtype=low or torch.float32, device=self.device)
        peak = torch.tensor([per_rank], dtype=torch.float64)
        dist.all_reduce(peak)
        return float(peak)

    def _emit_started(self, start: int, resumed) -> None:
        info = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname()}
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, info)
        self.events.emit("started", step=start, total_steps=self.job.optimization.total_steps, world_size=self.world,
                         resumed_from=str(resumed.checkpoint_id) if resumed else None, processes=gathered,
                         parallelism={"pp": self.dims.pp, "dp": self.dims.dp, "tp": self.dims.tp,
                                                              "ep": self.dims.ep, "cp": self.dims.cp},
                         checkpoint_dir=str(self.dir))

    def _banner(self, start: int, resumed) -> str:
        mem = self.job.memory
        text = (f"job {self.job.job_name} ({self.job.job_id}): {self.job.model.architecture} with "
                f"{num_params(self.job.model) / 1e6:.2f}M parameters, world {self.world} = pp {self.dims.pp} x "
                f"dp {self.dims.dp} x tp {self.dims.tp} x cp {self.dims.cp} (ep {self.dims.ep}), zero_stage {mem.zero_stage}, {mem.precision.value}, "
                f"steps {start + 1}..{self.job.optimization.total_steps}")
        if resumed:
            text += f", resumed from step {resumed.step} ({resumed.checkpoint_id})"
        return text


def run_training(job: TrainingJob, options: RunOptions | None = None) -> RunResult:
    """Run `job` in this process as one rank (of torchrun's group, or alone)."""
    created = init_distributed()
    ok = False
    try:
        result = Trainer(job, options or RunOptions()).run()
        ok = True
        return result
    finally:
        if created:
            if ok:
                dist.barrier()  # no rank tears gloo down while another still talks to it
            dist.destroy_process_group()
