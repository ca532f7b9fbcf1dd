"""The package works where it is installed, not only in its checkout: a wheel built from the
sources, installed into a fresh virtual environment, runs `pagedllm generate` from a folder
outside the checkout with the C kernels built at first use into the user's cache — from the
sources and headers the wheel shipped — and the fused decode step running (decode_backend
'fused' refuses to start without them), and finds the default model through its installed
distribution.

Offline and quick: the wheel is built without build isolation (this environment's setuptools),
and the fresh environment reuses this one's installed dependencies through a .pth file listing
its site-packages (a plain path line, so this environment's own editable pagedllm, installed
through an import hook in a .pth of its own, is not seen there).
"""
from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from pagedllm.layers import kernels
from pagedllm.paths import REPO_ROOT

TIMEOUT = 120


def test_the_package_data_ships_every_kernel_source_and_header():
    package_data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["pagedllm"]
    for name in (*kernels.SOURCES, *kernels.HEADERS):
        shipped = f"layers/csrc/{name}"
        assert any(fnmatch.fnmatch(shipped, pattern) for pattern in package_data), f"{shipped} is not package data"
    on_disk = {p.name for p in (REPO_ROOT / "pagedllm" / "layers" / "csrc").iterdir()}
    assert on_disk == {*kernels.SOURCES, *kernels.HEADERS}  # nothing the build reads is left out of either list


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, **kwargs)
    assert done.returncode == 0, f"{command[:4]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh environment with the wheel of this checkout installed; its python."""
    root = tmp_path_factory.mktemp("install")
    source = root / "source"  # what the wheel is built from, copied so the build leaves nothing in the checkout
    shutil.copytree(REPO_ROOT / "pagedllm", source / "pagedllm", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(root / "dist"), str(source)])
    wheel = next((root / "dist").glob("pagedllm-*.whl"))
    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "dependencies.pth").write_text("".join(f"{path}\n" for path in ours))
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-index",
         "--ignore-installed", str(wheel)])
    return python


def fresh_env(home: Path) -> dict[str, str]:
    """This process's environment with a new home and nothing that points into the checkout or
    at another kernel cache."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PAGEDLLM_CACHE_DIR", "XDG_CACHE_HOME", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return {**env, "HOME": str(home), "HF_HUB_OFFLINE": "1"}


@pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler on this machine")
def test_a_wheel_installed_elsewhere_generates_with_the_c_kernels(installed, model_dir, tmp_path):
    outside, home = tmp_path / "work", tmp_path / "home"
    outside.mkdir()
    home.mkdir()
    package = installed.parent.parent / "lib"
    command = [str(installed.parent / "pagedllm"), "generate", "--model", str(model_dir("llama")), "--prompt", "def main",
               "--max-tokens", "6", "--decode-backend", "fused", "--attention-backend", "kernel", "--log-level", "info"]
    done = run(command, cwd=outside, env=fresh_env(home))
    cache = home / ".cache" / "pagedllm" / "kernels"
    csrc = next(package.glob("python*/site-packages/pagedllm/layers/csrc"))
    assert f"building the CPU kernels for this machine (once) from {csrc} into {cache}" in done.stderr
    assert f"CPU kernels: the {kernels.isa(kernels.load())} build (native)" in done.stderr
    assert f"streamed weights' prefetch: {kernels.prefetch_hint()}; at {cache}/" in done.stderr
    assert len(list(cache.glob("pagedllm_kernels-*.so"))) == 1
    assert re.match(r"--- 'def main' \[(length|stop)\]\ndef main", done.stdout), done.stdout
    # the default model, through its installed distribution (paths.py imports nothing of the engine)
    paths = csrc.parent.parent / "paths.py"
    script = ("import importlib.util as u; s = u.spec_from_file_location('paths', %r); m = u.module_from_spec(s); "
              "s.loader.exec_module(m); print(m.default_model())" % str(paths))
    found = run([str(installed), "-c", script], cwd=outside, env=fresh_env(home)).stdout.strip()
    # from an installed distribution's folder (the checkout's own venv may sit inside it), not the checkout's models/
    assert Path(found).is_file() and found.endswith(".gguf") and "site-packages" in Path(found).parts, found


def test_make_run_installs_only_what_serving_needs():
    """`make run` installs the package's own dependencies, none of the test toolchain (issue 44:
    it once pulled LangChain, LiteLLM, schemathesis, Playwright and Ray to serve a model)."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    serving = {re.split(r"[=<>\[ ]", dep)[0].lower() for dep in project["dependencies"]}
    test_only = {"pytest", "openai", "langchain-openai", "langchain-core", "schemathesis", "playwright", "guidellm",
                 "litellm", "ray", "hypothesis", "datasets"}
    assert not serving & test_only, serving & test_only
    assert {"torch", "fastapi", "uvicorn", "transformers", "gguf", "llguidance"} <= serving
    makefile = (REPO_ROOT / "Makefile").read_text()
    run_target = re.search(r"^run: (\S+)\n\t(.*)$", makefile, re.M)
    assert run_target and run_target.group(1) == "$(SERVE_STAMP)" and run_target.group(2) == "$(BIN)/pagedllm serve"
    serve_recipe = re.search(r"^\$\(SERVE_STAMP\):.*?\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "pip install --quiet -e .\n" in serve_recipe and "[test]" not in serve_recipe
