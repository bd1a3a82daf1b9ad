"""Schema rules for kiln's custom ops that torch versions disagree on.

torch 2.11 (the GPU machines) drops a trailing argument equal to its default from the dispatcher's stack; its
ADInplaceOrView kernel then looks a mutated argument up by its schema index and reads past the end of the stack
(`IndexError: tuple index out of range`, seen on kiln::paged_attention's `Tensor(a!)? kv_scales=None`). torch 2.13
(CI) keeps the argument, so only a rule on the schema itself catches the fault here.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kiln.dynamo.regions  # noqa: F401  (registers kiln_dynamo::region)
import kiln.ir.ops  # noqa: F401
import kiln.ir.ops_level2  # noqa: F401
import kiln.ir.ops_paged  # noqa: F401
import kiln.ir.ops_quant  # noqa: F401
import kiln.ir.ops_spec  # noqa: F401


def _kiln_schemas() -> list[torch._C.FunctionSchema]:
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.split("::")[0] in ("kiln", "kiln_dynamo"))
    schemas = []
    for name in names:
        ns, op = name.split("::")
        packet = getattr(getattr(torch.ops, ns), op.split(".")[0])
        schemas += [getattr(packet, overload)._schema for overload in packet.overloads()]
    return schemas


SCHEMAS = _kiln_schemas()
MUTABLE = [s for s in SCHEMAS if s.is_mutable]


def _written(arg: torch._C.Argument) -> bool:
    return arg.alias_info is not None and arg.alias_info.is_write


def test_the_op_set_is_registered():
    names = {s.name for s in SCHEMAS}
    assert {"kiln::attention", "kiln::linear", "kiln::paged_attention", "kiln::linear_w4", "kiln::spec_verify"} <= names
    assert "kiln::paged_attention" in {s.name for s in MUTABLE}


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.name)
def test_no_mutated_argument_has_a_default(schema):
    bad = [a.name for a in schema.arguments if _written(a) and a.has_default_value()]
    assert not bad, (
        f"{schema.name}: mutated argument(s) {bad} have a default; torch 2.11 drops a trailing argument equal to its "
        f"default and then indexes the mutated one past the stack. Make them required (pass None explicitly). "
        f"Schema: {schema}"
    )


def _paged_attention_args() -> tuple:
    layers, blocks, block_size, kv_heads, head_dim, heads = 1, 4, 16, 2, 16, 4
    cache = torch.zeros(layers, 2, blocks, block_size, kv_heads, head_dim)
    q = torch.randn(1, 3, heads * head_dim)
    k, v = torch.randn(1, 3, kv_heads * head_dim), torch.randn(1, 3, kv_heads * head_dim)
    slots = torch.tensor([16, 17, 18])
    tables = torch.tensor([[1, 2]], dtype=torch.int32)
    return (q, k, v, cache, 0, slots, tables, torch.tensor([3], dtype=torch.int32),
            torch.tensor([0, 3], dtype=torch.int32), 3, 3, heads, kv_heads, True, 0, head_dim**-0.5, None)  # fmt: skip


# Every mutable kiln op needs an example here, so that a new one is exercised through the dispatcher too.
EXAMPLES = {"kiln::paged_attention": _paged_attention_args}


def test_every_mutable_op_has_an_example():
    assert {s.name for s in MUTABLE} <= set(EXAMPLES), "add an example argument builder for each new mutable op"


@pytest.mark.parametrize("schema", MUTABLE, ids=lambda s: s.name)
@pytest.mark.parametrize("mode", ["eager", "fake", "grad"])
def test_mutable_ops_run_through_the_dispatcher_with_only_declared_positionals(schema, mode):
    """Call with exactly the declared positional arguments (no keywords, none left to a default), through the
    kernels the 2.11 failure went through: the real kernel, fake propagation, and the autograd / inplace-or-view
    path (grad mode on, an input that requires grad)."""
    args = EXAMPLES[schema.name]()
    positional = [a for a in schema.arguments if not a.kwarg_only]
    assert len(args) == len(positional), f"{schema.name}: the example must give every declared positional argument"
    ns, name = schema.name.split("::")
    op = getattr(getattr(torch.ops, ns), name).default
    if mode == "fake":
        with FakeTensorMode() as fake:
            fake_args = [fake.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            out = op(*fake_args)
        assert out.shape == args[0].shape
        return
    if mode == "grad":
        args = (args[0].clone().requires_grad_(), *args[1:])
        with torch.enable_grad():
            out = op(*args)
    else:
        out = op(*args)
    assert out.shape == args[0].shape and torch.isfinite(out).all()
    written = [i for i, a in enumerate(schema.arguments) if _written(a) and isinstance(args[i], torch.Tensor)]
    assert any(args[i].abs().sum() > 0 for i in written), "the op must have written its mutated cache"
