"""Schemathesis hooks for the crash hunt (test_server_crash_hunt.py; loaded through
SCHEMATHESIS_HOOKS): every generated completion and chat body asks for the most the server
allows — n and best_of at max_num_seqs, logprobs at 20 — so the fuzzer's valid requests drive
the engine's widest paths (forks of one prompt, the most logit rows, the top-20 ranking) rather
than n = 1. The limit comes from PAGEDLLM_CRASH_HUNT_MAX_SEQS (the server's --max-num-seqs)."""
from __future__ import annotations

import os

import schemathesis

MAX_SEQS = int(os.environ.get("PAGEDLLM_CRASH_HUNT_MAX_SEQS", "16"))
MAX_LOGPROBS = 20


@schemathesis.hook
def map_body(context, body):
    path = context.operation.path
    if not isinstance(body, dict):
        return body
    if path == "/v1/completions":
        body.update(n=MAX_SEQS, best_of=MAX_SEQS, logprobs=MAX_LOGPROBS)
    elif path == "/v1/chat/completions":
        body.update(n=MAX_SEQS, logprobs=True, top_logprobs=MAX_LOGPROBS)
    return body
