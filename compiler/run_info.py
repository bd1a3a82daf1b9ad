"""Where a run happened, for every benchmark result kiln writes: device, versions, git commit, date."""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# Written by bench/gpu/wheels.sh where git works: the GPU machine gets the working tree without .git, and
# .gpu/deps travels with every call of the GPU session (bench/gpu/README.md).
COMMIT_FILE = ROOT / ".gpu" / "deps" / "COMMIT"


def device_name(device: torch.device | str | None = None) -> str:
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def git_commit() -> str:
    """The checkout's commit (with -dirty when tracked files changed); outside a git checkout the one recorded in
    COMMIT_FILE, else "unknown"."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        recorded = COMMIT_FILE.read_text().strip()
    except OSError:
        recorded = ""
    return recorded or "unknown"


def run_metadata(device: torch.device | str | None = None) -> dict:
    """device, torch, triton, cuda, commit and date (UTC) of this run."""
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    return {"device": device_name(device), "torch": torch.__version__, "triton": triton, "cuda": torch.version.cuda,
            "commit": git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
