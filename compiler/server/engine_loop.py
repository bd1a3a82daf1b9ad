"""One thread drives Engine.step() for every connection; outputs go to per-request asyncio queues.

The Engine is not thread-safe, so only this thread touches it: the event loop posts adds and aborts to a
command queue, which the thread applies between steps (an abort therefore frees its KV blocks before the next
step). One add carries all the engine requests of an HTTP request (prompts x n), so they start in the same step.
Each step's outputs are handed to the event loop in one call_soon_threadsafe, then routed by request id. At start
and after every batch of commands and every step the thread publishes a stats snapshot, which admission control
and /metrics read without touching the engine. abort_all (the shutdown drain's deadline) ends every request in
flight with an error; when the thread stops, it aborts whatever is left, so no request keeps its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kiln.errors import KilnError, RequestError
from kiln.runtime.engine import Engine, EngineStats
from kiln.runtime.request import RequestOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.server.metrics import ServerMetrics
from kiln.server.protocol import APIError

log = logging.getLogger("kiln.server")

Job = tuple[str, list[int], SamplingParams]  # (request id, prompt ids, params): one engine request


@dataclass
class _Add:
    jobs: list[Job]
    future: asyncio.Future
    sink: asyncio.Queue
    label: Callable[[int], str] | None = None  # names job k in a RequestError ("prompt 1" of a batch)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _AbortAll:
    error: Exception


class EngineFailure(KilnError):
    """The engine raised inside a step; every request in flight at that moment is failed with this."""


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, asyncio.Queue] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._last_token: dict[str, float] = {}
        self._posted = 0  # event-loop side: adds posted so far
        # The engine thread publishes its stats and how many adds it had applied by then as one tuple, so the
        # two always agree: a request is counted either as applied (in the stats) or as pending, never both.
        self._published: tuple[EngineStats, int] = (engine.stats, 0)
        self._applied = 0  # engine-thread side
        self._closed: APIError | None = None  # set by abort_all: later adds are refused with it
        self.num_steps = 0

    # ---- event-loop side ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._publish()  # the pool's size is on /metrics before the first request (the thread is not running yet)
        self._thread = threading.Thread(target=self._run, name="kiln-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread (it aborts the requests left) and wait up to `timeout` seconds for its step to end."""
        self._stop.set()
        self._commands.put(None)  # wake the thread
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    @property
    def snapshot(self) -> EngineStats:
        """The engine's stats after its last batch of commands or step (read without touching the engine)."""
        return self._published[0]

    @property
    def num_waiting(self) -> int:
        """Requests waiting to run: the engine's waiting queue, plus adds posted that it has not applied yet."""
        st, applied = self._published
        return st.num_waiting + self._posted - applied

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def add(self, jobs: Sequence[Job], sink: asyncio.Queue, label: Callable[[int], str] | None = None) -> None:
        """Queue the engine requests of one HTTP request (its prompts x n choices) as one command: the thread adds
        them all between two steps, so every choice starts in the same step (vLLM adds all n at once too), or none
        of them: the engine's RequestError for one (a bad prompt) withdraws the others and is raised here, led by
        label(k) for the k-th job when a label is given."""
        if self._closed is not None:
            raise self._closed.again()
        fut = asyncio.get_running_loop().create_future()
        self._posted += len(jobs)
        self._commands.put(_Add(list(jobs), fut, sink, label))
        await fut

    def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._commands.put(_Abort(rid))

    def abort_all(self, error: APIError) -> None:
        """End every request in flight with `error` (their sinks get it, their KV is freed) and refuse later adds
        with it: the shutdown drain's deadline."""
        self._closed = error
        self._commands.put(_AbortAll(error))

    # ---- engine thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        dev = self.engine.model.device
        if dev.type == "cuda" and dev.index is not None:
            torch.cuda.set_device(dev)  # CUDA's current device is per thread, and Triton launches on it
        while not self._stop.is_set():
            # Block for work only when the engine is idle; otherwise just drain what has arrived.
            self._apply(block=not self.engine.has_unfinished())
            if self._stop.is_set() or not self.engine.has_unfinished():
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # fail the requests in flight, keep serving new ones
                log.error("the engine failed during a step; the requests in flight are failed, new ones are served%s",
                          "" if isinstance(e, KilnError) else "; this is a bug in kiln", exc_info=e)
                self._fail_all(EngineFailure(f"the engine failed during a step ({type(e).__name__}: {e}); "
                                             "the request was aborted, retry it"))
                continue
            self.num_steps += 1
            self._publish()
            sampled = sum(1 for o in outs if o.outputs[0].delta_token_ids)  # finished ones left `running` already
            self.metrics.step(max(sampled, self.snapshot.num_running))
            self._route(outs)
        # Stopped (the drain is over, or was cut short): nothing may keep running, nor hold KV blocks.
        self._apply(block=False)
        self._fail_all(APIError(503, "the server stopped before this request finished; retry it",
                                code="server_stopped"))

    def _apply(self, block: bool) -> None:
        cmds = []
        try:
            cmds.append(self._commands.get(timeout=0.5) if block else self._commands.get_nowait())
            while True:
                cmds.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        done = []
        for cmd in cmds:
            if isinstance(cmd, _Add):
                self._applied += len(cmd.jobs)  # refused or not, they are no longer pending
                done.append((cmd.future, self._add(cmd)))
            elif isinstance(cmd, _Abort):
                if self.engine.abort(cmd.request_id, notify=False):
                    self.metrics.aborted.inc()
                self._sinks.pop(cmd.request_id, None)
                self._last_token.pop(cmd.request_id, None)
            elif isinstance(cmd, _AbortAll):
                self._fail_all(cmd.error)
        if cmds:
            self._publish()  # before the futures resolve, so admission control sees these requests
        if done:
            self._post(_resolve, done)

    def _add(self, cmd: _Add) -> Exception | None:
        """Add every job of `cmd`, or none: a bad request is refused alone, the other HTTP requests go on."""
        added: list[str] = []
        for k, (rid, prompt, params) in enumerate(cmd.jobs):
            try:
                self.engine.add_request(prompt, params, rid)
            except Exception as e:
                for other in added:
                    self.engine.abort(other, notify=False)
                if isinstance(e, RequestError) and cmd.label is not None:
                    return RequestError(f"{cmd.label(k)}: {e}", param=e.param, code=e.code)
                return e
            added.append(rid)
        for rid in added:
            self._sinks[rid] = cmd.sink
        return None

    def _publish(self) -> None:
        st = self.engine.stats
        self._published = (st, self._applied)
        self.metrics.engine_stats(st)

    def _route(self, outs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        batch = []
        for out in outs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            comp = out.outputs[0]
            k = len(comp.delta_token_ids)
            if k:
                self.metrics.generated.inc(k)
                last = self._last_token.get(out.request_id)
                if last is None:
                    self.metrics.prompt.inc(len(out.prompt_token_ids))
                    if out.metrics.first_token_time is not None:
                        self.metrics.ttft.observe(out.metrics.first_token_time - out.metrics.arrival_time)
                else:
                    for _ in range(k):
                        self.metrics.itl.observe((now - last) / k)
                self._last_token[out.request_id] = now
            if out.finished:
                self._sinks.pop(out.request_id, None)
                self._last_token.pop(out.request_id, None)
                self.metrics.finished(comp.finish_reason or "stop")
            batch.append((sink, out))
        if batch:
            self._post(_deliver, batch)

    def _fail_all(self, err: Exception) -> None:
        batch = []
        for rid, sink in list(self._sinks.items()):
            self.engine.abort(rid, notify=False)
            batch.append((sink, err))
        self._sinks.clear()
        self._last_token.clear()
        self._publish()
        if batch:
            self._post(_deliver, batch)

    def _post(self, fn, items: list) -> None:
        """Hand `items` to the event loop, unless it has closed (a forced exit): nobody is waiting any more."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, items)


def _resolve(done: list) -> None:
    for fut, err in done:
        if fut.done():  # the caller went away while waiting
            continue
        if err is None:
            fut.set_result(None)
        else:
            fut.set_exception(err)


def _deliver(batch: list) -> None:
    for sink, item in batch:
        sink.put_nowait(item)
