"""Every bad checkpoint gives one clear KilnError: exit 2 and a message naming the file or key, no traceback,
and nothing half-written (issue 16). One row per case: how to break a good checkpoint, how to load it, and
a fragment the message must contain."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from kiln.build import load_model
from kiln.cli import main
from kiln.errors import KilnError, WeightError
from tests.support.hf_models import save_hf_model


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    """Pristine checkpoints, copied before each case breaks one: single-file, sharded, and `kiln quantize`d."""
    root = tmp_path_factory.mktemp("good")
    save_hf_model("llama", root / "llama")
    save_hf_model("mistral", root / "mistral")
    save_hf_model("llama", root / "sharded", max_shard_size="20KB")
    assert (root / "sharded" / "model.safetensors.index.json").is_file()
    assert main(["quantize", "--weights", str(root / "llama"), "--quantize", "int8", "-o", str(root / "int8"),
                 "--device", "cpu"]) == 0
    return {p.name: p for p in root.iterdir()}


def edit(**changes) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        hf = json.loads((d / "config.json").read_text())
        for key, value in changes.items():
            if value is DELETE:
                hf.pop(key, None)
            else:
                hf[key] = value
        (d / "config.json").write_text(json.dumps(hf))

    return apply


DELETE = object()


def write(name: str, data: str | bytes) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        (d / name).unlink(missing_ok=True)
        (d / name).write_bytes(data.encode() if isinstance(data, str) else data)

    return apply


def truncate(keep: float) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[: int(f.stat().st_size * keep)])

    return apply


def weights_dir(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()


def symlink_loop(d: Path) -> None:
    (d / "model.safetensors").unlink()
    os.symlink("model.safetensors", d / "model.safetensors")


def index(mutate: Callable[[dict], object]) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        path = d / "model.safetensors.index.json"
        data = json.loads(path.read_text())
        path.write_text(json.dumps(mutate(data)))

    return apply


def outside(data: dict) -> dict:
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = "../elsewhere/model-00001.safetensors"
    return data


def absolute(data: dict) -> dict:
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = "/etc/passwd"
    return data


def nan_weights(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][0, 3] = float("nan")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


@dataclass(frozen=True)
class Case:
    id: str
    base: str  # which good checkpoint to copy
    breaks: Callable[[Path], None]
    via: str  # "import" (kiln import -o), "run" (kiln run --weights) or "api" (load_model)
    fragment: str  # must appear in the message
    error: type[KilnError] = KilnError
    flags: tuple[str, ...] = ()


def remove(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).unlink()


def both(*steps: Callable[[Path], None]) -> Callable[[Path], None]:
    return lambda d: [step(d) for step in steps] and None


MINIMAL = json.dumps({"model_type": "llama", "vocab_size": 288, "hidden_size": 32, "intermediate_size": 64,
                      "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
                      "rms_norm_eps": 1e-06})
LLAMA3_NO_FACTOR = {"rope_type": "llama3", "rope_theta": 1e4, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
CASES = [
    # config.json: shape and JSON
    Case("config-is-a-list", "llama", write("config.json", "[1, 2]"), "import", "not an object"),
    Case("config-not-json", "llama", write("config.json", "{nope"), "run", "not valid JSON"),
    Case("config-binary", "llama", write("config.json", b"\xff\xfe\x00junk"), "import", "config.json"),
    Case("no-model-type", "llama", edit(model_type=DELETE), "import", "model_type None is not supported"),
    Case("missing-ffn", "llama", edit(intermediate_size=DELETE), "import", "`intermediate_size` is missing"),
    # config.json: values, checked by the spec validator and named by config key
    Case("negative-layers", "llama", edit(num_hidden_layers=-3), "import", "`num_hidden_layers`"),
    Case("zero-heads", "llama", edit(num_attention_heads=0), "import", "`num_attention_heads`"),
    Case("kv-heads-not-dividing", "llama", edit(num_key_value_heads=3), "import", "`num_key_value_heads`"),
    Case("negative-theta", "llama", edit(rope_parameters={"rope_type": "default", "rope_theta": -5.0}), "run",
         "rope_parameters.rope_theta"),
    Case("negative-top-level-theta", "mistral", edit(rope_parameters=DELETE, rope_theta=-5), "import",
         "`rope_theta`"),
    Case("nan-eps", "llama", write("config.json", MINIMAL.replace("1e-06", "NaN")), "import", "`rms_norm_eps`"),
    Case("infinite-eps", "llama", write("config.json", MINIMAL.replace("1e-06", "1e999")), "import", "finite"),
    Case("string-size", "llama", edit(hidden_size="32"), "import", "`hidden_size` must be a whole number"),
    Case("float-vocab", "llama", edit(vocab_size=288.5), "import", "`vocab_size`"),
    Case("bool-not-bool", "llama", edit(tie_word_embeddings="yes"), "import", "`tie_word_embeddings`"),
    Case("zero-window", "mistral", edit(sliding_window=0), "import", "`sliding_window`"),
    # config.json: features kiln cannot build, refused by name
    Case("llama3-without-factor", "llama", edit(rope_parameters=LLAMA3_NO_FACTOR), "run", "has no `factor`"),
    Case("yarn", "llama", edit(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "import", "'yarn'"),
    Case("partial-rotary", "llama", edit(partial_rotary_factor=0.5), "import", "partial_rotary_factor"),
    Case("pre-quantized", "llama", edit(quantization_config={"quant_method": "gptq"}), "import",
         "quantization_config"),
    Case("mistral-mixed-layer-types", "mistral", edit(layer_types=["full_attention", "sliding_attention"]), "run",
         "layer_types"),
    Case("layer-types-wrong-length", "mistral", edit(layer_types=["full_attention"]), "import", "one entry per layer"),
    # safetensors files
    Case("truncated", "llama", truncate(0.5), "run", "corrupt or truncated", WeightError),
    Case("header-only", "llama", truncate(0.001), "run", "model.safetensors", WeightError),
    Case("empty-file", "llama", write("model.safetensors", b""), "api", "corrupt or truncated", WeightError),
    Case("garbage", "llama", write("model.safetensors", b"\x07" * 64), "run", "not a readable safetensors",
         WeightError),
    Case("weights-are-a-directory", "llama", weights_dir, "run", "is a directory", WeightError),
    Case("weights-symlink-loop", "llama", symlink_loop, "run", "model.safetensors", WeightError),
    Case("nan-weights", "llama", nan_weights, "api", "model.layers.1.mlp.up_proj.weight holds 1 NaN/inf",
         WeightError),
    # sharded checkpoints: the index
    Case("index-not-json", "sharded", write("model.safetensors.index.json", "{"), "run", "index.json: not valid JSON",
         WeightError),
    Case("index-without-weight-map", "sharded", index(lambda d: {"metadata": d["metadata"]}), "run", "weight_map",
         WeightError),
    Case("index-is-a-list", "sharded", index(lambda d: [d]), "api", "weight_map", WeightError),
    Case("index-outside-dir", "sharded", index(outside), "run", "outside the checkpoint directory", WeightError),
    Case("index-absolute-path", "sharded", index(absolute), "api", "outside the checkpoint directory", WeightError),
    Case("index-missing-shard", "sharded", lambda d: next(d.glob("model-0000*.safetensors")).unlink(), "run",
         "names shards that are not there", WeightError),
    # generation_config.json / eos
    Case("generation-config-not-json", "llama", write("generation_config.json", "{eos"), "run",
         "generation_config.json: not valid JSON"),
    Case("generation-config-list", "llama", write("generation_config.json", "[2]"), "api", "generation_config.json"),
    Case("eos-not-integer", "llama", write("generation_config.json", '{"eos_token_id": "two"}'), "run",
         "eos_token_id"),
    Case("eos-float-in-list", "llama", write("generation_config.json", '{"eos_token_id": [2, 2.5]}'), "api",
         "eos_token_id"),
    Case("eos-in-config-negative", "llama", both(edit(eos_token_id=-1), remove("generation_config.json")), "run",
         "config.json: eos_token_id"),
    # `kiln quantize` output: flags that cannot apply are refused, not ignored
    Case("quantized-other-dtype", "int8", lambda d: None, "run", "dtype 'bf16' (--dtype)",
         flags=("--dtype", "bf16")),
    Case("quantized-other-scheme", "int8", lambda d: None, "run", "quantize 'int4' (--quantize)",
         flags=("--quantize", "int4")),
    Case("quantized-meta-not-json", "int8", write("quantization.json", "{"), "run", "quantization.json",
         WeightError),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_checkpoint(case: Case, good, tmp_path, capsys):
    d = tmp_path / "ckpt"
    shutil.copytree(good[case.base], d, symlinks=True)
    case.breaks(d)
    out = tmp_path / "out" / "model.kiln"
    out.parent.mkdir()
    if case.via == "api":
        with pytest.raises(case.error) as e:
            load_model(weights=d, device="cpu")
        message = str(e.value)
    else:
        argv = ["import", str(d), "-o", str(out)] if case.via == "import" else \
            ["run", "--weights", str(d), "--prompt-ids", "3,4", "--max-tokens", "1", "--device", "cpu", *case.flags]
        assert main(argv) == 2
        captured = capsys.readouterr()
        message = captured.err
        assert "Traceback" not in captured.err + captured.out
        assert captured.out == ""
        if case.via == "run":  # the same checkpoint through the Python API: the same error type
            with pytest.raises(case.error):
                load_model(weights=d, device="cpu", **{k.lstrip("-"): v for k, v in
                                                       zip(case.flags[::2], case.flags[1::2], strict=True)})
    assert case.fragment in message, message
    assert list(out.parent.iterdir()) == [], "nothing may be written for a refused checkpoint"


def test_table_is_big_enough():
    assert len(CASES) >= 25
    assert {c.via for c in CASES} == {"import", "run", "api"}


def test_quantized_checkpoint_accepts_flags_that_agree(good):
    m = load_model(weights=good["int8"], device="cpu", dtype="fp32", quantize="int8")
    assert m.compile.dtype == "fp32"
    assert m.gm.meta["kiln_quantize"]["bits"] == 8


def test_shards_linked_like_the_hf_hub_cache_load(good, tmp_path):
    # snapshots/<rev>/model-0000x.safetensors -> ../../blobs/<hash>: symlinks out of the directory are fine,
    # only index entries naming paths outside it are refused.
    d = tmp_path / "snapshots" / "rev"
    shutil.copytree(good["sharded"], d)
    (tmp_path / "blobs").mkdir()
    for i, shard in enumerate(sorted(d.glob("model-0000*.safetensors"))):
        blob = tmp_path / "blobs" / f"blob{i}"
        shard.rename(blob)
        os.symlink(Path("..", "..", "blobs", blob.name), shard)
    m = load_model(weights=d, device="cpu")
    assert m.model.layers == 2
