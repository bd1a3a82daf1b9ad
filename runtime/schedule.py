"""What a step runs, as the scheduler hands it to the runner and the engine: a Schedule of ScheduledSeq chunks (a
request, the tokens already in the cache, how many new ones, whether its last row is sampled and how many drafts
follow it), and the requests preempted to make room."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.runtime.request import Request


@dataclass(slots=True)
class ScheduledSeq:
    request: Request
    start: int  # tokens already in the cache; this chunk is tokens [start, start + num_new)
    num_new: int
    sample: bool  # the chunk reaches the end of the known tokens, so its last row is sampled
    num_drafts: int = 0  # speculative decode: the chunk is [last token, d_1..d_n], all n + 1 rows sampled

    @property
    def num_rows(self) -> int:
        """Logit rows the step returns for this chunk."""
        return (1 + self.num_drafts) if self.sample else 0


@dataclass
class Schedule:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Every chunk is a plain decode (one token, sampled, no drafts), known without looking: the scheduler's fast
    # path sets it. False says nothing (a general schedule may be all decodes too).
    plain_decodes: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.seqs) if self.plain_decodes else sum(s.num_new for s in self.seqs)

    @property
    def is_decode_only(self) -> bool:
        return self.plain_decodes or all(s.num_new == 1 and s.sample for s in self.seqs)

