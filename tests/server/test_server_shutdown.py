"""The shutdown drain is bounded: past --timeout-graceful-shutdown the requests in flight are aborted (their KV
freed) and answered with a JSON 503 / an error event; a forced exit (a second Ctrl-C) does the same at once instead
of leaving uvicorn's plain-text 500s."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import pytest

from tests.support.served_llm import llm_engine, serve_llm

httpx = pytest.importorskip("httpx")

LONG = {"prompt": "a", "max_tokens": 200, "ignore_eos": True}  # 200 steps of >= 20 ms: 4 s without an abort
STEP_S = 0.02  # the engines' slow step (llm_engine's step_s)


def _clients(url: str) -> tuple[dict, list[threading.Thread]]:
    """A non-streaming and a streaming request of LONG, each in a thread; what they got lands in the dict."""
    got: dict = {}

    def plain() -> None:
        r = httpx.post(f"{url}/v1/completions", json=LONG, timeout=60)
        got["plain"] = (r.status_code, r.headers.get("content-type"), r.text)

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
            got["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    return got, threads


def _wait_running(url: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while f'kiln_num_requests_running{{model_name="tiny-llama"}} {n}.0' not in httpx.get(f"{url}/metrics").text:
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.02)


def _check_aborted(got: dict, eng) -> None:
    status, ctype, text = got["plain"]
    assert (status, ctype) == (503, "application/json"), (status, ctype, text[:200])
    assert json.loads(text)["error"]["code"] == "server_shutting_down"
    events = got["stream"]
    assert events[-1] == "data: [DONE]" and '"code": "server_shutting_down"' in events[-2], events[-3:]
    assert len(events) < LONG["max_tokens"]  # cut short, not run to the end
    assert not eng.has_unfinished() and not eng.block_manager.tables  # every KV block back in the pool


def _serve(server) -> tuple[threading.Thread, socket.socket, str]:
    """Run a DrainingServer in a thread on a free port until it has started: the thread, its socket and its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return thread, sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_requests_past_the_drain_deadline_are_aborted_with_a_503(llm):
    eng = llm_engine(llm, step_s=STEP_S)
    with serve_llm(llm, engine=eng, drain_s=0.3) as url:
        got, threads = _clients(url)
        _wait_running(url, 2)
    # leaving the block is uvicorn's shutdown (what SIGTERM starts): the drain ran 0.3 s, then aborted both
    for t in threads:
        t.join(timeout=60)
    _check_aborted(got, eng)


def test_a_forced_exit_answers_the_requests_in_flight_with_json(llm):
    from kiln.server import ServerConfig, build_app
    from kiln.server.drain import DrainingServer

    eng = llm_engine(llm, step_s=STEP_S)
    # by hand, not serve_llm: the test signals the DrainingServer itself, as a second Ctrl-C does
    server = DrainingServer(build_app(eng, ServerConfig(model_name="tiny-llama")), None, log_level="critical")
    thread, sock, url = _serve(server)
    got, threads = _clients(url)
    _wait_running(url, 2)
    server.handle_exit(signal.SIGINT, None)  # Ctrl-C: the drain starts, with no bound
    time.sleep(0.3)
    server.handle_exit(signal.SIGINT, None)  # and again: uvicorn's force exit
    thread.join(timeout=60)
    for t in threads:
        t.join(timeout=60)
    sock.close()
    _check_aborted(got, eng)


def test_health_answers_503_once_the_drain_begins_while_requests_in_flight_finish(llm):
    """A load balancer polling /health must see the drain at once (a 503 in OpenAI's error shape), while the
    request in flight runs to its end. uvicorn stops listening within 0.1 s of the signal, so /health is asked here
    through the app itself (the server's own app object) while the server drains."""
    from kiln.server import ServerConfig, build_app
    from kiln.server.drain import DrainingServer

    # by hand, not serve_llm: the test signals the DrainingServer itself and asks its app in process
    app = build_app(llm_engine(llm, step_s=STEP_S), ServerConfig(model_name="tiny-llama"))
    server = DrainingServer(app, None, log_level="critical")
    thread, sock, url = _serve(server)
    got: dict = {}
    body = {**LONG, "max_tokens": 60}
    client = threading.Thread(target=lambda: got.update(r=httpx.post(f"{url}/v1/completions", json=body, timeout=60)))
    client.start()
    _wait_running(url, 1)

    async def health() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kiln") as c:
            return await c.get("/health")

    assert asyncio.run(health()).status_code == 200
    server.handle_exit(signal.SIGTERM, None)  # what `kiln serve` gets: the drain begins, with no bound
    r = asyncio.run(health())
    assert r.status_code == 503 and r.headers["content-type"] == "application/json"
    assert r.json()["error"] | {"message": ""} == {"message": "", "type": "overloaded_error", "param": None,
                                                   "code": "server_shutting_down"}
    assert "shutting down" in r.json()["error"]["message"]
    client.join(timeout=60)
    thread.join(timeout=60)
    sock.close()
    assert got["r"].status_code == 200 and got["r"].json()["usage"]["completion_tokens"] == 60  # ran to its end
