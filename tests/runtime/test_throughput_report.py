"""The throughput report's words follow its figures: a higher TTFT is called higher."""

from kiln.runtime.throughput import format_report


def _run(ttft: float) -> dict:
    stats = {"mean": ttft, "p50": ttft, "p99": ttft}
    return {"requests_per_s": 1.0, "output_tokens_per_s": 10.0, "ttft_s": stats, "tpot_s": stats}


def test_the_ttft_ratio_is_worded_by_its_direction():
    lower = format_report({"continuous": _run(0.1), "static": _run(0.2),
                           "speedup": {"output_tokens_per_s": 1.5, "ttft_mean": 2.0}})
    assert "2.00x lower mean TTFT" in lower
    higher = format_report({"continuous": _run(1.9), "static": _run(0.1),
                            "speedup": {"output_tokens_per_s": 0.9, "ttft_mean": 0.1 / 1.9}})
    assert "19.00x higher mean TTFT" in higher and "lower" not in higher


def test_the_table_shows_each_policys_figures_in_its_units():
    report = format_report({
        "continuous": {"requests_per_s": 31.894, "output_tokens_per_s": 1850.84,
                       "ttft_s": {"mean": 0.687, "p50": 0.6754, "p99": 1.6439},
                       "tpot_s": {"mean": 0.0078, "p50": 0.00769, "p99": 0.00892}},
        "static": {"requests_per_s": 32.7, "output_tokens_per_s": 1897.66,
                   "ttft_s": {"mean": 0.757, "p50": 1.019, "p99": 1.506},
                   "tpot_s": {"mean": 0.00638, "p50": 0.0063, "p99": 0.0087}},
        "speedup": {"output_tokens_per_s": 0.9753, "ttft_mean": 1.102},
        "warmup": {"requests": 4, "prompt_len": 16, "output_len": 4, "elapsed_s": 0.0269}})
    lines = report.splitlines()
    # req/s, out tok/s, TTFT mean / p50 / p99 in ms, TPOT mean / p50 / p99 in ms
    assert lines[1].split() == ["continuous", "31.89", "1850.8", "687ms", "675ms", "1644ms", "7.8ms", "7.7ms",
                                "8.9ms"]
    assert lines[2].split() == ["static", "32.70", "1897.7", "757ms", "1019ms", "1506ms", "6.4ms", "6.3ms", "8.7ms"]
    assert lines[3] == "continuous / static: 0.98x output tokens/s, 1.10x lower mean TTFT"
    assert lines[4] == "(after an untimed warm-up of 4 requests, 16 prompt + 4 output tokens each, 0.03 s)"
