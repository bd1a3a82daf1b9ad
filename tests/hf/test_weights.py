"""HF safetensors -> kiln weight names: mapping per family, sharding, tolerated extras, errors, progress."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.errors import KilnError, WeightError
from kiln.hf import weights as weights_mod
from kiln.hf.config import config_from_hf, load_hf_config
from kiln.hf.weights import load_hf_weights
from kiln.model_config import param_shapes
from tests.support.hf_models import FAMILIES, save_hf_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """family -> (dir, HF state dict, ModelConfig), each saved once."""
    out = {}
    for fam in FAMILIES:
        d = tmp_path_factory.mktemp(fam)
        model = save_hf_model(fam, d)
        out[fam] = (
            d,
            {k: v.detach().clone() for k, v in model.state_dict().items()},
            config_from_hf(load_hf_config(d)),
        )
    return out


def load(ckpt, fam, d=None, **kw):
    d0, _, cfg = ckpt[fam]
    return load_hf_weights(d or d0, cfg, model_type=fam, **kw)


def rewrite(ckpt, fam, tmp_path, edit) -> object:
    """A copy of a checkpoint with its tensors changed by `edit(dict)`."""
    d0 = ckpt[fam][0]
    tensors = load_file(str(d0 / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((d0 / "config.json").read_text())
    return tmp_path


@pytest.mark.parametrize("fam", ["llama", "mistral", "qwen2"])
def test_llama_family_names(ckpt, fam):
    _, sd, cfg = ckpt[fam]
    w = load(ckpt, fam)
    assert list(w) == list(param_shapes(cfg))
    pairs = {
        "embed.weight": "model.embed_tokens.weight",
        "layers.1.norm0.weight": "model.layers.1.input_layernorm.weight",
        "layers.1.norm1.weight": "model.layers.1.post_attention_layernorm.weight",
        "layers.0.attn0.q.weight": "model.layers.0.self_attn.q_proj.weight",
        "layers.1.attn0.k.weight": "model.layers.1.self_attn.k_proj.weight",
        "layers.1.attn0.v.weight": "model.layers.1.self_attn.v_proj.weight",
        "layers.1.attn0.o.weight": "model.layers.1.self_attn.o_proj.weight",
        "layers.0.mlp0.gate.weight": "model.layers.0.mlp.gate_proj.weight",
        "layers.0.mlp0.up.weight": "model.layers.0.mlp.up_proj.weight",
        "layers.1.mlp0.down.weight": "model.layers.1.mlp.down_proj.weight",
        "final_norm.weight": "model.norm.weight",
    }
    if fam == "qwen2":
        pairs["layers.1.attn0.v.bias"] = "model.layers.1.self_attn.v_proj.bias"
        assert "lm_head.weight" not in w
    else:
        pairs["lm_head.weight"] = "lm_head.weight"
    for kiln, hf in pairs.items():
        assert torch.equal(w[kiln], sd[hf]), kiln


def test_gpt2_names_transposed_and_split(ckpt):
    _, sd, cfg = ckpt["gpt2"]
    w = load(ckpt, "gpt2")
    assert list(w) == list(param_shapes(cfg))
    dim, h = cfg.dim, "transformer.h.1."
    c_attn, c_attn_b = sd[h + "attn.c_attn.weight"], sd[h + "attn.c_attn.bias"]
    for i, p in enumerate("qkv"):
        assert torch.equal(w[f"layers.1.attn0.{p}.weight"], c_attn[:, i * dim : (i + 1) * dim].t())
        assert torch.equal(w[f"layers.1.attn0.{p}.bias"], c_attn_b[i * dim : (i + 1) * dim])
    assert torch.equal(w["layers.1.attn0.o.weight"], sd[h + "attn.c_proj.weight"].t())
    assert torch.equal(w["layers.1.mlp0.up.weight"], sd[h + "mlp.c_fc.weight"].t())
    assert torch.equal(w["layers.1.mlp0.down.bias"], sd[h + "mlp.c_proj.bias"])
    assert torch.equal(w["layers.0.norm1.bias"], sd["transformer.h.0.ln_2.bias"])
    assert torch.equal(w["pos_embed.weight"], sd["transformer.wpe.weight"])
    assert torch.equal(w["final_norm.bias"], sd["transformer.ln_f.bias"])
    assert all(t.is_contiguous() for t in w.values())


def test_dtype_cast(ckpt):
    w = load(ckpt, "llama", dtype=torch.bfloat16)
    assert {t.dtype for t in w.values()} == {torch.bfloat16}


def test_sharded_loads_the_same(ckpt, tmp_path):
    save_hf_model("llama", tmp_path, max_shard_size="40KB")
    shards = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(shards.values())) > 1 and not (tmp_path / "model.safetensors").exists()
    sharded, single = load(ckpt, "llama", tmp_path), load(ckpt, "llama")
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)


def test_tolerated_extras_and_unprefixed_names(ckpt, tmp_path):
    def edit(t):  # a base-model (GPT2Model) checkpoint with the causal-mask buffers of old transformers
        for k in list(t):
            t[k.removeprefix("transformer.")] = t.pop(k)
        t["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
        t["h.0.attn.masked_bias"] = torch.tensor(-1e4)
        t["lm_head.weight"] = t["wte.weight"].clone()  # tied, but present

    w = load(ckpt, "gpt2", rewrite(ckpt, "gpt2", tmp_path, edit))
    assert torch.equal(w["embed.weight"], ckpt["gpt2"][1]["transformer.wte.weight"])


def test_errors_are_collected(ckpt, tmp_path):
    def edit(t):
        del t["model.layers.1.self_attn.k_proj.weight"]
        t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(16, 32)
        t["model.layers.0.extra.weight"] = torch.zeros(3)

    with pytest.raises(WeightError) as info:
        load(ckpt, "llama", rewrite(ckpt, "llama", tmp_path, edit))
    msg = str(info.value)
    assert "3 problems" in msg
    assert (
        "missing tensor model.layers.1.self_attn.k_proj.weight (for kiln layers.1.attn0.k.weight, shape [16, 32])"
        in msg
    )
    assert "tensor model.layers.0.self_attn.q_proj.weight has shape [16, 32]; expected [32, 32]" in msg
    assert "unexpected tensor model.layers.0.extra.weight (shape [3])" in msg


def test_tied_model_ignores_a_present_lm_head_equal_to_the_embedding(ckpt, tmp_path):
    # Some tied checkpoints still carry lm_head.weight (a copy of the embedding); it is skipped, not an error.
    d, sd, cfg = ckpt["llama"]
    tied = config_from_hf({**load_hf_config(d), "tie_word_embeddings": True})

    def copy_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    w = load_hf_weights(rewrite(ckpt, "llama", tmp_path, copy_head), tied, model_type="llama")
    assert "lm_head.weight" not in w and torch.equal(w["embed.weight"], sd["model.embed_tokens.weight"])


def test_tied_config_with_a_different_stored_head_is_refused(ckpt):
    # transformers 5 would serve the stored head (it unties), 4.x the embedding: kiln names the conflict instead
    d, sd, cfg = ckpt["llama"]
    assert not torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    tied = config_from_hf({**load_hf_config(d), "tie_word_embeddings": True})
    with pytest.raises(WeightError, match="tie_word_embeddings: true, but the checkpoint's lm_head.weight differs "
                                          "from the embedding model.embed_tokens.weight; to serve the stored head"):
        load_hf_weights(d, tied, model_type="llama")


def test_a_missing_head_and_a_wrong_shape_say_what_to_fix(ckpt, tmp_path):
    def no_head(t):
        del t["lm_head.weight"]

    with pytest.raises(WeightError, match="missing tensor lm_head.weight(.|\n)*hint: without lm_head.weight the head "
                                          "is the embedding: config.json should say tie_word_embeddings: true"):
        load(ckpt, "llama", rewrite(ckpt, "llama", _mkdir(tmp_path / "a"), no_head))

    def wide_up(t):
        t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(65, 32)

    with pytest.raises(WeightError, match="(?s)has shape \\[65, 32\\].*hint: the model's sizes differ from these "
                                          "tensors'.*intermediate_size.*use the config.json saved with these weights"):
        load(ckpt, "llama", rewrite(ckpt, "llama", _mkdir(tmp_path / "b"), wide_up))


def test_spec_that_cannot_match_the_family(ckpt):
    d, _, cfg = ckpt["gpt2"]
    mlp = cfg.body[1].value.right
    gated = dataclasses.replace(mlp, act="swiglu")
    body = (cfg.body[0], dataclasses.replace(cfg.body[1], value=dataclasses.replace(cfg.body[1].value, right=gated)))
    with pytest.raises(WeightError, match="gpt2 checkpoints have no gate projection"):
        load_hf_weights(d, dataclasses.replace(cfg, body=body), model_type="gpt2")


def test_no_safetensors(ckpt, tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(WeightError, match=r"no \.safetensors weights \(found pytorch_model\.bin\).*Convert"):
        load(ckpt, "llama", tmp_path)


def test_unknown_model_type(ckpt):
    with pytest.raises(KilnError, match="no HF weight mapping for model_type 'bert'"):
        load_hf_weights(ckpt["llama"][0], ckpt["llama"][2], model_type="bert")


@pytest.mark.parametrize("progress, shown", [(True, True), (False, False), (None, False)])
def test_progress_bar(ckpt, capsys, progress, shown):
    load(ckpt, "qwen2", progress=progress)
    err = capsys.readouterr().err
    assert ("kiln: loading weights" in err and "100%" in err) == shown


def test_progress_bar_by_default_for_big_checkpoints(ckpt, capsys, monkeypatch):
    monkeypatch.setattr(weights_mod, "PROGRESS_THRESHOLD", 1000)  # bytes; the tiny checkpoint is bigger
    load(ckpt, "qwen2")
    assert "kiln: loading weights" in capsys.readouterr().err


def test_a_tensor_in_two_unindexed_files_is_refused(ckpt, tmp_path):
    # the last file read used to win silently
    d0 = ckpt["llama"][0]
    tensors = load_file(str(d0 / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, str(tmp_path / "a.safetensors"))
    save_file({name: tensors[name], "model.norm.weight": tensors["model.norm.weight"]},
              str(tmp_path / "b.safetensors"))
    (tmp_path / "config.json").write_text((d0 / "config.json").read_text())
    with pytest.raises(WeightError, match=r"tensor model.norm.weight is in both .*a.safetensors and .*b.safetensors"):
        load(ckpt, "llama", tmp_path)
    (tmp_path / "b.safetensors").unlink()
    save_file({name: tensors[name]}, str(tmp_path / "b.safetensors"))
    assert torch.equal(load(ckpt, "llama", tmp_path)["layers.0.attn0.q.weight"], tensors[name])


def _mkdir(d):
    d.mkdir()
    return d
