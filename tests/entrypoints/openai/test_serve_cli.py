"""`pagedllm serve` flags: engine arguments, and bad folders or values failing before the port is bound."""
from __future__ import annotations

import argparse

import pytest

from pagedllm.entrypoints.serve import build_settings, exposure_warning, main, register
from pagedllm.paths import DEFAULT_MODEL_NAME


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_flags_become_settings(model_dir):
    folder = model_dir("llama")
    args = parse("--model", str(folder), "--max-num-seqs", "4", "--no-enable-prefix-caching", "--dtype", "float32",
                 "--api-key", "k", "--max-waiting-requests", "7", "--kv-cache-memory-fraction", "0.1")
    settings = build_settings(args)
    assert [(m.name, m.path) for m in settings.models] == [(folder.name, str(folder))]
    assert settings.engine_args == {"max_num_seqs": 4, "enable_prefix_caching": False, "dtype": "float32", "kv_cache_memory_fraction": 0.1}
    assert (settings.api_key, settings.max_waiting_requests) == ("k", 7)
    assert build_settings(parse("--model", str(folder), "--served-model-name", "x")).models[0].name == "x"
    # no --model: the default model; with --model-dir alone none (load on demand, training)
    assert [m.name for m in build_settings(parse()).models] == [DEFAULT_MODEL_NAME]
    assert build_settings(parse("--model-dir", str(folder.parent))).models == []
    assert build_settings(parse("--no-model")).models == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "/nonexistent/model"], "does not exist"),
        (["--model-dir", "/tmp", "--served-model-name", "x"], "needs --model"),
        (["--no-model", "--model", "/tmp"], "exclude each other"),
        (["--model-dir", "/nonexistent"], "not a directory"),
        (["--block-size", "0"], "block_size must be a positive integer"),
        (["--dtype", "int3"], "dtype must be one of"),
        (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens must be a positive integer"),
        (["--protect-metrics"], "--protect-metrics needs --api-key"),
        (["--request-timeout", "0"], "request_timeout_s must be > 0"),
        (["--chat-template", "/nonexistent/template.jinja"], "neither a file nor Jinja text"),
        (["--chat-template", "{% for m in messages %}{{ m.content }}"], "--chat-template: line 1"),
    ],
)
def test_bad_arguments_exit_2_with_the_reason(model_dir, capsys, argv, message):
    if argv[0] in ("--block-size", "--dtype", "--speculative-config"):
        argv = ["--model", str(model_dir("llama")), *argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_reliability_flags_become_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_API_KEY", "from-env")
    args = parse("--allowed-path", str(tmp_path / "a"), "--allowed-path", str(tmp_path / "b"), "--request-timeout", "30",
                 "--protect-metrics", "--max-body-bytes", "1000")
    settings = build_settings(args)
    assert settings.allowed_paths == [str(tmp_path / "a"), str(tmp_path / "b")] and settings.max_body_bytes == 1000
    assert build_settings(parse()).max_body_bytes == 4 << 20
    assert (settings.request_timeout_s, settings.protect_metrics, settings.api_key) == (30.0, True, "from-env")


@pytest.mark.parametrize("host, key, warns", [
    ("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False), ("127.0.0.2", None, False),
    ("0.0.0.0", None, True), ("::", None, True), ("10.1.2.3", None, True), ("myhost.example", None, True),
    ("0.0.0.0", "k", False),
])
def test_listening_beyond_loopback_without_a_key_warns(host, key, warns):
    warning = exposure_warning(host, key)
    assert (warning is not None) == warns
    if warns:
        assert host in warning and "--api-key" in warning


def test_the_model_can_be_positional_as_in_vllm(model_dir):
    folder = str(model_dir("llama"))
    assert [m.path for m in build_settings(parse(folder)).models] == [folder]
    assert [m.path for m in build_settings(parse(folder, "--model", folder)).models] == [folder]
    with pytest.raises(ValueError, match="given twice"):
        build_settings(parse(folder, "--model", folder + "-other"))


def test_the_curl_hint_works_when_pasted_with_an_api_key(model_dir, tmp_path):
    """The banner's curl line, run by bash with `curl` swapped for printf: $PAGEDLLM_API_KEY expands."""
    import shlex
    import subprocess

    from pagedllm.entrypoints.serve import banner

    args = parse("--model", str(model_dir("llama")), "--api-key", "secret")
    line = banner(build_settings(args), args).splitlines()[-1].split("try: ", 1)[1]
    assert line.startswith("curl ")
    script = "printf '%s\\n' " + line.removeprefix("curl ")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={"PAGEDLLM_API_KEY": "secret"}, check=True)
    words = done.stdout.splitlines()
    assert "Authorization: Bearer secret" in words and shlex.split(line)[0] == "curl"

