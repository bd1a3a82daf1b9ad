"""`kiln bench throughput --profile`: a cProfile summary of the continuous run, written as text."""

from __future__ import annotations

import json

from kiln.cli.commands import main


def test_bench_throughput_profile_writes_a_summary(tmp_path, capsys):
    path = tmp_path / "prof" / "throughput.txt"
    code = main(["bench", "throughput", "tiny-llama", "--num-requests", "3", "--input-len", "4:8",
                 "--output-len", "2:4", "--max-num-seqs", "2", "--device", "cpu", "--json", "--profile", str(path)])
    assert code == 0
    assert json.loads(capsys.readouterr()[0])["profile"] == str(path)
    text = path.read_text()
    assert "top 40 by cumulative" in text and "top 40 by tottime" in text
    assert "prepare" in text and "step" in text  # the engine's host work shows up
