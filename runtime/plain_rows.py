"""A step's plain rows (one sampled token per chunk, no drafts): the sampler's device work, then its tokens taken
into the requests.

The two halves run apart so the engine can do host work between them: launch_plain queues the sampling (nothing
waits for the device on CUDA), take_plain makes the step's one device -> host copy and appends each token. A
failure of the whole batch (the sampler raising outside any one row) fails every plain row, not the engine.
"""

from __future__ import annotations

import torch

from kiln.runtime.batch_sampler import BatchSample, LaunchedSample, failure_text, launch_batch
from kiln.runtime.outputs import Made, OutputMaker
from kiln.runtime.sampler import TokenHistory, to_device
from kiln.runtime.schedule import ScheduledSeq


class _BatchLost(Exception):
    """The sampler failed for the whole batch before its host copy (the message says why)."""


def launch_plain(plain: list[ScheduledSeq], rows: list[int], logits: torch.Tensor,
                 eos_token_ids: tuple[int, ...] = ()) -> LaunchedSample | str:
    """The sampler's device work for the plain rows (chunk plain[i]'s logits are row rows[i]), or why it failed
    (then every plain row fails). eos_token_ids: the ids min_tokens holds back besides each request's stop ids."""
    reqs = [s.request for s in plain]
    try:
        # A list index would be a synchronous host -> device copy (the host would wait for the model call).
        rows = logits if len(plain) == logits.shape[0] else logits.index_select(
            0, to_device(torch.tensor(rows), logits.device))
        # The request's own lists, not copies: the sampler reads them before any token is appended. A whole history
        # for every request that may process its logits, also once it needs no processing (past min_tokens): an
        # empty one would read as no output yet, so min_tokens would mask its stop ids forever. Under async
        # scheduling they lack the token in flight, so Scheduler.schedule_ahead never launches a request whose
        # sampling reads them (a penalty, or min_tokens not reached) ahead.
        return launch_batch(rows, [r.params for r in reqs], [r.generator for r in reqs],
                            [TokenHistory(r.prompt_token_ids, r.output_token_ids, eos_token_ids)
                             if r.params.may_process_logits else () for r in reqs])
    except Exception as e:  # not one row's fault (launch_batch isolates rows): the batch is lost, not the engine
        return failure_text("sampling the batch failed", e)


def take_plain(output: OutputMaker, plain: list[ScheduledSeq], launched: LaunchedSample | str, now: float, made: Made,
               advance: bool = False) -> None:
    """The sampled tokens (one host copy) appended to their requests; a row that failed ends its request.
    advance: also move each request's num_computed_tokens past its chunk first (the engine does that for every
    chunk before this; a step of plain decodes, with nothing else to do in between, folds it in here)."""
    try:
        if isinstance(launched, str):
            raise _BatchLost(launched)
        result = launched.result()
    except Exception as e:
        # a launch that failed was logged there (failure_text), once
        err = str(e) if isinstance(e, _BatchLost) else failure_text("sampling the batch failed", e)
        result = BatchSample([0] * len(plain), [err] * len(plain))
    output.take_rows(plain, result, now, made, advance)
