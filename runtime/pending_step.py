"""The routing of a step not recorded yet: RoutedBlockManager's `pending` (PendingRouting) and the step it holds
(PendingStep). record_step only takes a step's routed flags (on CUDA a copy to the host behind the step); the manager
records them when it is next used (settle).

Async scheduling (runtime/async_steps.py): the step after the one in flight is scheduled and prepared before that
step's flags are on the host. Inside `ahead()` append_slots records nothing (it reserves the worst case for the
tokens in flight too, since `_known` stops before them), and the model runner gathers c_j from the mirror, which
stops before the step in flight, and adds that step's routed counts on the device (`pending_step`). The next
record_step then records the step in flight, whose flags are due at the same time as its sampled ids. free and
commit record the pending step only when it ran the request's tokens they need (`settle_for`), so taking in a
step's outputs does not wait for the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from kiln.runtime.routed_state import FlagCopy


@dataclass
class PendingStep:
    """A step whose routing is not recorded yet (record_step): its requests, where each started and how many tokens
    it ran (None: one each), its flags as the step returned them (on the device on CUDA: the next step ahead adds
    its counts there) and their copy on its way to the host."""

    ids: list[str]
    starts: list[int]
    num_new: list[int] | None
    flags: torch.Tensor | np.ndarray
    host: torch.Tensor | np.ndarray
    event: torch.cuda.Event | None
    _where: dict[str, int] | None = None

    def index(self, request_id: str) -> int | None:
        """The request's position in the step, or None."""
        if self._where is None:
            self._where = {rid: i for i, rid in enumerate(self.ids)}
        return self._where.get(request_id)


class PendingRouting:
    """RoutedBlockManager's `pending`: the step whose routing is not recorded yet (start; settle records it with the
    manager's `record`), the copy of its flags to the host, and whether the step after it is being scheduled (ahead)."""

    def __init__(self, record: Callable[[Sequence[str], Sequence[int], Sequence[int] | None, np.ndarray], None]):
        self.record = record  # RoutedBlockManager._record
        self.step: PendingStep | None = None  # a step's routing not recorded yet (record_step)
        self.scheduling_ahead = False  # inside ahead(): append_slots records nothing
        self._flags = FlagCopy()

    @contextmanager
    def ahead(self) -> Iterator[None]:
        """Scheduling the step after the one in flight: append_slots reserves without recording that step."""
        self.scheduling_ahead = True
        try:
            yield
        finally:
            self.scheduling_ahead = False

    def start(self, seqs: Sequence, routed: torch.Tensor | np.ndarray, plain_decodes: bool) -> None:
        """record_step's step pending: seqs its ScheduledSeqs in row order, routed its flags (their copy started)."""
        ids = [s.request.request_id for s in seqs]
        starts = [s.start for s in seqs]
        num_new = None if plain_decodes else [s.num_new for s in seqs]
        self.step = PendingStep(ids, starts, num_new, routed, *self._flags.start(routed))

    def settle(self) -> None:
        """Record the pending step's routing (record_step), waiting for its flags' copy if it is in flight."""
        p, self.step = self.step, None
        if p is not None:
            self.record(p.ids, p.starts, p.num_new, FlagCopy.wait(p.host, p.event))

    def settle_for(self, request_id: str, before: int | None = None) -> None:
        """Record the pending step if it ran the request's tokens (only those from before `before` on, if given)."""
        p = self.step
        if p is not None:
            i = p.index(request_id)
            if i is not None and (before is None or p.starts[i] < before):
                self.settle()
