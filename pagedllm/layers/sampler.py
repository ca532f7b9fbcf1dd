"""Token sampling for a step's rows: allowed tokens, logit bias, penalties, temperature,
top-k/top-p/min-p, seeds, logprobs.

The sampler sees tensors only (`SamplingMetadata`, built by the runner once per step), so it
runs where the logits are and never walks requests. Everything stays on the device; the runner
copies the results back once.

A random row's token is drawn by inverse transform sampling: one uniform number u a row, and the
first token whose cumulative probability exceeds u — on the CPU in one C kernel over the row
(csrc/categorical.c), elsewhere in torch (cumsum and searchsorted), the same token either way
but for rounding. A seeded sequence draws its number from its own generator — one draw per
sampled token — so it gets the same tokens whatever else shares the batch. Greedy rows draw
nothing. (The exponential race, argmax of p / E with E ~ Exp(1) a token, is what speculative
decoding's draft and rejection sampling draw with: `exponential_`, `exponential_noise`.)

Logprobs are those of the raw model distribution (before penalties and temperature), as vLLM
returns by default and as evaluation harnesses expect.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.layers import kernels


@dataclass
class Penalties:
    """Per-row penalty factors ([R]; 1 / 0 / 0 where off) and the (row, token) pairs they apply to."""

    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    seen: tuple[torch.Tensor, torch.Tensor]  # tokens of prompt + output (repetition penalty)
    output: tuple[torch.Tensor, torch.Tensor]  # one pair per output token (presence / frequency)
    banned: tuple[torch.Tensor, torch.Tensor]  # EOS / stop tokens before min_tokens is reached


@dataclass
class TokenChoices:
    """A request's own say over its tokens, applied before penalties (vLLM's order):
    `allowed_token_ids` (every other token of those rows gets -inf) and `logit_bias` (added)."""

    restricted_rows: torch.Tensor | None  # [Rr] rows limited to their allowed tokens
    allowed: tuple[torch.Tensor, torch.Tensor] | None  # (row, token) pairs those rows may sample
    bias: tuple[torch.Tensor, torch.Tensor] | None  # (row, token) pairs that get a bias
    bias_values: torch.Tensor | None  # [pairs] float


@dataclass
class SamplingMetadata:
    """How to sample each of a step's R rows. Tensors live on the logits' device."""

    num_rows: int
    random_rows: torch.Tensor | None = None  # [Rr] rows that sample; the others take the argmax
    temperature: torch.Tensor | None = None  # [Rr]
    top_k: torch.Tensor | None = None  # [Rr]; >= vocab where off. None: no row uses it
    top_p: torch.Tensor | None = None  # [Rr]; 1 where off
    min_p: torch.Tensor | None = None  # [Rr]; 0 where off
    unseeded: torch.Tensor | None = None  # positions among random rows that use the engine's generator
    seeded: list[tuple[int, torch.Generator]] = field(default_factory=list)  # (position, own generator)
    penalties: Penalties | None = None
    choices: TokenChoices | None = None  # allowed_token_ids / logit_bias
    # structured output: (rows, [rows, ceil(V/32)] int32 bitmask of the tokens allowed next)
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    max_num_logprobs: int | None = None  # ranks and top-N are computed when any row asks


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R]
    logprobs: torch.Tensor  # [R] raw logprob of each chosen token
    ranks: torch.Tensor | None = None  # [R], when logprobs were asked for
    top_ids: torch.Tensor | None = None  # [R, N]
    top_logprobs: torch.Tensor | None = None  # [R, N]


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition (prompt + output, transformers' rule), presence and frequency (output only,
    OpenAI's rule), then the min_tokens bans. Rows whose factors are off come out unchanged."""
    if penalties.seen[0].numel():
        seen = torch.zeros_like(logits, dtype=torch.bool).index_put_(penalties.seen, torch.ones_like(penalties.seen[0], dtype=torch.bool))
        factor = penalties.repetition.unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / factor, logits * factor), logits)
    if penalties.output[0].numel():
        counts = torch.zeros_like(logits).index_put_(penalties.output, torch.ones_like(penalties.output[0], dtype=logits.dtype), accumulate=True)
        logits = logits - (penalties.frequency.unsqueeze(1) * counts + penalties.presence.unsqueeze(1) * (counts > 0).to(logits.dtype))
    if penalties.banned[0].numel():
        logits = logits.index_put(penalties.banned, torch.full_like(penalties.banned[0], float("-inf"), dtype=logits.dtype))
    return logits


def apply_token_choices(logits: torch.Tensor, choices: TokenChoices) -> torch.Tensor:
    """allowed_token_ids first (a restricted row keeps only its tokens), then logit_bias."""
    if choices.restricted_rows is not None:
        banned = torch.zeros_like(logits, dtype=torch.bool)
        banned.index_fill_(0, choices.restricted_rows, True)
        banned.index_put_(choices.allowed, torch.zeros_like(choices.allowed[0], dtype=torch.bool))
        logits = logits.masked_fill(banned, float("-inf"))
    if choices.bias is not None:
        logits = logits.index_put(choices.bias, choices.bias_values.to(logits.dtype), accumulate=True)
    return logits


def apply_allowed(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Tokens a row's grammar does not allow get -inf. The bitmask holds 32 tokens per int32
    (token t is bit t % 32 of word t // 32), unpacked here on the device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
    constrained = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, constrained)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """Mask tokens outside top-k, outside the top-p nucleus, or below min_p x the top prob."""
    if top_k is not None:
        k = top_k.clamp(max=logits.shape[-1])
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p.to(logits.dtype).unsqueeze(1)  # the most likely token is always kept
        logits = logits.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    if min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = min_p.to(logits.dtype).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _on_cpu_kernels(logits: torch.Tensor, library) -> bool:
    return library is not None and logits.dtype == torch.float32 and logits.is_contiguous() and logits.device.type == "cpu"


def nucleus_filter(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, library) -> torch.Tensor:
    """The rows with the logits outside each row's top-k, then its top-p nucleus, set to -inf, in
    one kernel call (csrc/nucleus.c: a radix selection of the smallest kept logit in three passes
    over the row; torch's sort of a 49k-token row took 4.0 ms on a Zen 3, most of a single-stream
    step). The same tokens as the sorts keep, but for ties at the top-p boundary (all kept) and a
    token whose mass before it lies within rounding of p (the kernel sums in double)."""
    rows, vocab = logits.shape
    if top_k is not None:
        top_k = top_k.to(torch.int64).contiguous()
    if top_p is not None:
        top_p = top_p.to(torch.float32).contiguous()
    out = torch.empty_like(logits)
    status = library.nucleus_filter(logits.data_ptr(), rows, vocab, logits.numel(), None if top_k is None else top_k.data_ptr(),
                                    None if top_p is None else top_p.data_ptr(), out.data_ptr(), out.numel(),
                                    torch.get_num_threads())
    kernels.check_status(status, library, "nucleus filter")
    return out


def inverse_transform(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Each row's token for its uniform number u in [0, 1): the first whose cumulative probability
    (summed in float64) exceeds u times the row's total — a draw from the row's distribution with
    one random number. A token of probability 0 is never drawn (where rounding puts the target at
    the total, the last token of positive probability is); a row with NaN gives token 0, as the
    CPU kernel does (csrc/categorical.c)."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    drawn = torch.searchsorted(cdf, uniform.to(torch.float64).unsqueeze(1) * total, right=True)
    drawn = torch.minimum(drawn, torch.searchsorted(cdf, total)).squeeze(1)  # the last positive token at most
    return torch.where(total.squeeze(1).isnan(), 0, drawn)


# The uniform draws kept within (0, 1): a noise must be finite and above 0 (p / E would be inf,
# or NaN for a token filtered to p = 0)
_UNIFORM_RANGE = (2.0**-25, 1.0 - 2.0**-24)


def exponential_(out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fills `out` with Exp(1) draws from `generator`: -log(U), U uniform. Why not torch's
    `exponential_`: on the CPU it took 1.07 ms for a 49k-token row (a logarithm per draw in one
    thread), the uniform draws and a vectorised log 0.23 ms — most of what sampling a token cost
    over greedy decoding without top-p."""
    return out.uniform_(generator=generator).clamp_(*_UNIFORM_RANGE).log_().neg_()


def plain_greedy(meta: SamplingMetadata) -> bool:
    """Every row takes the raw argmax and no row asked for logprobs: the greedy kernel's case
    (the sampler's and speculative verification's fast path)."""
    return (meta.random_rows is None and meta.penalties is None and meta.allowed is None and meta.choices is None
            and meta.max_num_logprobs is None)


class Sampler:
    def __init__(self, seed: int, device: torch.device, library=None):
        """library: the CPU kernel library (layers/kernels.py) for small greedy steps, or None."""
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.library = library

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [R, V] float32, one row per token to sample."""
        if plain_greedy(meta):
            return self.greedy(logits)
        if meta.max_num_logprobs is None and _on_cpu_kernels(logits, self.library):
            tokens = self._choose(self.process(logits, meta), meta)
            return SamplerOutput(tokens, self.token_logprobs(logits, tokens))
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        processed = self.process(logits, meta)
        tokens = self._choose(processed, meta)
        return self.with_logprobs(raw_logprobs, tokens, meta)

    def greedy(self, logits: torch.Tensor) -> SamplerOutput:
        """Plain greedy rows: the argmax and its logprob from a logsumexp, without writing a
        log-softmax of the whole vocabulary (a third of a small decode step's sampling time);
        float32 logits on the CPU in one kernel call (csrc/greedy.c: three passes over each row
        while it is in L2, the rows shared among torch's threads; at 64 rows of a 49k vocabulary
        torch's argmax and logsumexp took ~4.5 ms a step)."""
        rows = logits.shape[0]
        if _on_cpu_kernels(logits, self.library):
            tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
            chosen = torch.empty(rows, dtype=torch.float32, device=logits.device)
            status = self.library.greedy_rows(logits.data_ptr(), rows, logits.shape[1], logits.numel(), tokens.data_ptr(),
                                              chosen.data_ptr(), rows, torch.get_num_threads())
            kernels.check_status(status, self.library, "greedy rows")
            return SamplerOutput(tokens, chosen)
        tokens = logits.argmax(dim=-1)
        chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=-1)
        return SamplerOutput(tokens, chosen)

    def token_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Each row's raw log-probability of its token from float32 CPU logits in one kernel call
        (csrc/greedy.c), without writing a log-softmax of every row when no row asked for
        logprobs; a token of -1 (nothing chosen) gets a meaningless value the caller drops."""
        tokens = tokens.contiguous()
        chosen = torch.empty(tokens.numel(), dtype=torch.float32, device=logits.device)
        status = self.library.token_logprobs(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.numel(), tokens.data_ptr(),
                                             chosen.data_ptr(), chosen.numel(), torch.get_num_threads())
        kernels.check_status(status, self.library, "token logprobs")
        return chosen

    @staticmethod
    def process(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Allowed tokens and logit bias, penalties, bans and grammar masks: what greedy rows
        take the argmax of (and random rows sample from, after temperature and filters)."""
        if meta.choices is not None:
            logits = apply_token_choices(logits, meta.choices)
        if meta.penalties is not None:
            logits = apply_penalties(logits, meta.penalties)
        if meta.allowed is not None:
            logits = apply_allowed(logits, *meta.allowed)
        return logits

    def probs(self, processed: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The distribution each random row samples from: temperature, then top-k/p and min-p."""
        scaled = processed.index_select(0, meta.random_rows) / meta.temperature.to(processed.dtype).unsqueeze(1)
        top_k, top_p = meta.top_k, meta.top_p
        if (top_k is not None or top_p is not None) and _on_cpu_kernels(scaled, self.library):
            scaled, top_k, top_p = nucleus_filter(scaled, top_k, top_p, self.library), None, None
        return filter_logits(scaled, top_k, top_p, meta.min_p).softmax(dim=-1)

    @staticmethod
    def with_logprobs(raw_logprobs: torch.Tensor, tokens: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """The chosen tokens' raw logprobs, and ranks and top-N when any row asked for them.
        Rows whose token is -1 (nothing chosen) get a meaningless logprob the caller drops."""
        out = SamplerOutput(tokens, raw_logprobs.gather(1, tokens.clamp(min=0).unsqueeze(1)).squeeze(1))
        if meta.max_num_logprobs is not None:
            out.ranks = (raw_logprobs > out.logprobs.unsqueeze(1)).sum(dim=-1) + 1
            if meta.max_num_logprobs > 0:
                out.top_logprobs, out.top_ids = raw_logprobs.topk(meta.max_num_logprobs, dim=-1)
        return out

    def _choose(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.random_rows is None:
            return logits.argmax(dim=-1)
        uniform = self.uniform_draws(meta)
        if _on_cpu_kernels(logits, self.library):
            drawn = self.draw_on_cpu(logits, meta, uniform)
        else:
            drawn = inverse_transform(self.probs(logits, meta), uniform)
        if meta.random_rows.numel() == logits.shape[0]:  # every row samples: no argmax to take
            return torch.empty_like(drawn).index_copy_(0, meta.random_rows, drawn)
        return logits.argmax(dim=-1).index_copy_(0, meta.random_rows, drawn)

    def draw_on_cpu(self, logits: torch.Tensor, meta: SamplingMetadata, uniform: torch.Tensor) -> torch.Tensor:
        """The random rows' tokens from float32 CPU logits by inverse transform sampling of their
        uniform numbers in one kernel call (csrc/categorical.c: three passes over a row where
        torch's softmax, division and argmax each took one, ~1.4 ms a token over greedy on a Zen 3
        with the race's noise). Temperature and min_p are applied in the kernel; a row with top-k or
        top-p is divided by its temperature and filtered there too (the nucleus kernel's selection),
        then drawn at temperature 1 — each row by its own rule, whatever the others ask for."""
        rows = meta.random_rows.to(torch.int64).contiguous()
        temperature = meta.temperature.to(torch.float32).contiguous()
        inverse = temperature.reciprocal()
        rule = [None if t is None else t.to(dtype).contiguous()
                for t, dtype in ((meta.min_p, torch.float32), (meta.top_k, torch.int64), (meta.top_p, torch.float32))]
        tokens = torch.empty(rows.numel(), dtype=torch.int64, device=logits.device)
        status = self.library.sample_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.numel(), rows.data_ptr(),
                                          inverse.data_ptr(), temperature.data_ptr(),
                                          *(None if t is None else t.data_ptr() for t in rule), uniform.data_ptr(),
                                          rows.numel(), tokens.data_ptr(), tokens.numel(), torch.get_num_threads())
        kernels.check_status(status, self.library, "sample rows")
        return tokens

    def uniform_draws(self, meta: SamplingMetadata) -> torch.Tensor:
        """One uniform number in [0, 1) (float64) per random row: the unseeded rows' from the
        engine's generator in one draw, each seeded row's from its own generator — one number a
        token, so a seeded row's tokens do not depend on the rest of the batch."""
        device = meta.random_rows.device
        uniform = torch.empty(meta.random_rows.numel(), dtype=torch.float64, device=device)
        if meta.unseeded is not None:
            uniform.index_copy_(0, meta.unseeded, torch.rand(meta.unseeded.numel(), dtype=torch.float64, device=device,
                                                                   generator=self.generator))
        for position, generator in meta.seeded:
            uniform[position] = torch.rand((), dtype=torch.float64, device=device, generator=generator)
        return uniform

    def exponential_noise(self, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        noise = torch.empty_like(probs)
        if meta.unseeded is not None:
            draw = torch.empty((meta.unseeded.numel(), probs.shape[1]), dtype=probs.dtype, device=probs.device)
            noise.index_copy_(0, meta.unseeded, exponential_(draw, self.generator))
        for position, generator in meta.seeded:
            exponential_(noise[position], generator)
        return noise
