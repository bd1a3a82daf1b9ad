"""`kiln serve`'s vLLM-compatible flags: --served-model-name (one or more; by default the model argument as given),
CORS (--allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials), --max-waiting (no limit by
default), --max-body-bytes (32 MiB by default, 0: none) and --log-level reaching kiln's server log."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

pytest.importorskip("httpx")

SPEC = str(Path(__file__).resolve().parents[2] / "specs" / "tiny-llama.kiln")
BASE = ["--device", "cpu", "--port", "0", "--num-blocks", "40"]


@pytest.fixture
def served(monkeypatch):
    """`kiln serve` up to the point where uvicorn would run: the DrainingServer it built, run with no server."""
    from kiln.server.drain import DrainingServer

    built: list[DrainingServer] = []
    monkeypatch.setattr(DrainingServer, "run", lambda self, sockets=None: built.append(self))
    return built


def _client(server):
    from starlette.testclient import TestClient

    return TestClient(server.config.app)  # no lifespan: the routes used here need no engine loop


def _ns(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"served_model_name": None, "spec": None, "weights": None, **kw})


def test_served_names_default_to_the_model_argument_as_given():
    from kiln.cli.serve import served_names

    assert served_names(_ns(spec="tiny-llama"), "tiny-llama") == (["tiny-llama"], [])
    assert served_names(_ns(spec="specs/x.kiln"), "x") == (["specs/x.kiln"], ["x"])
    assert served_names(_ns(weights="/ckpt/Llama-3.2-1B/"), "llama") == (["/ckpt/Llama-3.2-1B/"], ["llama"])
    assert served_names(_ns(spec="llama-3.2-1b", weights="/ckpt"), "llama-3.2-1b") == (["llama-3.2-1b"], ["/ckpt"])
    assert served_names(_ns(), "tiny-llama") == (["tiny-llama"], [])
    assert served_names(_ns(spec="s.kiln", served_model_name=["a", "b"]), "s") == (["a", "b"], [])


def test_serve_reports_the_spec_path_as_given_and_accepts_the_specs_name(served, capsys):
    from kiln.cli import main

    assert main(["serve", SPEC, *BASE]) == 0
    assert f"serving {SPEC} on http://" in capsys.readouterr().err
    c = _client(served[0])
    assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [SPEC]
    for name in (SPEC, "tiny-llama"):
        assert c.get(f"/v1/models/{name}").status_code == 200
    assert c.get("/v1/models/other").status_code == 404


def test_served_model_name_takes_several_names(served, capsys):
    from kiln.cli import main

    assert main(["serve", "tiny-llama", *BASE, "--served-model-name", "org/a", "b"]) == 0
    assert "serving org/a on http://" in capsys.readouterr().err
    c = _client(served[0])
    assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["org/a", "b"]
    assert c.get("/v1/models/tiny-llama").status_code == 404  # named explicitly: only those names, as vLLM


def test_cors_flags(served, capsys):
    from kiln.cli import main

    assert (
        main(
            [
                "serve",
                "tiny-llama",
                *BASE,
                "--allowed-origins",
                '["https://ok.example"]',
                "--allowed-methods",
                '["GET", "POST"]',
                "--allowed-headers",
                '["content-type"]',
                "--allow-credentials",
            ]
        )
        == 0
    )
    c = _client(served[0])
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    ok = c.options("/v1/completions", headers={"Origin": "https://ok.example", **ask})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ok.example"
    assert ok.headers["access-control-allow-credentials"] == "true"
    assert c.options("/v1/completions", headers={"Origin": "https://no.example", **ask}).status_code == 400
    assert main(["serve", "tiny-llama", *BASE]) == 0  # default: any origin, as vLLM
    any_origin = _client(served[1]).options("/v1/completions", headers={"Origin": "https://no.example", **ask})
    assert any_origin.status_code == 200 and any_origin.headers["access-control-allow-origin"] == "*"
    with pytest.raises(SystemExit) as e:
        main(["serve", "tiny-llama", *BASE, "--allowed-origins", "https://ok.example"])
    assert (
        e.value.code == 2
        and "--allowed-origins https://ok.example: give a JSON list of strings" in capsys.readouterr().err
    )


def test_queue_and_body_limits_are_checked(served, capsys):
    from kiln.cli import main

    for flag, value, said in (
        ("--max-waiting", "0", "give a number of requests >= 1"),
        ("--max-body-bytes", "-1", "give a size in bytes >= 1, or 0 for no limit"),
    ):
        assert main(["serve", "tiny-llama", *BASE, flag, value]) == 2
        assert said in capsys.readouterr().err


def test_serve_passes_its_limits_to_the_server(served, monkeypatch):
    """What the flags become: ServerConfig's max_waiting (None: no limit) and max_body_bytes (None: no limit)."""
    import kiln.server as server_pkg
    from kiln.cli import main

    configs = []
    real = server_pkg.build_app
    monkeypatch.setattr(server_pkg, "build_app", lambda engine, cfg: configs.append(cfg) or real(engine, cfg))
    assert main(["serve", "tiny-llama", *BASE]) == 0
    assert main(["serve", "tiny-llama", *BASE, "--max-waiting", "8", "--max-body-bytes", "0"]) == 0
    assert [(c.max_waiting, c.max_body_bytes) for c in configs] == [(None, 32 << 20), (8, None)]


def test_log_level_info_shows_the_servers_info_lines(served):
    from kiln.cli import main

    server_log = logging.getLogger("kiln.server")
    before = server_log.level
    try:
        assert main(["serve", "tiny-llama", *BASE, "--log-level", "info"]) == 0
        assert server_log.getEffectiveLevel() == logging.INFO
        assert main(["serve", "tiny-llama", *BASE]) == 0
        assert server_log.getEffectiveLevel() == logging.WARNING
    finally:
        server_log.setLevel(before)
