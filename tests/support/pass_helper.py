"""check_pass: the one way pass tests check a pass (see shared/DESIGN.md, "Habits").

It asserts the node-count change per op, that `modified` is truthful, that a second run changes nothing,
that the result passes the pipeline's debug checks (lint, FakeTensor propagation, IR check), and that the
passed graph computes what the unpassed one does (fp32, tight tolerance).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch
from torch import fx

from kiln.compile.pipeline import Pass, check_ir, propagate
from kiln.ir.text import format_graph
from kiln.model_config import LayerAssign, MlpCall, ModelConfig, NormConfig, Var

ATOL = RTOL = 1e-5


def op_counts(gm: fx.GraphModule) -> Counter:
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def node_delta(before: Counter, after: Counter) -> dict:
    return {op: after[op] - before[op] for op in before.keys() | after.keys() if after[op] != before[op]}


def _name(op: object) -> str:
    return getattr(op, "__name__", str(op))


def check_pass(
    pass_: Pass,
    gm_factory: Callable[[], fx.GraphModule],
    example_inputs: Sequence[torch.Tensor],
    expected_node_delta: dict,
    reference: Callable[[], fx.GraphModule] | None = None,
) -> fx.GraphModule:
    """Run `pass_` on a fresh graph from gm_factory and check it; returns the passed graph.

    reference: a factory of the graph whose output the passed graph must equal, for a pass that changes what the
    graph computes on purpose (self_draft: the model cut to its first layers); default gm_factory (no change).

    expected_node_delta maps a call target (torch.ops.kiln.linear.default, operator.getitem, ...) to the change
    in its node count; targets not named must not change. An empty dict means nothing matches: the pass must
    then report modified=False and leave the graph text as it was.
    """
    with torch.no_grad():
        expected = (reference or gm_factory)()(*example_inputs)

    gm = gm_factory()
    before_text, before = format_graph(gm), op_counts(gm)
    result = pass_.run(gm)
    gm = result.gm
    gm.graph.lint()
    gm.recompile()
    propagate(gm)
    check_ir(gm)
    after_text = format_graph(gm)

    delta = node_delta(before, op_counts(gm))
    want = {op: d for op, d in expected_node_delta.items() if d}
    assert delta == want, (
        f"{pass_.name}: node-count change {({_name(k): v for k, v in delta.items()})}, "
        f"expected {({_name(k): v for k, v in want.items()})}"
    )
    changed = after_text != before_text
    assert result.modified == changed, f"{pass_.name}: modified={result.modified} but graph changed={changed}"
    if not want:
        assert not result.modified, f"{pass_.name}: nothing to match, yet modified=True"

    again = pass_.run(gm)
    assert not again.modified, f"{pass_.name}: a second run reported modified=True"
    assert format_graph(again.gm) == after_text, f"{pass_.name}: a second run changed the graph"

    with torch.no_grad():
        actual = gm(*example_inputs)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)
    return gm


def inputs(cfg: ModelConfig, batch: int = 2, seq: int = 10) -> tuple[torch.Tensor, torch.Tensor]:  # seq > window 8
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab, (batch, seq), generator=gen)
    return tokens, torch.arange(seq).expand(batch, seq).contiguous()


def plain_mlp_model() -> ModelConfig:
    """No attention, no norm, an ungated MLP: nothing any pass here matches."""
    body = (LayerAssign("x", MlpCall(Var("x"), "mlp0", "relu")),)
    return ModelConfig(name="plain", vocab=32, dim=16, layers=1, heads=2, kv_heads=2, head_dim=8, ffn=32, context=16,
                       norm=NormConfig("rms", 1e-5), body=body, positions="none", final_norm=False)
