"""`kiln serve` as a process, and `kiln bench serve` against a live server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.support.served_llm import serve_llm

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


def test_bench_serve_takes_the_url_serve_prints_or_a_bare_host():
    from kiln.cli.serve import server_root

    assert server_root("http://127.0.0.1:8000/v1") == server_root("127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert server_root("https://host/kiln/v1/") == "https://host/kiln"


def test_serve_refuses_a_bad_port():
    res = subprocess.run([sys.executable, "-m", "kiln", "serve", "tiny-llama", "--port", "70000"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--port 70000" in res.stderr


def test_bench_serve_reports_latencies_and_writes_json(llm, tmp_path, capsys):
    from kiln.cli import main

    with serve_llm(llm, engine=llm.engine) as url:
        # the URL as `kiln serve` prints it, /v1 and all
        rc = main(["bench", "serve", "--base-url", f"{url}/v1/", "--num-requests", "8", "--input-len", "4:12",
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


@pytest.fixture
def served(monkeypatch):
    """`kiln serve` up to the point where uvicorn would run: the DrainingServer it built, run with no server."""
    from kiln.server.drain import DrainingServer

    built: list[DrainingServer] = []
    monkeypatch.setattr(DrainingServer, "run", lambda self, sockets=None: built.append(self))
    return built


def test_serve_warns_when_max_prompt_tokens_cannot_apply(served, capsys):
    from kiln.cli import main

    argv = ["serve", "tiny-llama", "--device", "cpu", "--port", "0", "--num-blocks", "40", "--max-model-len", "128"]
    assert main([*argv, "--max-prompt-tokens", "1000"]) == 0
    err = capsys.readouterr().err
    assert "--max-prompt-tokens 1000 is over the max model length of 128" in err and "has no effect" in err
    assert main([*argv, "--max-prompt-tokens", "100"]) == 0
    assert "--max-prompt-tokens" not in capsys.readouterr().err
    assert main([*argv, "--max-prompt-tokens", "0"]) == 2 and "give a number of tokens >= 1" in capsys.readouterr().err


def test_serve_bounds_the_shutdown_drain(served, capsys):
    from kiln.cli import main
    from kiln.server.drain import ANSWER_S

    argv = ["serve", "tiny-llama", "--device", "cpu", "--port", "0", "--num-blocks", "40"]
    assert main(argv) == 0 and main([*argv, "--timeout-graceful-shutdown", "2.5"]) == 0
    assert [s.drain_s for s in served] == [30, 2.5]
    assert [s.config.timeout_graceful_shutdown for s in served] == [30 + ANSWER_S, 2.5 + ANSWER_S]
    assert main([*argv, "--timeout-graceful-shutdown", "-1"]) == 2 and "give seconds >= 0" in capsys.readouterr().err
    help_text = subprocess.run([sys.executable, "-m", "kiln", "serve", "--help"], capture_output=True, text=True,
                               timeout=120, env={**os.environ, "COLUMNS": "1000"}).stdout  # one line per flag
    assert "--timeout-graceful-shutdown SECONDS" in help_text and "vLLM's --shutdown-timeout" in help_text
