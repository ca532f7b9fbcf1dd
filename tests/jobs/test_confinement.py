"""Path confinement: every path a job names must resolve (symlinks followed, `..` folded) under the
server's data dir or an --allowed-path root; anything else is a 400 naming the field, before a job exists."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import httpx
import pytest

from pagedllm.jobs.confinement import (
    AllowedRoots,
    check_confined,
    check_file_glob,
    confine_checkpoint_dir,
    confine_data,
)
from pagedllm.training.config import ConfigError

from .helpers import assert_error, job_body


@pytest.fixture
def roots(tmp_path) -> AllowedRoots:
    (tmp_path / "data").mkdir()
    (tmp_path / "shared").mkdir()
    return AllowedRoots(tmp_path / "data", [tmp_path / "shared"])


@pytest.fixture
def outside() -> Path:
    """A real folder outside every allowed root (and outside pytest's temp folders)."""
    with tempfile.TemporaryDirectory(prefix="pagedllm-outside-", dir="/tmp") as folder:
        yield Path(folder)


def refused(roots: AllowedRoots, value: str, field: str = "data_config.dataset_path") -> str:
    with pytest.raises(ConfigError) as info:
        roots.resolve(field, value)
    assert info.value.field == field
    return str(info.value)


def test_relative_paths_live_under_the_data_dir(roots):
    assert roots.resolve("f", "corpus/a.txt") == roots.data_dir / "corpus" / "a.txt"
    assert roots.resolve("f", str(roots.roots[1] / "x" / ".." / "y")) == roots.roots[1] / "y"
    # URL encoding means nothing to a file system: "%2e%2e" is a folder name, not a way up
    assert roots.resolve("f", "%2e%2e/%2e%2e/etc/passwd") == roots.data_dir / "%2e%2e" / "%2e%2e" / "etc" / "passwd"
    assert roots.resolve("f", "..%2f..%2fetc") == roots.data_dir / "..%2f..%2fetc"


@pytest.mark.parametrize("value", ["../../etc/passwd", "/etc/passwd", "/", "..", "data/../../shared-not",
                                   "corpus/../../../../../../../../etc"])
def test_paths_climbing_out_are_refused(roots, value):
    message = refused(roots, value)
    assert "outside the folders this server lets jobs use" in message and str(roots.data_dir) in message


def test_symlinks_are_followed(roots, outside):
    (roots.data_dir / "out").symlink_to(outside)
    (roots.data_dir / "to-shared").symlink_to(roots.roots[1])
    refused(roots, "out/corpus.txt")
    refused(roots, str(roots.data_dir / "out"))
    assert roots.resolve("f", "to-shared/corpus") == roots.roots[1] / "corpus"
    (roots.data_dir / "loop").symlink_to(roots.data_dir / "loop")
    refused(roots, "loop/x")  # a symlink loop: refused, not a crash


def test_bad_strings_are_refused(roots):
    assert "NUL" in refused(roots, "corpus\x00.txt")
    assert "non-empty" in refused(roots, "")
    refused(roots, "x" * 5000)  # longer than any path may be: outside, or unresolvable; never an OSError


@pytest.mark.parametrize("pattern", ["../*", "**/../../*", "/etc/*", "", "a/../../b", "..\\..\\x",
                                     "**/*\ud800"])  # as a row stored by an older version holds it: refused at launch
def test_globs_stay_in_the_dataset_folder(pattern):
    with pytest.raises(ConfigError) as info:
        check_file_glob(pattern)
    assert info.value.field == "data_config.file_glob"


def test_stdlib_stays_allowed_and_data_paths_are_resolved(roots):
    data = confine_data({"dataset_path": "@stdlib", "tokenizer_path": "tok", "file_glob": "**/*.py", "cache_dir": "cache"},
                        roots)
    assert data == {"dataset_path": "@stdlib", "tokenizer_path": str(roots.data_dir / "tok"), "file_glob": "**/*.py",
                    "cache_dir": str(roots.data_dir / "cache")}


def test_checkpoint_dir_never_holds_the_service_files(roots):
    for value in (".", str(roots.data_dir), "jobs", str(roots.data_dir.parent)):
        with pytest.raises(ConfigError) as info:
            confine_checkpoint_dir(value, roots)
        assert info.value.field == "checkpoint_config.checkpoint_dir"
    assert confine_checkpoint_dir("runs/a", roots) == roots.data_dir / "runs" / "a"


def submitted_corpus(roots: AllowedRoots) -> tuple[Path, dict]:
    """An empty corpus folder under the data dir and a stored job config naming it, checked once."""
    corpus = roots.data_dir / "corpus"
    corpus.mkdir()
    config = {"checkpoint_config": {"checkpoint_dir": str(roots.data_dir / "ckpt")},
              "data_config": {"dataset_path": str(corpus), "tokenizer_path": str(roots.data_dir / "tok")}}
    check_confined(config, roots)
    return corpus, config


def test_a_symlink_swapped_in_after_submission_is_caught_at_launch(roots, outside):
    corpus, config = submitted_corpus(roots)
    corpus.rmdir()
    corpus.symlink_to(outside)
    with pytest.raises(ConfigError) as info:
        check_confined(config, roots)
    assert info.value.field == "data_config.dataset_path"
    narrower = AllowedRoots(roots.roots[1])  # a server restarted without that root
    with pytest.raises(ConfigError):
        check_confined({**config, "data_config": {**config["data_config"], "dataset_path": "@stdlib"}}, narrower)


def dataset_with_links(roots: AllowedRoots, outside: Path) -> Path:
    """A dataset folder under the data dir: a real file, a file link and a folder link pointing
    out, and a link to a file in the shared root (allowed)."""
    (outside / "secret.txt").write_text("not for training")
    (roots.roots[1] / "shared.txt").write_text("shared text")
    corpus = roots.data_dir / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("text")
    (corpus / "to-shared.txt").symlink_to(roots.roots[1] / "shared.txt")
    (corpus / "leak.txt").symlink_to(outside / "secret.txt")
    (corpus / "link_out").symlink_to(outside)
    return corpus


@pytest.mark.parametrize("file_glob", ["link_out/*", "**/*", "*.txt", "**/*.txt"])
def test_dataset_files_are_confined_after_following_links(roots, outside, file_glob):
    """Issue 28: the dataset folder was confined, its files were not: `link_out/*` (a folder link
    pointing out), or the default `**/*` over a file link, read files outside every root."""
    corpus = dataset_with_links(roots, outside)
    data = {"dataset_path": str(corpus), "tokenizer_path": "tok", "file_glob": file_glob}
    with pytest.raises(ConfigError) as info:
        confine_data(data, roots)
    assert info.value.field == "data_config.dataset_path" and "links pointing out are refused" in str(info.value)
    assert str(outside) in str(info.value)
    for link in ("leak.txt", "link_out"):
        (corpus / link).unlink()
    assert confine_data(data, roots)["dataset_path"] == str(corpus)  # a link to the shared root is fine


def test_the_trainer_skips_links_planted_after_the_check(roots, outside):
    """Between the check and the read a link can appear: the trainer, given the roots, skips it."""
    from pagedllm.training.corpus import iter_documents, source_files

    corpus = dataset_with_links(roots, outside)
    names = lambda files: sorted(f.name for f in files)  # noqa: E731
    assert names(source_files(str(corpus), "**/*", roots.roots)) == ["a.txt", "to-shared.txt"]
    assert "leak.txt" in names(source_files(str(corpus), "**/*"))  # `pagedllm train` by hand: no roots
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDLLM_ALLOWED_ROOTS", ":".join(str(r) for r in roots.roots))
        assert all(doc.text != "not for training" for doc in iter_documents(str(corpus)))


def test_a_link_planted_in_the_dataset_after_submission_is_caught_at_launch(roots, outside):
    corpus, config = submitted_corpus(roots)
    (outside / "secret.txt").write_text("not for training")
    (corpus / "leak.txt").symlink_to(outside / "secret.txt")
    with pytest.raises(ConfigError, match="links pointing out are refused"):
        check_confined(config, roots)


def test_the_service_files_are_never_data(roots):
    (roots.data_dir / "jobs.db").write_text("")
    (roots.data_dir / ".checkpoint-key").write_text("00")
    for value in ("jobs.db", ".checkpoint-key"):
        with pytest.raises(ConfigError, match="job service's own files"):
            confine_data({"dataset_path": value, "tokenizer_path": "tok"}, roots)
    with pytest.raises(ConfigError, match="job service's own files"):
        confine_data({"dataset_path": str(roots.data_dir), "tokenizer_path": "tok", "file_glob": "*.db"}, roots)


# ---- over HTTP, on the real server (its roots: its data dir and pytest's base temp folder) -------------------------

@pytest.mark.parametrize("section, field, value", [
    ("checkpoint_config", "checkpoint_dir", "/etc/pagedllm-checkpoints"),
    ("checkpoint_config", "checkpoint_dir", "../../../../../../../../etc/pagedllm-checkpoints"),
    ("data_config", "dataset_path", "/etc/passwd"),
    ("data_config", "dataset_path", "../../../../../../../../etc"),
    ("data_config", "tokenizer_path", "/etc"),
    ("data_config", "cache_dir", "/var/tmp/pagedllm-cache"),
    ("data_config", "file_glob", "../../../../etc/*"),
])
def test_paths_outside_are_400_naming_the_field(server, tiny_paths, section, field, value):
    before = len(server.client.get("/v1/training/jobs").json()["data"])
    body = job_body(tiny_paths)
    body.setdefault(section, {})[field] = value
    error = assert_error(server.client.post("/v1/training/jobs", json=body), 400, f"{section}.{field}")
    assert error["code"] == "invalid_config"
    assert len(server.client.get("/v1/training/jobs").json()["data"]) == before
    assert not Path("/etc/pagedllm-checkpoints").exists() and not Path("/var/tmp/pagedllm-cache").exists()


def test_symlinks_pointing_out_are_400(server, tiny_paths, tmp_path, outside):
    (outside / "tokenizer").mkdir()
    for file in tiny_paths["tokenizer"].iterdir():  # a real tokenizer, so only the path can be wrong
        (outside / "tokenizer" / file.name).write_bytes(file.read_bytes())
    (tmp_path / "tok").symlink_to(outside / "tokenizer")
    (tmp_path / "ckpt").symlink_to(outside)
    body = job_body(tiny_paths)
    body["data_config"]["tokenizer_path"] = str(tmp_path / "tok")
    assert_error(server.client.post("/v1/training/jobs", json=body), 400, "data_config.tokenizer_path")
    body = job_body(tiny_paths, checkpoint_config={"checkpoint_dir": str(tmp_path / "ckpt" / "run")})
    assert_error(server.client.post("/v1/training/jobs", json=body), 400, "checkpoint_config.checkpoint_dir")
    assert list(outside.iterdir()) == [outside / "tokenizer"]
    corpus = tmp_path / "corpus"  # a dataset folder with a file link leading out: the default glob takes it
    corpus.mkdir()
    for file in tiny_paths["corpus"].iterdir():
        (corpus / file.name).write_bytes(file.read_bytes())
    (corpus / "leak.txt").symlink_to(outside / "tokenizer" / "tokenizer.json")
    body = job_body(tiny_paths)
    body["data_config"]["dataset_path"] = str(corpus)
    error = assert_error(server.client.post("/v1/training/jobs", json=body), 400, "data_config.dataset_path")
    assert "links pointing out are refused" in error["message"]


@pytest.mark.parametrize("path", ["..%2F..%2Fjobs.db", "%2e%2e", "..%2f..%2f..%2fetc%2fpasswd", "%2E%2E%2Fservice.lock"])
def test_url_encoded_job_ids_reach_no_file(server, path):
    for suffix in ("/logs", "", "/checkpoints", "/metrics"):
        response = server.client.get(f"/v1/training/jobs/{path}{suffix}")
        assert response.status_code == 404, response.text
        assert "jobs.db" not in response.text or "no training job" in response.text
    raw = httpx.get(server.url + "/v1/training/jobs/../../jobs.db", headers=dict(server.client.headers))
    assert raw.status_code == 404


def test_interval_zero_means_off_over_rest(server, tiny_paths):
    body = job_body(tiny_paths, ranks=1, steps=100000,
                    checkpoint_config={"checkpoint_interval_minutes": 0, "checkpoint_interval_steps": 0})
    job_id = server.submit(body)
    config = json.loads((server.data_dir / "jobs" / job_id / "job.json").read_text())["checkpoint_config"]
    assert (config["checkpoint_interval_minutes"], config["checkpoint_interval_steps"]) == (0, 0)
    response = server.client.delete(f"/v1/training/jobs/{job_id}", params={"grace_seconds": 0})
    assert response.status_code == 200 and response.json()["status"] == "CANCELLED", response.text
