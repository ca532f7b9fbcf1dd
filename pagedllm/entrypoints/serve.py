"""`pagedllm serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

    pagedllm serve                                             # the default model, SmolLM2-135M-Instruct
    pagedllm serve --model path/model.gguf                     # one model, http://127.0.0.1:8000/v1
    pagedllm serve --model models/pagedllm-py-tiny             # a Hugging Face folder
    pagedllm serve --model-dir models                          # none loaded; load by folder name
    pagedllm serve --no-model                                  # training jobs only
    pagedllm serve --model DIR --api-key KEY --max-num-seqs 64 --num-kv-blocks 4096

Every engine argument (EngineConfig's fields) is a flag; they apply to each model loaded. A bad
model folder or engine argument fails here, before the port is bound, with the reason.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import ipaddress
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from pagedllm.config import EngineConfig, ModelConfig, ModelLoadError
from pagedllm.entrypoints.engine_args import add_engine_arguments, engine_args
from pagedllm.entrypoints.openai.limits import DEFAULT_MAX_BODY_BYTES
from pagedllm.jobs.settings import DEFAULT_MAX_PENDING_JOBS, default_data_dir
from pagedllm.paths import DEFAULT_MODEL_NAME, TINY_MODEL, DefaultModelMissing, default_model

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                        help="the model to serve, as vLLM's `vllm serve MODEL` (the same as --model)")
    parser.add_argument("--model", help="model to load at start-up: a Hugging Face folder or a GGUF file (default: "
                                        f"{DEFAULT_MODEL_NAME}, unless --model-dir is given)")
    parser.add_argument("--no-model", action="store_true",
                        help="start with no model loaded (training jobs; --model-dir models load on demand)")
    parser.add_argument("--served-model-name", help="the 'model' name clients use (default: the folder's or file's name)")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="LoRA adapters (PEFT folders) served from start-up over --model; a request whose model "
                             "is NAME uses that adapter (needs --enable-lora)")
    parser.add_argument("--model-dir", help="folder whose sub-folders can be loaded on demand: POST /v1/models/<name>/load")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on; anything but loopback needs --api-key (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and the docs "
                             "(default: $PAGEDLLM_API_KEY)")
    parser.add_argument("--protect-metrics", action="store_true", help="/metrics needs the API key too")
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="per model: answer 503 with Retry-After while this many requests already wait (default: unlimited)")
    parser.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                        help="abort a generation not finished this long after it arrived (waiting included) with 504 "
                             "(default: none)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                        help="answer 413 to a request body larger than this, before reading it (default: 4 MiB)")
    parser.add_argument("--data-dir", default=str(default_data_dir()),
                        help="training job store, job logs and default checkpoint folders (default: %(default)s)")
    parser.add_argument("--train-slots", type=int, default=None,
                        help="processes training jobs may use at once (default: the GPUs, else the CPU cores)")
    parser.add_argument("--max-pending-jobs", type=int, default=DEFAULT_MAX_PENDING_JOBS, metavar="N",
                        help="training jobs that may wait to start; past it a submission or resume is a 429 "
                             "(default: %(default)s)")
    parser.add_argument("--allowed-path", action="append", default=[], metavar="DIR",
                        help="a folder training jobs may read and write besides the data dir (repeatable; "
                             "every path a job names must resolve under one of them)")
    parser.add_argument("--cluster", metavar="ray[://HOST:PORT]",
                        help="run training jobs (and --data-parallel-size replicas) on a Ray cluster: 'ray' joins the "
                             "cluster of this machine ($RAY_ADDRESS, else the one `ray start` left here), "
                             "'ray://HOST:PORT' a Ray Client address (default: this machine alone, no Ray)")
    parser.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                        help="engine replicas per model behind this server: processes, or Ray actors with --cluster; "
                             "each request goes to the one with the fewest outstanding tokens, preferring the one "
                             "whose prefix cache holds the prompt's first blocks (default: 1, the engine in-process)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="the server's log level (default: %(default)s)")
    add_chat_arguments(parser)
    add_engine_arguments(parser)


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's chat-template and tool-calling flags (docs/tools.md)."""
    from pagedllm.entrypoints.tool_parsers import DEFAULT_PARSER, PARSERS

    group = parser.add_argument_group("chat templates and tool calling")
    group.add_argument("--chat-template", metavar="FILE_OR_JINJA",
                       help="a chat template (a file, or the Jinja text itself) replacing every model's own "
                            "(default: the model's)")
    group.add_argument("--tool-call-parser", default=DEFAULT_PARSER, choices=sorted(PARSERS),
                       help="how models write tool calls, and so how they are read back and what a forced "
                            "tool_choice's grammar produces (default: %(default)s)")
    group.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                       help='parse the calls of tool_choice "auto" (vLLM needs the flag; here it is on unless '
                            "--no-enable-auto-tool-choice, which refuses \"auto\" as vLLM does without it)")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="render a request's own chat_template (Jinja, in a sandbox); without it such a request "
                            "is a 400")


def chat_options(args: argparse.Namespace):
    """ChatOptions from the flags; ValueError on a template that is neither a file nor valid Jinja."""
    from pagedllm.entrypoints.chat_template import load_chat_template
    from pagedllm.entrypoints.openai.settings import ChatOptions

    template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    return ChatOptions(chat_template=template, tool_call_parser=args.tool_call_parser,
                       enable_auto_tool_choice=args.enable_auto_tool_choice,
                       trust_request_chat_template=args.trust_request_chat_template)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_arguments(parser)
    parser.set_defaults(func=run)


def build_settings(args: argparse.Namespace):
    """ServerSettings from the flags; raises ValueError (incl. ModelLoadError) on a bad value."""
    from pagedllm.entrypoints.openai.settings import ModelSpec, ServerSettings

    engine = engine_args(args)
    models = []
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
    model, name = args.model_tag or args.model, args.served_model_name
    if args.no_model and model:
        raise ValueError("--no-model and --model exclude each other")
    if model is None and args.model_dir is None and not args.no_model:
        model, name = str(default_model()), name or DEFAULT_MODEL_NAME
    if model:
        model_config = ModelConfig.from_pretrained(model)  # a missing or broken model fails here, clearly
        EngineConfig.from_kwargs(model, **engine).check_model(model_config)  # and so does a bad engine argument
        models.append(ModelSpec(name or model_name(model), model))
    elif args.served_model_name:
        raise ValueError("--served-model-name needs --model")
    if args.model_dir and not Path(args.model_dir).is_dir():
        raise ValueError(f"--model-dir {args.model_dir!r} is not a directory")
    if args.cluster is not None:
        from pagedllm.jobs.ray_cluster import ray_address

        ray_address(args.cluster)  # a malformed --cluster fails here, before the port is bound
        if importlib.util.find_spec("ray") is None:  # Ray is the `cluster` extra, not a serving dependency
            raise ValueError("--cluster needs Ray: pip install 'pagedllm[cluster]'")
    return ServerSettings(
        models=models,
        model_dir=args.model_dir,
        api_key=args.api_key or None,
        protect_metrics=args.protect_metrics,
        max_waiting_requests=args.max_waiting_requests,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        engine_args=engine,
        data_dir=args.data_dir,
        train_slots=args.train_slots,
        allowed_paths=args.allowed_path,
        max_pending_jobs=args.max_pending_jobs,
        cluster=args.cluster,
        data_parallel_size=args.data_parallel_size,
        chat=chat_options(args),
        lora_modules=lora_modules(args.lora_modules),
    )


def lora_modules(values: list[str]):
    """--lora-modules NAME=PATH ... as LoRAModules; a value without NAME= is refused naming it."""
    from pagedllm.entrypoints.openai.settings import LoRAModule

    modules = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {value!r} is not NAME=PATH")
        modules.append(LoRAModule(name, path))
    return modules


def model_name(path: str) -> str:
    """The name a model is served under by default (model_names.py: the same as --model-dir gives it)."""
    from pagedllm.entrypoints.model_names import served_name

    return served_name(path)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: assume it is reachable from outside
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """What to tell the operator when the server listens beyond this machine without a key."""
    if api_key or is_loopback(host):
        return None
    return (f"pagedllm serve: WARNING: listening on {host} without an API key: anyone who can reach this port can "
            "generate, load models and run training jobs. Pass --api-key KEY (or set PAGEDLLM_API_KEY).")


def banner(settings, args: argparse.Namespace) -> str:
    """Where the server listens, and a request to paste."""
    url = f"http://{args.host}:{args.port}"
    if not settings.models:
        return f"pagedllm serve: {url}/v1 with no model loaded (POST /v1/models/<name>/load)"
    name, path = settings.models[0].name, settings.models[0].path
    key = ' -H "Authorization: Bearer $PAGEDLLM_API_KEY"' if settings.api_key else ""  # double quotes: the shell expands it
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "What is the capital of France?"}], '
            '"max_tokens": 64, "temperature": 0}' % name)
    return (
        f"pagedllm serve: {name} ({path}) at {url}/v1, web console at {url}/\n"
        f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{key} -d '{body}'"
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = build_settings(args)
    except (ValueError, ModelLoadError, DefaultModelMissing) as exc:
        hint = ""
        given = args.model_tag or args.model
        if given and Path(given).resolve() == TINY_MODEL.resolve() and not TINY_MODEL.is_dir():
            hint = " (the repository's default model has not been built yet)"
        print(f"pagedllm serve: error: {exc}{hint}", file=sys.stderr)
        return 2
    import uvicorn

    from pagedllm.entrypoints.openai.app import create_app

    warning = exposure_warning(args.host, settings.api_key)
    if warning:  # printed whatever --log-level says
        print(warning, file=sys.stderr, flush=True)
    print(banner(settings, args), file=sys.stderr, flush=True)
    config = uvicorn.Config(
        create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=5,  # then open streams are cancelled and their requests aborted
    )
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1


@dataclasses.dataclass
class ServerProcess:
    """A `pagedllm serve` child process (benchmarks and tests start real servers this way)."""

    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log: Path

    def stop(self, timeout: float = 15) -> int:
        """SIGTERM (graceful: streams end, engines stop), SIGKILL after `timeout`; the exit code."""
        self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args: list[str], log: Path, timeout: float = 300, env: dict[str, str] | None = None) -> ServerProcess:
    """Start `pagedllm serve ARGS` on 127.0.0.1 and a free port (with `env` added to this
    process's environment, e.g. kernels.sanitizer_env()); return once /health answers."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.serve", "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", Path(log))
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"pagedllm serve exited with {proc.returncode}:\n{Path(log).read_text()[-4000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"pagedllm serve did not start in {timeout}s:\n{Path(log).read_text()[-4000:]}")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedllm serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
