"""`make mutate`: mutation testing (mutmut) of the modules that decide correctness, one at a time.

Each module runs in its own folder, build/mutate/<name>/, holding links to pagedllm/ and tests/
and a pyproject.toml that tells mutmut which file to mutate and which tests cover it (the
narrowest selection that does: mutmut runs, for each mutant, only the tests that reach the
mutated function). The driver then reads mutmut's verdicts and writes build/mutate/report.md and
report.json: per module the mutants killed, survived, equivalent and not covered, and the score

    killed / (mutants - equivalent)

where "killed" counts mutmut's timeouts (a mutant that hangs the tests is caught) and a mutant no
test reaches counts as surviving. Equivalent mutants — changes no test can observe because the
behaviour is the same — are listed with the reason in tests/mutation_equivalents.toml; one listed
there that the tests now kill, or that no longer exists (the code moved), is reported as stale.

    python scripts/mutate.py                       every module, then the report
    python scripts/mutate.py scheduler sampler     these modules (the others' last verdicts are reused)
    python scripts/mutate.py --report              the report from the last verdicts only
    python scripts/mutate.py --jobs 2 ...          mutmut's --max-children (default 1: a shared machine)

It exits 1 when a module is under the target (90 %). Runs are slow (minutes per module) and run
under `nice -n 10`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

if sys.version_info < (3, 11):
    sys.exit("make mutate needs Python 3.11 or newer (tomllib)")
import tomllib  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "mutate"
EQUIVALENTS = ROOT / "tests" / "mutation_equivalents.toml"
TARGET = 0.90


@dataclass(frozen=True)
class Module:
    """A module under mutation and the tests that cover it."""

    source: str
    tests: tuple[str, ...]
    # Its tests run torch's kernels: mutants run in processes forked from a server that has not run
    # them (torch's thread pools do not survive a fork; forked straight from mutmut they hang).
    torch: bool = False


MODULES: dict[str, Module] = {
    "scheduler": Module("pagedllm/engine/scheduler.py", ("tests/engine/test_scheduler.py",)),
    "block_manager": Module("pagedllm/engine/block_manager.py",
                            ("tests/engine/test_block_manager.py", "tests/engine/test_scheduler.py")),
    "sampler": Module("pagedllm/layers/sampler.py", ("tests/layers/test_sampler.py",), torch=True),
    "rejection_sampler": Module("pagedllm/spec_decode/rejection.py", ("tests/spec_decode/test_rejection.py",), torch=True),
    "planner": Module("pagedllm/step/planner.py", ("tests/step/test_planner.py",), torch=True),
    "checkpoint_manifest": Module("pagedllm/training/manifest.py", ("tests/training/test_manifest.py",)),
    "request_validation": Module("pagedllm/sampling_params.py", ("tests/test_sampling_params.py",)),
}

# mutmut's exit codes -> our verdicts (mutmut/stats.py: 1 and 3 killed, 0 survived, 33 / 5 no
# tests, 36 and the SIGXCPU codes timeouts, None not run). A test process killed by SIGSEGV (-11)
# or SIGABRT (-6) crashed on the mutant — a kernel handed a null pointer or a buffer of the wrong
# dtype: the test run fails, so the mutant is caught (counted as killed, like a timeout).
KILLED, SURVIVED, NO_TESTS, TIMEOUT, NOT_RUN = "killed", "survived", "no tests", "timeout", "not checked"
VERDICTS = {1: KILLED, 3: KILLED, -11: KILLED, -6: KILLED, 0: SURVIVED, 5: NO_TESTS, 33: NO_TESTS, 36: TIMEOUT,
            24: TIMEOUT, -24: TIMEOUT, 152: TIMEOUT, 255: TIMEOUT, None: NOT_RUN}


@dataclass
class Score:
    """One module's verdicts."""

    module: str
    source: str
    mutants: int = 0
    killed: int = 0
    survived: list[str] = field(default_factory=list)  # neither killed nor listed as equivalent
    equivalent: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)  # listed as equivalent, but killed or gone
    other: dict[str, int] = field(default_factory=dict)  # suspicious, segfault, not checked...

    @property
    def score(self) -> float:
        judged = self.mutants - len(self.equivalent)
        return self.killed / judged if judged else 1.0


def mutmut_config(module: Module) -> str:
    """The pyproject.toml of a module's folder: mutmut's selection and the project's pytest options."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pytest_ini = project["tool"]["pytest"]["ini_options"]
    lines = ["[tool.mutmut]", 'source_paths = ["pagedllm"]', f"only_mutate = [{json.dumps(module.source)}]",
             f"pytest_add_cli_args_test_selection = {json.dumps(list(module.tests))}",
             'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-x"]',
             f'process_isolation = "{"forkserver" if module.torch else "fork"}"', "",
             "[tool.pytest.ini_options]", f"addopts = {json.dumps(pytest_ini['addopts'])}",
             f"markers = {json.dumps(pytest_ini['markers'])}", ""]
    return "\n".join(lines)


def prepare(name: str, module: Module) -> Path:
    """A fresh folder for the module: links to the sources and tests, its config, no old mutants."""
    folder = WORK / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for link in ("pagedllm", "tests"):
        (folder / link).symlink_to(ROOT / link)
    (folder / "pyproject.toml").write_text(mutmut_config(module))
    return folder


def run_module(name: str, jobs: int) -> None:
    module = MODULES[name]
    folder = prepare(name, module)
    mutmut = Path(sys.executable).parent / "mutmut"
    print(f"== {name}: mutating {module.source} against {' '.join(module.tests)}", flush=True)
    with open(folder / "mutmut.log", "w") as log:
        code = subprocess.call(["nice", "-n", "10", str(mutmut), "run", "--max-children", str(jobs)], cwd=folder,
                               stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    if code != 0:
        tail = (folder / "mutmut.log").read_text()[-3000:]
        raise SystemExit(f"mutmut failed on {name} (exit {code}); the end of {folder / 'mutmut.log'}:\n{tail}")


def verdicts(name: str) -> dict[str, str] | None:
    """Mutant name -> verdict from the module's last run, or None if it never ran."""
    meta = WORK / name / "mutants" / (MODULES[name].source + ".meta")
    if not meta.is_file():
        return None
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    return {mutant: VERDICTS.get(code, "suspicious") for mutant, code in codes.items()}


def load_equivalents() -> dict[str, str]:
    """Mutant name -> why it is equivalent (tests/mutation_equivalents.toml)."""
    if not EQUIVALENTS.is_file():
        return {}
    table = tomllib.loads(EQUIVALENTS.read_text())
    return {mutant: entry["reason"] for entries in table.values() for mutant, entry in entries.items()}


def score(name: str, found: dict[str, str], equivalents: dict[str, str]) -> Score:
    module = MODULES[name]
    result = Score(name, module.source, mutants=len(found))
    prefix = module.source.removesuffix(".py").replace("/", ".") + "."
    for mutant, verdict in sorted(found.items()):
        if verdict in (KILLED, TIMEOUT):
            result.killed += 1
            if mutant in equivalents:
                result.stale.append(mutant)
        elif mutant in equivalents:
            result.equivalent.append(mutant)
        elif verdict in (SURVIVED, NO_TESTS):
            result.survived.append(mutant)
        else:
            result.other[verdict] = result.other.get(verdict, 0) + 1
            result.survived.append(mutant)
    result.stale += [m for m in equivalents if m.startswith(prefix) and m not in found]
    return result


def report(scores: list[Score], equivalents: dict[str, str]) -> str:
    lines = ["# Mutation testing (mutmut)", "",
             f"Score = killed / (mutants - equivalent); target {TARGET:.0%} per module.", "",
             "| module | file | mutants | killed | survived | equivalent | score |", "|---|---|---|---|---|---|---|"]
    for s in scores:
        mark = "" if s.score >= TARGET else " (under target)"
        lines.append(f"| {s.module} | `{s.source}` | {s.mutants} | {s.killed} | {len(s.survived)} | {len(s.equivalent)} | "
                     f"{s.score:.1%}{mark} |")
    for s in scores:
        if s.survived:
            lines += ["", f"## {s.module}: survivors", "", *[f"- `{m}`" for m in s.survived]]
        if s.stale:
            lines += ["", f"## {s.module}: stale equivalents (killed now, or gone)", "", *[f"- `{m}`" for m in s.stale]]
        if s.equivalent:
            lines += ["", f"## {s.module}: equivalent", "", *[f"- `{m}`: {equivalents[m]}" for m in s.equivalent]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help=f"default: all ({', '.join(MODULES)})")
    parser.add_argument("--report", action="store_true", help="only write the report from the last verdicts")
    parser.add_argument("--jobs", type=int, default=1, help="mutmut --max-children")
    args = parser.parse_args()
    names = args.modules or list(MODULES)
    unknown = [name for name in names if name not in MODULES]
    if unknown:
        parser.error(f"unknown module {unknown[0]!r}; known: {', '.join(MODULES)}")
    if not args.report:
        for name in names:
            run_module(name, args.jobs)
    equivalents = load_equivalents()
    scores = []
    for name in MODULES:
        found = verdicts(name)
        if found is None:
            print(f"{name}: never run (python scripts/mutate.py {name})")
            continue
        scores.append(score(name, found, equivalents))
    text = report(scores, equivalents)
    (WORK / "report.md").parent.mkdir(parents=True, exist_ok=True)
    (WORK / "report.md").write_text(text)
    (WORK / "report.json").write_text(json.dumps([{**asdict(s), "score": s.score} for s in scores], indent=2))
    print(text)
    print(f"written to {WORK / 'report.md'} and report.json")
    return 0 if scores and all(s.score >= TARGET for s in scores) and len(scores) == len(MODULES) else 1


if __name__ == "__main__":
    sys.exit(main())
