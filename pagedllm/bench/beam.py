"""Beam search offline (`LLM.beam_search`) against the same search over HTTP (`use_beam_search`).

Both run the same rounds through an engine (engine/beam_search.py: one one-token request per beam
and round, KV shared through the prefix cache); the server drives them from its event loop, the
offline API from the caller's thread. The two take turns — the server is started first and idles
while the offline engine runs, and the other way round — so a busier stretch of a shared machine
falls on both; each one's best run is reported, with the hypotheses checked to be the same.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx
from tqdm.auto import tqdm

PROMPT = "The capital of France is"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the default model)")
    parser.add_argument("--beam-width", type=int, default=4, help="beams per search (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per hypothesis (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="turns of each, the best reported (default: %(default)s)")
    parser.add_argument("--prompt", default=PROMPT, help="the prompt searched from (default: %(default)r)")


def run(args: argparse.Namespace) -> int:
    from pagedllm import LLM, BeamSearchParams
    from pagedllm.entrypoints.serve import launch
    from pagedllm.paths import DEFAULT_MODEL_NAME, default_model

    model = str(args.model or default_model())
    name = DEFAULT_MODEL_NAME if args.model is None else "bench"
    serve_args = [] if args.model is None else ["--model", model, "--served-model-name", name]
    server = launch(serve_args, Path(tempfile.gettempdir()) / "pagedllm-bench-beam-server.log")
    try:
        llm = LLM(model)
        ids = llm.get_tokenizer().encode(args.prompt, add_special_tokens=False)
        params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens)
        body = {"model": name, "prompt": ids, "max_tokens": args.max_tokens, "n": args.beam_width,
                "use_beam_search": True}
        with httpx.Client(base_url=server.url, timeout=600) as http:
            http.post("/v1/completions", json={**body, "max_tokens": 2}).raise_for_status()  # warm-up, both
            llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=args.beam_width, max_tokens=2))
            times: dict[str, list[float]] = {"offline (LLM.beam_search)": [], "HTTP (use_beam_search)": []}
            texts = {}
            for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
                start = time.perf_counter()
                (out,) = llm.beam_search([{"prompt_token_ids": ids}], params)
                times["offline (LLM.beam_search)"].append(time.perf_counter() - start)
                texts["offline"] = [list(s.tokens[len(ids):]) for s in out.sequences]
                start = time.perf_counter()
                response = http.post("/v1/completions", json=body)
                times["HTTP (use_beam_search)"].append(time.perf_counter() - start)
                response.raise_for_status()
                texts["http"] = [c["text"] for c in response.json()["choices"]]
        llm.llm_engine.shutdown()
    finally:
        server.stop()
    print(f"{Path(model).name}: beam width {args.beam_width}, {args.max_tokens} tokens, {args.rounds} rounds in turns")
    for label, runs in times.items():
        print(f"{label + ':':28s} best {min(runs):6.2f} s  (each: {', '.join(f'{r:.2f}' for r in runs)})")
    offline, http_s = (min(v) for v in times.values())
    print(f"offline / HTTP time: {offline / http_s:.2f}")
    return 0
