"""Result files of the scripts in bench/: named by benchmark, device and day; the run metadata (device,
versions, commit, date) comes from kiln.run_info, the same as `kiln bench`'s."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from kiln.run_info import device_name, run_metadata  # noqa: F401  (re-exported to the bench scripts)


def result_path(out_dir: str | Path, name: str) -> Path:
    slug = "".join(c if c.isalnum() else "-" for c in device_name().lower()).strip("-")
    day = dt.date.today().isoformat()
    return Path(out_dir) / f"{name}-{slug[:40]}-{day}.json"


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
