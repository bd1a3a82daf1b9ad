"""bench/mod_routers.py on a tiny budget: the JSON and the plot it writes (figures checked for shape, not value)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.support.bench_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_mod_scratch_bench_writes_json_and_plot(tmp_path, monkeypatch):
    mod = load_script("mod_routers.py", monkeypatch)
    assert mod.main(["scratch", "--capacities", "0.5", "--steps", "2", "--batch", "2", "--seq-len", "32",
                     "--window", "64", "--eval-tokens", "200", "--out-dir", str(tmp_path)]) == 0
    [path] = tmp_path.glob("mod-scratch-*.json")
    r = json.loads(path.read_text())
    dense, routed = r["rows"]
    assert dense["capacity"] is None and routed["capacity"] == 0.5 and r["eval_bytes"] == 200
    assert set(routed["routed_fraction"]) == {"1", "3", "5"}
    assert routed["flops_per_token"] < dense["flops_per_token"]
    assert all(row["perplexity_causal"] > 1 for row in r["rows"]) and routed["perplexity_training_form"] > 1
    assert {"torch", "commit", "date", "device"} <= set(r)
    svg = ET.parse(path.with_suffix(".svg")).getroot()
    assert sum(el.tag.endswith("circle") for el in svg) == 2  # one point per model
