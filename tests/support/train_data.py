"""Training data for router and scratch-training tests: a Shakespeare excerpt as byte ids and a 4-layer tiny-llama."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kiln.spec.loader import load_spec

TEXT = (Path(__file__).resolve().parents[2] / "bench" / "data" / "shakespeare-calibration.txt").read_bytes()[:6000]


DENSE = dataclasses.replace(load_spec("tiny-llama").model, layers=4)


IDS = list(TEXT)  # bytes < 256 < vocab 512
