"""`kiln serve` as a process, and `kiln bench serve` against a live server."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kiln_serve_process_answers_and_stops():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "serve", "tiny-llama", "--device", "cpu", "--port",
                             str(port), "--api-key", "k"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kiln serve did not come up in 120 s"
            time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers={"Authorization": "Bearer k"},
                       json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "serving tiny-llama on http://127.0.0.1" in proc.stderr.read()


def test_serve_refuses_a_bad_port():
    res = subprocess.run([sys.executable, "-m", "kiln", "serve", "tiny-llama", "--port", "70000"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--port 70000" in res.stderr


def test_bench_serve_reports_latencies_and_writes_json(tmp_path, capsys):
    from kiln import LLM
    from kiln.cli import main
    from kiln.server import ServerConfig
    from kiln.server.background import serve_in_thread

    llm = LLM("tiny-llama", device="cpu", seed=0, use_kernels=False)
    with serve_in_thread(llm.engine, ServerConfig(model_name="tiny-llama")) as url:
        rc = main(["bench", "serve", "--base-url", url, "--num-requests", "8", "--input-len", "4:12",
                   "--output-len", "4:8", "--request-rate", "50", "--out-dir", str(tmp_path), "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    (path,) = tmp_path.glob("serve-tiny-llama-*.json")
    assert json.loads(path.read_text()) == res
    assert res["completed"] == 8 and res["failed"] == 0 and res["trace"]["num_requests"] == 8
    assert 8 * 4 <= res["total_output_tokens"] <= 8 * 8 and res["output_throughput"] > 0
    for k in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert set(res[k]) == {"mean", "p50", "p99"} and 0 < res[k]["p50"] <= res[k]["p99"]
    assert {"device", "torch", "commit", "date"} <= set(res)


def test_bench_serve_without_a_server_names_the_fix():
    res = subprocess.run([sys.executable, "-m", "kiln", "bench", "serve", "--base-url",
                          f"http://127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "start one with `kiln serve SPEC`" in res.stderr
