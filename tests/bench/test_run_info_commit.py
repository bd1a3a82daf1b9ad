"""The commit in every result file on the GPU machine, which gets the working tree without .git: bench/gpu/wheels.sh
records it where git works, kiln.run_info reads it back when git gives nothing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kiln import run_info

ROOT = Path(__file__).resolve().parents[2]


def no_git(*args, **kwargs):
    raise FileNotFoundError("git")  # as on a machine without git


def not_a_checkout(cmd, **kwargs):
    return subprocess.CompletedProcess(cmd, 128, "", "fatal: not a git repository")


@pytest.mark.parametrize("git", [no_git, not_a_checkout])
def test_without_git_the_recorded_commit_is_used(tmp_path, monkeypatch, git):
    monkeypatch.setattr(run_info.subprocess, "run", git)
    monkeypatch.setattr(run_info, "COMMIT_FILE", tmp_path / "COMMIT")
    assert run_info.git_commit() == "unknown"
    (tmp_path / "COMMIT").write_text("0123456789abcdef0123456789abcdef01234567-dirty\n")
    assert run_info.git_commit() == "0123456789abcdef0123456789abcdef01234567-dirty"
    assert run_info.run_metadata("cpu")["commit"] == "0123456789abcdef0123456789abcdef01234567-dirty"


def test_git_wins_over_the_recorded_commit(tmp_path, monkeypatch):
    def git(cmd, **kwargs):
        out = "feedface" * 5 if cmd[1] == "rev-parse" else ""
        return subprocess.CompletedProcess(cmd, 0, out + "\n", "")

    monkeypatch.setattr(run_info.subprocess, "run", git)
    monkeypatch.setattr(run_info, "COMMIT_FILE", tmp_path / "COMMIT")
    (tmp_path / "COMMIT").write_text("stale\n")
    assert run_info.git_commit() == "feedface" * 5


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_wheels_sh_records_the_commit_that_run_info_reads(tmp_path, monkeypatch):
    """`wheels.sh --commit` in a throwaway checkout: HEAD, then HEAD-dirty once the tree changed."""
    repo = tmp_path / "repo"
    (repo / "bench" / "gpu").mkdir(parents=True)
    shutil.copy(ROOT / "bench" / "gpu" / "wheels.sh", repo / "bench" / "gpu" / "wheels.sh")
    (repo / ".gitignore").write_text("/.gpu/\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    wheels = ["bash", str(repo / "bench" / "gpu" / "wheels.sh"), "--commit"]
    subprocess.run(wheels, check=True, capture_output=True)
    recorded = repo / ".gpu" / "deps" / "COMMIT"
    assert recorded.read_text().strip() == head  # .gpu/ is ignored: writing it leaves the tree clean
    (repo / "new.py").write_text("x = 1\n")  # untracked files travel to the GPU machine too
    subprocess.run(wheels, check=True, capture_output=True)
    assert recorded.read_text().strip() == head + "-dirty"
    monkeypatch.setattr(run_info.subprocess, "run", no_git)
    monkeypatch.setattr(run_info, "COMMIT_FILE", recorded)
    assert run_info.git_commit() == head + "-dirty"


def test_the_recorded_commit_travels_with_every_call_of_the_session():
    """run_info reads it from .gpu/deps, which every call in bench/gpu/README.md carries."""
    assert run_info.COMMIT_FILE == ROOT / ".gpu" / "deps" / "COMMIT"
    calls = [line for line in (ROOT / "bench" / "gpu" / "README.md").read_text().splitlines()
             if line.startswith("| ") and "session.sh" in line]
    assert len(calls) == 7 and all("`.gpu/deps`" in line for line in calls)
