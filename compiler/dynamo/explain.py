"""`kiln.explain(model, *example_inputs)`: what backend="kiln" claims in a model, and what runs as torch and why.

    print(kiln.explain(model, input_ids))

Runs the model once under torch.compile with the kiln backend (no_grad) and collects, per Dynamo graph, each
claimed site (kiln op, module path, parameters), each pattern that matched but was refused (with the reason:
a dtype that torch would promote, a mask that is not causal, a head_dim the kernel does not take, ...), and
the torch calls that fell back to eager / inductor, grouped by op with a few example sites.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from kiln.dynamo.backend import GraphReport, _listeners, kiln_backend


@dataclass
class ExplainReport:
    graphs: list[GraphReport]

    def counts(self) -> Counter:
        """Claimed kiln ops over all graphs, by op name."""
        total: Counter = Counter()
        for g in self.graphs:
            total.update(g.counts())
        return total

    @property
    def claimed(self) -> bool:
        return any(g.claims for g in self.graphs)

    def __str__(self) -> str:
        counts = ", ".join(f"{op} {n}" for op, n in sorted(self.counts().items())) or "nothing"
        lines = [f"kiln explain: {len(self.graphs)} graph(s); kiln kernels claimed: {counts}"]
        for g in self.graphs:
            lines.append(
                f"graph {g.index}: {len(g.claims)} claim(s) in {g.regions} region(s); "
                f"kernels: {', '.join(g.kernels) or 'none'}; unclaimed parts run as {g.fallback}"
            )
            for c in g.claims:
                lines.append(f"  claimed   {c.op:<10} {c.site}" + (f"  ({c.detail})" if c.detail else ""))
            for name, (causal, window) in g.masks.items():
                lines.append(f"  mask      %{name} claimed as causal={causal} window={window}, checked every call")
            for r in g.rejections:
                lines.append(f"  refused   {r.pattern:<10} {r.site}: {r.reason}")
            for f in g.fallbacks:
                sites = ", ".join(f.sites) + (", ..." if f.count > len(f.sites) else "")
                lines.append(f"  fallback  {f.op} x{f.count} ({sites}): {f.reason}")
        return "\n".join(lines)


def explain(model: torch.nn.Module | Any, *example_inputs: Any, **options: Any) -> ExplainReport:
    """Compile `model` with backend="kiln" (options as in torch.compile(..., options=...)), run it once on
    example_inputs without gradients, and report what kiln claimed."""
    reports: list[GraphReport] = []
    _listeners.append(reports)
    try:
        # A fresh backend object: Dynamo recompiles instead of reusing graphs compiled without this report.
        backend = functools.partial(kiln_backend, options=options or None)
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            compiled(*example_inputs)
    finally:
        _listeners.remove(reports)
    return ExplainReport(reports)
