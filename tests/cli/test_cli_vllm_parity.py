"""The command line the way a vLLM user writes it: a checkpoint directory or a .gguf file as SPEC, a Hub id refused
with how to get the files, vLLM's --dtype names, --max-model-len's 4k / 32K suffixes, --enable-prefix-caching,
--generation-config and --chat-template."""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from kiln.cli.commands import build_parser, main
from kiln.cli.common import engine_flags, human_int, serving_engine
from tests.support.gguf_helper import write_tiny_gguf
from tests.support.hf_models import save_hf_model

IDS = "5,9,44,100,7,3"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    save_hf_model("llama", d)
    return d


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> dict:
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    return json.loads(out)


def test_a_checkpoint_dir_as_spec_is_taken_as_weights(capsys, checkpoint):
    args = ("--prompt-ids", IDS, "--temperature", "0", "--max-tokens", "6", "--json")
    by_dir = run_json(capsys, "run", str(checkpoint), *args)
    by_weights = run_json(capsys, "run", "--weights", str(checkpoint), *args)
    assert by_dir["token_ids"] == by_weights["token_ids"] and by_dir["model"] == by_weights["model"]
    code, _, err = run_cli(capsys, "run", str(checkpoint), "--weights", str(checkpoint), *args)
    assert code == 2 and "is a checkpoint directory, and weights" in err and "give the checkpoint once" in err


def test_a_gguf_as_spec_is_taken_as_weights(capsys, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, linear_type="F32")
    got = run_json(
        capsys, "run", str(path), "--prompt-ids", "1,5,6", "--temperature", "0", "--max-tokens", "3", "--json"
    )
    want = run_json(
        capsys,
        "run",
        "--weights",
        str(path),
        "--prompt-ids",
        "1,5,6",
        "--temperature",
        "0",
        "--max-tokens",
        "3",
        "--json",
    )
    assert got["token_ids"] == want["token_ids"] and len(got["token_ids"]) == 3


def test_bench_takes_a_checkpoint_dir_as_spec(capsys, checkpoint):
    code, out, err = run_cli(
        capsys,
        "bench",
        "throughput",
        str(checkpoint),
        "--num-requests",
        "2",
        "--input-len",
        "4:6",
        "--output-len",
        "2:3",
        "--max-num-seqs",
        "2",
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["model"] == checkpoint.name


def test_bench_perplexity_takes_a_gguf_as_spec(capsys, tmp_path):
    from tests.support.gguf_helper import tiny_gguf_and_text

    path, text = tiny_gguf_and_text(tmp_path)
    out = tmp_path / "r.json"
    # the gguf variant needs GGUF weights: the positional must reach the command's own checks as --weights
    code, _, err = run_cli(
        capsys,
        "bench",
        "perplexity",
        str(path),
        "--text",
        str(text),
        "--variants",
        "gguf",
        "--window",
        "32",
        "--device",
        "cpu",
        "-o",
        str(out),
    )
    assert code == 0, err
    assert json.loads(out.read_text())["variants"]["gguf"]["perplexity"] > 1


def test_compile_takes_a_checkpoint_dir_as_spec(capsys, checkpoint):
    code, _, err = run_cli(capsys, "compile", str(checkpoint), "--dtype", "bfloat16")
    assert code == 0, err
    assert f"kiln: {checkpoint.name}: " in err and "MiB of weights in bf16" in err


def test_quantize_and_train_router_take_a_checkpoint_dir_as_spec(capsys, checkpoint, tmp_path):
    out = tmp_path / "q"
    code, _, err = run_cli(capsys, "quantize", str(checkpoint), "--quantize", "int8", "-o", str(out))
    assert code == 0, err
    # the checks made before loading see the directory as --weights: a quantized one is refused by name
    code, _, err = run_cli(capsys, "quantize", str(out), "--quantize", "int8", "-o", str(tmp_path / "q2"))
    assert code == 2 and f"--weights {out}: is already a `kiln quantize` output" in err
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. " * 40)
    code, _, err = run_cli(capsys, "train-router", str(checkpoint), "--text", str(text), "--capacity", "0.5",
                           "-o", str(tmp_path / "r.safetensors"), "--steps", "0")
    assert code == 0, err
    assert (tmp_path / "r.safetensors").is_file()


def test_a_hub_id_says_kiln_loads_local_checkpoints(capsys):
    code, _, err = run_cli(capsys, "run", "Qwen/Qwen3-0.6B", "--prompt", "hi")
    assert code == 2
    assert "kiln loads local checkpoints only and downloads nothing" in err
    assert "huggingface-cli download Qwen/Qwen3-0.6B --local-dir DIR" in err


@pytest.mark.parametrize(
    "name, want",
    [
        ("half", "fp16"),
        ("bfloat16", "bf16"),
        ("float", "fp32"),
        ("float32", "fp32"),
        ("auto", "fp32"),
        ("fp16", "fp16"),
    ],
)
def test_dtype_takes_vllms_names(capsys, name, want):
    code, out, err = run_cli(
        capsys, "run", "tiny-llama", "--prompt-ids", "1,2", "--max-tokens", "1", "--dtype", name, "--seed", "0"
    )
    assert code == 0, err
    assert f"on cpu ({want}, random weights" in err


@pytest.mark.parametrize(
    "text, want",
    [
        ("4k", 4000),
        ("32K", 32768),
        ("1m", 1_000_000),
        ("1M", 2**20),
        ("25.6k", 25600),
        ("2048", 2048),
        (" 2g ", 2 * 10**9),
    ],
)
def test_human_int_reads_vllms_suffixes(text, want):
    assert human_int(text) == want


@pytest.mark.parametrize("text", ["1.5K", "4x", "k", ""])
def test_human_int_refuses_what_vllm_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_int(text)


def test_enable_prefix_caching_reaches_the_engine():
    from kiln.build import load_model

    p = argparse.ArgumentParser()
    engine_flags(p)
    m = load_model("tiny-llama", device="cpu")
    for argv, want in (([], True), (["--no-enable-prefix-caching"], False), (["--enable-prefix-caching"], True)):
        args = p.parse_args(argv)
        args.seed = 0
        assert serving_engine(args, m).block_manager.enable_prefix_caching is want
    for command in (["run", "--prompt", "x"], ["serve"], ["bench", "throughput"]):  # the shared engine flags
        assert build_parser().parse_args([*command, "--no-enable-prefix-caching"]).enable_prefix_caching is False


def test_generation_config_fills_the_flags_not_given(capsys, checkpoint, tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    for f in checkpoint.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    # eos that greedy never reaches here, so the length shows max_new_tokens
    (d / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 4, "eos_token_id": 287})
    )
    code, out, err = run_cli(capsys, "run", str(d), "--prompt-ids", IDS, "--json")
    assert code == 0, err
    got = json.loads(out)
    assert len(got["token_ids"]) == 4 and got["finish_reason"] == "length"
    assert "default sampling parameters from" in err and "temperature=0.0, max_tokens=4" in err
    greedy = run_json(capsys, "run", str(d), "--prompt-ids", IDS, "--temperature", "0", "--max-tokens", "4", "--json")
    assert got["token_ids"] == greedy["token_ids"]  # temperature 0 came from the file
    code, out, err = run_cli(capsys, "run", str(d), "--prompt-ids", IDS, "--max-tokens", "6", "--json")
    assert len(json.loads(out)["token_ids"]) == 6 and "flags given win (--max-tokens)" in err
    code, out, err = run_cli(
        capsys, "run", str(d), "--prompt-ids", IDS, "--generation-config", "vllm", "--json", "--seed", "3"
    )
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) == 32 and "default sampling parameters" not in err  # kiln's own
    code, _, err = run_cli(capsys, "run", str(d), "--prompt-ids", IDS, "--generation-config", "nope")
    assert code == 2 and "not 'auto' or 'vllm', nor a directory" in err


def test_chat_template_flag(capsys, tmp_path):
    tpl = "<{{ messages[0].content }}>{% if add_generation_prompt %}!{% endif %}"
    got = run_json(
        capsys, "run", "--prompt", "hi", "--chat", "--chat-template", tpl, "--max-tokens", "1", "--json", "--seed", "0"
    )
    assert got["prompt_token_ids"] == list(b"<hi>!")
    path = tmp_path / "t.jinja"
    path.write_text(tpl)
    got = run_json(
        capsys,
        "run",
        "--prompt",
        "hi",
        "--chat",
        "--chat-template",
        str(path),
        "--max-tokens",
        "1",
        "--json",
        "--seed",
        "0",
    )
    assert got["prompt_token_ids"] == list(b"<hi>!")
    code, _, err = run_cli(capsys, "run", "--prompt", "hi", "--chat-template", tpl)
    assert code == 2 and "add --chat" in err
    code, _, err = run_cli(capsys, "run", "--prompt", "hi", "--chat", "--chat-template", "missing.jinja")
    assert code == 2 and "looks like a file path, but it cannot be opened" in err


def test_new_sampling_flags_are_checked_before_loading(capsys):
    code, _, err = run_cli(capsys, "run", "--prompt", "hi", "--min-p", "1.5")
    assert code == 2 and "--min-p 1.5 is out of range; allowed: 0 <= --min-p <= 1" in err
    code, _, err = run_cli(capsys, "run", "--prompt", "hi", "--repetition-penalty", "0")
    assert code == 2 and "--repetition-penalty 0.0 is out of range" in err


def test_chat_without_a_template_uses_kilns_default_as_llm_chat_does(capsys, caplog, monkeypatch):
    import kiln.chat_template as chat_template_mod
    from kiln.chat_template import default_chat_template

    monkeypatch.setattr(chat_template_mod, "_default_noted", False)
    caplog.set_level(logging.WARNING, logger="kiln.chat_template")
    got = run_json(capsys, "run", "--prompt", "hi", "--chat", "--max-tokens", "1", "--json", "--seed", "0")
    want = default_chat_template().render([{"role": "user", "content": "hi"}])
    assert got["prompt_token_ids"] == list(want.encode())  # tiny-llama's byte tokenizer has no template
    assert "this model has no chat template" in caplog.text
