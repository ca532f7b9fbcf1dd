"""Which rows of a step need logits, and bringing their results to the host in one copy.

Logits are computed only for rows that sample (a sequence's last scheduled position, or every
position of a decode that verifies proposals) and rows whose prompt logprobs were asked for. The
sampled tokens, their logprobs, ranks and top-N, and every prompt logprob are packed into one
float64 tensor (token ids are exact in float64) and read back with a single `.tolist()`: one
device->host synchronisation per step. The copy is started when the step is launched and waited
for only when its results are asked for (`StepResults.result()`), so under async scheduling the
host works on the previous step meanwhile.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from pagedllm.layers.sampler import SamplerOutput
from pagedllm.step.runner_output import ModelRunnerOutput, SampledToken
from pagedllm.worker.input_batch import BatchChunk, BatchLayout
from pagedllm.worker.sampling_inputs import SampleRow
from pagedllm.worker.staging import Staging


class StepResults(Protocol):
    """A launched step's results, on their way to the host."""

    def result(self) -> ModelRunnerOutput: ...


@dataclass
class ReadyResults:
    """Results already on the host."""

    output: ModelRunnerOutput

    def result(self) -> ModelRunnerOutput:
        return self.output


class PackedResults:
    """One flat tensor of a step's results, copied to the host as soon as the device has it
    (pinned memory, asynchronously on CUDA), and turned into the runner's output when asked."""

    def __init__(self, packed: torch.Tensor, unpack: Callable[[list[float]], ModelRunnerOutput]):
        self._unpack = unpack
        self._event = None
        if packed.device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = packed

    def result(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
        return self._unpack(self._host.tolist())  # the step's one device->host synchronisation


@dataclass
class PromptRows:
    """Prompt positions scored this step, in row order: (seq id, top-N, number of positions)."""

    entries: list[tuple[int, int, int]] = field(default_factory=list)
    max_num: int = 0


def stage_logit_rows(chunks: list[BatchChunk], layout: BatchLayout, staging: Staging, groups: list[list[SampleRow]]) -> PromptRows:
    """Logit rows in order: each group's sample rows (a row with k proposals takes its chunk's
    k + 1 rows), then the prompt positions scored."""
    rows: list[int] = []
    for group in groups:
        for sample in group:
            last = layout.last_rows[sample.chunk]
            rows.extend(range(last - len(sample.spec_token_ids), last + 1))
    targets: list[int] = []
    prompt = PromptRows()
    for index, chunk in enumerate(chunks):
        wanted = chunk.prompt_logprobs
        if wanted is None:
            continue
        first = layout.first_rows[index] + wanted.start - chunk.start
        rows.extend(range(first, first + len(wanted.targets)))
        targets.extend(wanted.targets)
        prompt.entries.append((chunk.seq_id, wanted.num, len(wanted.targets)))
        prompt.max_num = max(prompt.max_num, wanted.num)
    staging.add("logit_rows", rows)
    if targets:
        staging.add("prompt_targets", targets)
    return prompt


def score_prompt_tokens(logits: torch.Tensor, targets: torch.Tensor | None, prompt: PromptRows) -> SamplerOutput | None:
    """Logprob, rank and top-N of each prompt token under the raw distribution."""
    if targets is None:
        return None
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
    scored = SamplerOutput(targets, chosen, (logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1)
    if prompt.max_num > 0:
        scored.top_logprobs, scored.top_ids = logprobs.topk(prompt.max_num, dim=-1)
    return scored


def _columns(out: SamplerOutput) -> torch.Tensor:
    """[R, width] float64: token, logprob, then (if computed) rank, top ids, top logprobs."""
    columns = [out.token_ids.unsqueeze(1), out.logprobs.unsqueeze(1)]
    if out.ranks is not None:
        columns.append(out.ranks.unsqueeze(1))
    if out.top_ids is not None:
        columns += [out.top_ids, out.top_logprobs]
    return torch.cat([c.to(torch.float64) for c in columns], dim=1)


def pack_results(groups: list[tuple[list[SampleRow], SamplerOutput]], scored: SamplerOutput | None,
                 prompt: PromptRows) -> StepResults:
    """`groups`: sample rows with their sampler output over their logit rows (a row with k
    proposals owns k + 1 of them, whose tokens end at the first -1)."""
    outs = [out for _, out in groups] + ([scored] if scored is not None else [])
    if not outs:
        return ReadyResults(ModelRunnerOutput())
    parts = [_columns(out) for out in outs]
    widths = [part.shape[1] for part in parts]
    samples = [rows for rows, _ in groups]
    return PackedResults(torch.cat([p.reshape(-1) for p in parts]),
                         lambda values: _unpack(values, samples, widths, scored is not None, prompt))


def _unpack(values: list[float], groups: list[list[SampleRow]], widths: list[int], scored: bool,
            prompt: PromptRows) -> ModelRunnerOutput:
    result = ModelRunnerOutput()
    offset = 0
    for samples, width in zip(groups, widths):
        for sample in samples:
            tokens = result.sampled.setdefault(sample.seq_id, [])
            for _ in range(1 + len(sample.spec_token_ids)):
                if values[offset] >= 0:
                    tokens.append(_entry(values, offset, width, sample.params.logprobs))
                offset += width
    if scored:
        width = widths[-1]
        for seq_id, num, count in prompt.entries:
            result.prompt_logprobs[seq_id] = [_entry(values, offset + i * width, width, num) for i in range(count)]
            offset += count * width
    return result


def _entry(values: list[float], start: int, width: int, num: int | None) -> SampledToken:
    token, logprob = int(values[start]), values[start + 1]
    if num is None:
        return SampledToken(token, logprob)
    top_n = (width - 3) // 2
    ids = values[start + 3 : start + 3 + top_n][:num]
    logprobs = values[start + 3 + top_n : start + width][:num]
    return SampledToken(token, logprob, int(values[start + 2]), [(int(t), v) for t, v in zip(ids, logprobs)])
