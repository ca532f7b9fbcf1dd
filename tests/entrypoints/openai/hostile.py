"""Hostile request bodies shared by test_server_limits.py and the crash hunt (test_server_crash_hunt.py):
each must be answered with a 400 naming its field, quickly, whatever else the body says."""
from __future__ import annotations

import json

import httpx

from pagedllm.entrypoints.openai.limits import MAX_CHOICES, MAX_PROMPTS

# (patch to a small valid completion body, the field named, a piece of the message)
HOSTILE = [
    ({"guided_choice": [f"c{i}" for i in range(100_000)]}, "guided_choice", str(MAX_CHOICES)),
    ({"prompt": ["x"] * 10_000}, "prompt", str(MAX_PROMPTS)),
    ({"prompt": [[5, 6]] * 10_000}, "prompt", str(MAX_PROMPTS)),
    ({"stop": [f"s{i}" for i in range(100)]}, "stop", "16"),
    ({"stop": "x" * 5000}, "stop", "1000"),
    ({"stop_token_ids": list(range(10_000))}, "stop_token_ids", "256"),
    ({"guided_regex": "a" * 100_000}, "guided_regex", "65536"),
    ({"guided_json": {"type": "object", "description": "x" * 100_000}}, "guided_json", "65536"),
    ({"user": "u" * 10_000}, "user", "256"),
    ({"temperature": 1e308}, "temperature", "100"),
    ({"repetition_penalty": 1e308}, "repetition_penalty", "100"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty", "0.01"),
    ({"top_p": 1e-300}, "top_p", "1e-06"),
    ({"priority": 2**63}, "priority", "2147483647"),
    ({"priority": -(2**63)}, "priority", ""),
    # each of these once failed a step or the search (issue 39): an OverflowError staging top_k, an
    # IndexError masking an out-of-vocabulary stop token under min_tokens, a float overflow in the
    # beam score; the last would have built a response of 5 million logprob entries
    ({"top_k": 2**63}, "top_k", "2147483647"),
    ({"min_tokens": 1, "stop_token_ids": [100_000]}, "stop_token_ids", "vocabulary"),
    ({"use_beam_search": True, "n": 2, "length_penalty": 2000}, "length_penalty", "[-10, 10]"),
    ({"use_beam_search": True, "n": 2, "length_penalty": -1e308}, "length_penalty", "[-10, 10]"),
    ({"prompt": [[5]] * MAX_PROMPTS, "n": 16, "max_tokens": 60, "logprobs": 20}, "logprobs", "logprob entries"),
]

# (patch to a completion body, the field named): text that is not valid Unicode
SURROGATES = [
    ({"prompt": "\ud800 abc"}, "prompt"),
    ({"prompt": ["fine", "x\udfff"]}, "prompt"),
    ({"prompt": "x", "stop": ["\ud800"]}, "stop"),
    ({"prompt": "x", "guided_choice": ["a", "\ud800"]}, "guided_choice[1]"),
]


def escaped(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    """POST `body` as JSON with non-ASCII escaped, as most clients send it: a lone surrogate
    travels as the escape \\ud800 (httpx's json= would fail to encode it)."""
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
