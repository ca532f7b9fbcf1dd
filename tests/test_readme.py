"""The README's commands work as written, from the checkout: each one that takes under a minute
runs here — the Python example, `pagedllm generate`, every `pagedllm serve` line (started until
/health answers, then stopped), and `pagedllm train` (cut to two steps on a few files: the full
run takes an hour). The `bench` lines take minutes each and are left to their own docs; the second
Python block's lines are fragments of an existing session. Placeholders become real paths: the
default model's GGUF file for `path/model.gguf`, a tiny model with an even number of heads for
`DIR` (tensor parallelism splits them). Also: a bad engine argument stops `serve` with one line,
before its banner."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagedllm.entrypoints.serve import free_port
from pagedllm.paths import REPO_ROOT, default_model
from tiny_models import build_model

README = (REPO_ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent
TIMEOUT = 60


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def commands() -> list[str]:
    lines = [line.split("  #")[0].strip() for line in readme_blocks("bash")[1].splitlines()]
    return [line for line in lines if line.startswith("pagedllm ")]


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory) -> dict[str, str]:
    tp_model = build_model(tmp_path_factory.mktemp("tp-model"), "llama")
    return {"path/model.gguf": str(default_model()), "DIR": str(tp_model), "[--quantization int8]": "--quantization int8"}


def argv(command: str, placeholders: dict[str, str]) -> list[str]:
    for placeholder, value in placeholders.items():
        command = command.replace(placeholder, value)
    return [str(BIN / "pagedllm"), *shlex.split(command)[1:]]


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT, cwd=REPO_ROOT, **kwargs)


def test_the_readme_lists_the_commands_this_test_runs():
    kinds = {line.split()[1] for line in commands()}
    assert {"generate", "serve", "train", "bench"} <= kinds


def test_python_example(tmp_path):
    done = subprocess.run([sys.executable, "-c", readme_blocks("python")[0]], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Paris" in done.stdout


@pytest.mark.parametrize("command", [c for c in commands() if c.split()[1] == "generate"])
def test_generate_commands(command, placeholders):
    done = run(argv(command, placeholders))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()
    if "capital of France" in command:
        assert "Paris" in done.stdout


@pytest.mark.parametrize("command", [c for c in commands() if c.split()[1] == "serve"])
def test_serve_commands(command, placeholders, tmp_path):
    port = free_port()
    args = argv(command, placeholders) + ["--port", str(port), "--data-dir", str(tmp_path / "data")]
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.2)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
        assert [m["status"] for m in models] == ["ready"]
        if command.strip() == "pagedllm serve":  # the default model, default KV pool: one 8,192-token context
            log = (tmp_path / "serve.log").read_text()
            assert "model 'SmolLM2-135M-Instruct': KV cache 8,192 tokens (360 MiB)" in log, log[-3000:]
    finally:
        proc.terminate()
        proc.wait(30)


def test_train_command(tmp_path, placeholders):
    (command,) = [c for c in commands() if c.split()[1] == "train"]
    shortened = ["--set", "optimization_config.total_steps=2", "--set", "optimization_config.warmup_steps=1",
                 "--set", "data_config.file_glob=json/*.py", "--set", "data_config.eval_interval_steps=2",
                 "--set", "data_config.eval_sequences=4", "--set", f"checkpoint_config.checkpoint_dir={tmp_path / 'run'}",
                 "--set", f"data_config.cache_dir={tmp_path / 'cache'}", "--no-export"]
    done = run(argv(command, placeholders) + shortened)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_a_bad_engine_argument_is_one_line_before_the_banner():
    done = run([str(BIN / "pagedllm"), "serve", "--tensor-parallel-size", "2", "--port", str(free_port())])
    assert done.returncode == 2
    assert done.stderr.strip() == ("pagedllm serve: error: tensor_parallel_size=2 must divide the model's "
                                   "num_attention_heads=9")


DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's slug for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(path: Path) -> str:
    """A page without its code blocks, whose brackets and parentheses are code, not links."""
    return re.sub(r"```.*?```", "", path.read_text(), flags=re.S)


def anchors(path: Path) -> set[str]:
    slugs: set[str] = set()
    for heading in re.findall(r"^#+\s+(.*)$", prose(path), re.M):
        slug = base = anchor(heading)
        n = 0
        while slug in slugs:  # GitHub numbers a repeated heading's slug
            n += 1
            slug = f"{base}-{n}"
        slugs.add(slug)
    return slugs


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path)) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path):
    """Every relative link in the README and docs/ names a file that exists and, where it names a
    heading, a heading of that file — pages are moved and split, and a link left behind fails."""
    broken = []
    for target in relative_links(page):
        file, _, fragment = target.partition("#")
        resolved = (page.parent / file).resolve() if file else page
        if not resolved.exists():
            broken.append(target)
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def test_the_link_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) [bad](#nowhere)\n\n```\n[code](not-a-link)\n```\n")
    assert relative_links(page) == ["#title", "missing.md", "#nowhere"]
    assert anchors(page) == {"title"}


@pytest.mark.parametrize("page", [p for p in DOCS if p.parent.name == "docs"], ids=lambda p: p.name)
def test_each_doc_opens_with_what_it_covers(page: Path):
    """A title, then a paragraph of prose (not a list, table, code or another heading)."""
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# "), page.name
    first = next(line for line in lines[1:] if line.strip())
    assert not re.match(r"\s*(#|\||```|[-*] |\d+\. )", first), f"{page.name} opens with {first!r}"
