"""Which rows of a step need logits, and bringing their results to the host in one copy.

Logits are computed only for rows that sample (a sequence's last scheduled position, or every
position of a decode that verifies proposals) and rows whose prompt logprobs were asked for. The
sampled tokens, their logprobs, ranks and top-N, and every prompt logprob are packed into one
float64 tensor (token ids are exact in float64) and read back with a single `.tolist()`: one
device->host synchronisation per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.layers.sampler import SamplerOutput
from pagedllm.step.runner_output import ModelRunnerOutput, SampledToken
from pagedllm.worker.input_batch import BatchChunk, BatchLayout
from pagedllm.worker.sampling_inputs import SampleRow
from pagedllm.worker.staging import Staging


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


def fetch_results(groups: list[tuple[list[SampleRow], SamplerOutput]], scored: SamplerOutput | None, prompt: PromptRows) -> ModelRunnerOutput:
    """`groups`: sample rows with their sampler output over their logit rows (a row with k
    proposals owns k + 1 of them, whose tokens end at the first -1)."""
    outs = [out for _, out in groups] + ([scored] if scored is not None else [])
    if not outs:
        return ModelRunnerOutput()
    parts = [_columns(out) for out in outs]
    values = torch.cat([p.reshape(-1) for p in parts]).tolist()  # the step's one device->host copy
    result = ModelRunnerOutput()
    offset = 0
    for (samples, _), part in zip(groups, parts):
        width = part.shape[1]
        for sample in samples:
            tokens = result.sampled.setdefault(sample.seq_id, [])
            for _ in range(1 + len(sample.spec_token_ids)):
                if values[offset] >= 0:
                    tokens.append(_entry(values, offset, width, sample.params.logprobs))
                offset += width
    if scored is not None:
        width = parts[-1].shape[1]
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
