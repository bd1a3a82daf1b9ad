"""uvicorn's Server with a bounded shutdown drain, for `kiln serve` and serve_in_thread.

On SIGTERM or Ctrl-C uvicorn stops accepting connections and waits for the requests in flight, by default for as
long as they take. DrainingServer lets them run for at most `drain_s` seconds, then aborts them through the engine
loop: their KV blocks are freed, non-streaming clients get a 503 in OpenAI's error shape and streams an error event
and [DONE]. uvicorn's own timeout (timeout_graceful_shutdown, set ANSWER_S later) cancels what still has not
finished then, a client that stopped reading, say; a cancelled handler would get uvicorn's plain-text 500.
A second Ctrl-C (uvicorn's force exit) aborts the requests at once and gives their handlers up to ANSWER_S to send
those errors, instead of leaving the plain-text 500s of cancelled handlers, then runs the lifespan's shutdown that
uvicorn skips (it stops the engine thread), bounded by ANSWER_S too.
From the moment the drain is asked for (a signal, or should_exit set), /health answers 503, so that a load balancer
stops sending requests, while the requests in flight go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI

from kiln.server.engine_loop import EngineLoop
from kiln.server.protocol import APIError

log = logging.getLogger("kiln.server")
ANSWER_S = 5.0  # after the aborts, how long the handlers have to send their errors before uvicorn cancels them


class DrainingServer(uvicorn.Server):
    def __init__(self, app: FastAPI, drain_s: float | None, **config: Any):
        """app: from build_app; drain_s: the drain's bound in seconds (None: wait for every request, 0: abort them
        at once); config: uvicorn.Config's other arguments."""
        self._app_state = app.state  # before uvicorn's __init__, which sets should_exit
        grace = None if drain_s is None else drain_s + ANSWER_S
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace, **config))
        self.engine_loop: EngineLoop = app.state.engine_loop
        self.drain_s = drain_s

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        # Where every shutdown starts (uvicorn's signal handler, serve_in_thread's exit): /health turns 503 here, not
        # at uvicorn's next tick, up to 0.1 s later, when it stops listening.
        self._should_exit = value
        if value:
            self._app_state.draining = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        deadline = None
        if self.drain_s is not None:
            deadline = asyncio.get_running_loop().call_later(self.drain_s, self._abort_all, "deadline")
        try:
            await super().shutdown(sockets)  # the drain: waits for the connections to close
        finally:
            if deadline is not None:
                deadline.cancel()
        if self.force_exit:  # uvicorn skips the lifespan's shutdown (a hung one must not hold the exit): bounded here
            self._abort_all("force")
            if handlers := set(self.server_state.tasks):
                await asyncio.wait(handlers, timeout=ANSWER_S)
            with contextlib.suppress(asyncio.TimeoutError):  # the engine thread stops, the lifespan task ends
                await asyncio.wait_for(self.lifespan.shutdown(), ANSWER_S)

    def _abort_all(self, why: str) -> None:
        if why == "deadline":
            st = self.engine_loop.snapshot
            log.warning("shutdown: %d requests still in flight after the %g s drain (--timeout-graceful-shutdown); "
                        "aborting them", st.num_running + st.num_waiting, self.drain_s)
            msg = (f"the server is shutting down and this request did not finish within its {self.drain_s:g} s drain "
                   "(--timeout-graceful-shutdown); retry it")
        else:
            msg = "the server was stopped (forced exit) before this request finished; retry it"
        self.engine_loop.abort_all(APIError(503, msg, code="server_shutting_down"))
