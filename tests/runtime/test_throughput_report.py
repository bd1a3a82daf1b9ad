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
