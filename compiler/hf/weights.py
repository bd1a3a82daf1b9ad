"""Hugging Face safetensors checkpoints (single file or sharded) -> {kiln weight name: tensor}.

A plan (kiln.hf.weight_plan) lists, for every tensor the checkpoint must hold, its HF name, the shape it must
have, the kiln names it fills and how. The checkpoint is checked against the plan from the safetensors headers
first, all problems in one WeightError, and only then read, one tensor at a time.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

from kiln.errors import WeightError
from kiln.hf.weight_plan import HF_PREFIX, Source, weight_plan
from kiln.model_config import ModelConfig, param_shapes
from kiln.progress import PROGRESS_THRESHOLD

# Buffers some checkpoints carry that are not weights (GPT-2's causal mask, cached rotary frequencies).
_IGNORED = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")


def _regular_file(path: Path, what: str) -> bool:
    """True when `path` is a readable regular file; False when absent; a WeightError for anything else there."""
    try:
        if path.is_file():
            return True
        present = path.is_symlink() or path.exists()
    except OSError as e:  # a symlink loop, a name too long, a permission problem
        raise WeightError(f"{path}: cannot read the {what} ({e}); replace it with the real file") from None
    if present:
        kind = "a directory" if path.is_dir() else "a broken or looping symlink" if path.is_symlink() else "not a file"
        raise WeightError(f"{path}: the {what} is {kind}, not a file; replace it with the real file")
    return False


def _index_shards(index: Path) -> list[str]:
    try:
        data = json.loads(index.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WeightError(f"{index}: not valid JSON ({e}); re-save the checkpoint with save_pretrained") from None
    wmap = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise WeightError(f"{index}: has no `weight_map` object (tensor name -> shard file); re-save the "
                          "checkpoint with save_pretrained, or remove the index next to a single model.safetensors")
    bad = [f"{k!r}: {v!r}" for k, v in wmap.items() if not isinstance(v, str) or not v]
    if bad:
        raise WeightError(f"{index}: weight_map values must be shard file names, got {', '.join(bad[:3])}")
    return sorted(set(wmap.values()))


def checkpoint_files(hf_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: model.safetensors, the shards of an index, or any *.safetensors."""
    d = Path(hf_dir)
    if _regular_file(d / "model.safetensors", "weights file"):
        return [d / "model.safetensors"]
    index = d / "model.safetensors.index.json"
    if _regular_file(index, "shard index"):
        files: list[Path] = []
        missing = []
        for shard in _index_shards(index):
            path = d / shard
            # Judged by name, not by where a symlink points: the HF hub cache links shards into ../../blobs.
            if Path(shard).is_absolute() or ".." in Path(shard).parts:
                raise WeightError(f"{index} names shard {shard!r}, which is outside the checkpoint directory {d}; "
                                  "kiln reads shards only from the checkpoint's own directory: fix the index")
            if not _regular_file(path, "shard"):
                missing.append(shard)
            files.append(path)
        if missing:
            raise WeightError(f"{index} names shards that are not there: {', '.join(missing)}")
        return files
    files = sorted(p for p in d.glob("*.safetensors") if _regular_file(p, "weights file"))
    if files:
        return files
    bins = sorted(p.name for p in d.glob("*.bin"))
    hint = f" (found {', '.join(bins)})" if bins else ""
    raise WeightError(
        f"{d}: no .safetensors weights{hint}; kiln reads only safetensors. Convert a .bin checkpoint with "
        "transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"
    )


def _unreadable(path: Path, e: Exception) -> WeightError:
    return WeightError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); the file is corrupt or "
                       "truncated: download or save the checkpoint again")


def _scan(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], int]]:
    """HF name -> (file, shape, bytes), from the headers only."""
    from safetensors import SafetensorError, safe_open

    found: dict[str, tuple[Path, tuple[int, ...], int]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    shape = tuple(sl.get_shape())
                    nbytes = _itemsize(sl.get_dtype())
                    for n in shape:
                        nbytes *= n
                    if name in found:  # which copy to load is a guess (the last file read won, silently)
                        raise WeightError(f"tensor {name} is in both {found[name][0]} and {path}; a checkpoint holds "
                                          "each tensor once: remove the stray file (or the copy) from the directory")
                    found[name] = (path, shape, nbytes)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise _unreadable(path, e) from None
    return found


def _itemsize(st_dtype: str) -> int:
    # safetensors dtype names: F32, BF16, I64, U8, BOOL, F8_E4M3, ... (bits follow the leading letters)
    m = re.match(r"[A-Z]+(\d+)", st_dtype)
    return max(int(m.group(1)) // 8, 1) if m else 1


def _canonical(name: str, prefix: str) -> str:
    # Checkpoints saved from the base model (GPT2Model, LlamaModel) lack the "transformer."/"model." prefix.
    return name if name.startswith(prefix) or name == "lm_head.weight" else prefix + name


def _check(plan: list[Source], found: dict, names: dict[str, str], cfg: ModelConfig) -> None:
    problems: list[str] = []
    for src in plan:
        if src.hf not in names:
            problems.append(f"missing tensor {src.hf} (for kiln {', '.join(src.targets)}, shape {list(src.shape)})")
        elif found[names[src.hf]][1] != src.shape:
            problems.append(
                f"tensor {names[src.hf]} has shape {list(found[names[src.hf]][1])}; "
                f"expected {list(src.shape)} (for kiln {', '.join(src.targets)})"
            )
    wanted = {src.hf for src in plan}
    for canon, actual in sorted(names.items()):
        tied_head = canon == "lm_head.weight" and cfg.tie_embeddings
        if canon not in wanted and not tied_head and not _IGNORED.search(canon):
            problems.append(
                f"unexpected tensor {actual} (shape {list(found[actual][1])}) that the model "
                f"{cfg.name!r} has no place for"
            )
    if problems:
        routers = [src.hf for src in plan if ".router." in src.hf and src.hf not in names]
        if routers:
            hint = (f"\n  hint: the spec routes layers (route = mod(...)) and the checkpoint lacks {len(routers)} "
                    "router tensor(s): save them next to the layer's (kiln.model_config.ModConfig names them), or "
                    "remove the route setting to run the dense model")
        elif any(src.hf == "lm_head.weight" and src.hf not in names for src in plan):
            hint = ("\n  hint: without lm_head.weight the head is the embedding: config.json should say "
                    "tie_word_embeddings: true")
        elif any(p.startswith("tensor ") for p in problems):
            # A spec given with the weights was checked against config.json first (kiln.hf.spec_match), so here
            # both describe other tensors, or config.json alone when no spec was given.
            hint = ("\n  hint: the model's sizes differ from these tensors': they come from config.json (its "
                    "hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim or vocab_size) "
                    "and from the spec when one is given with the weights; use the config.json saved with these "
                    "weights, and a spec that matches it (`kiln import` of the checkpoint writes one) or none")
        else:
            hint = ""
        raise WeightError(
            f"checkpoint does not match model {cfg.name!r} ({len(problems)} problems):\n  " + "\n  ".join(problems)
            + hint
        )


def _check_tied_head(found: dict, names: dict[str, str], embed: str) -> None:
    """config.json ties the head to the embedding but the checkpoint also stores a head: serving the embedding is
    right only when the two are equal. transformers 5 serves a different stored head (it unties), 4.x the embedding,
    so a difference is refused rather than guessed."""
    from safetensors import SafetensorError, safe_open

    tensors = []
    for name in (names["lm_head.weight"], names[embed]):
        try:
            with safe_open(str(found[name][0]), framework="pt") as f:
                tensors.append(f.get_tensor(name))
        except (SafetensorError, OSError) as e:
            raise _unreadable(found[name][0], e) from None
    head, emb = tensors
    if head.shape != emb.shape or not torch.equal(head, emb.to(head.dtype)):
        raise WeightError(
            f"config.json says tie_word_embeddings: true, but the checkpoint's {names['lm_head.weight']} differs from "
            f"the embedding {names[embed]}; to serve the stored head set tie_word_embeddings to false in config.json, "
            "to serve the embedding delete lm_head.weight from the checkpoint"
        )


def _finite(t: torch.Tensor, name: str, path: Path) -> torch.Tensor:
    """t, unless it holds NaN or inf: such weights make every logit NaN and greedy decoding emit token 0."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise WeightError(f"{path}: tensor {name} holds {bad} NaN/inf values of {t.numel()}; the checkpoint is "
                          "corrupt (or was saved after a diverged step): use an intact checkpoint")
    return t


def load_hf_weights(
    hf_dir: str | Path,
    cfg: ModelConfig,
    *,
    model_type: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Kiln weights for `cfg` from a HF safetensors checkpoint, cast to `dtype` and placed on `device`.

    progress: a byte-count bar on stderr; None shows it for checkpoints over 1 GiB.
    """
    from safetensors import SafetensorError, safe_open
    from tqdm import tqdm

    plan = weight_plan(cfg, model_type)
    found = _scan(checkpoint_files(hf_dir))
    names = {_canonical(n, HF_PREFIX[model_type]): n for n in found}
    _check(plan, found, names, cfg)
    if cfg.tie_embeddings and "lm_head.weight" in names:
        _check_tied_head(found, names, next(src.hf for src in plan if src.targets == ("embed.weight",)))

    total = sum(found[names[src.hf]][2] for src in plan)
    show = progress if progress is not None else total > PROGRESS_THRESHOLD
    by_file: dict[Path, list[Source]] = {}
    for src in plan:
        by_file.setdefault(found[names[src.hf]][0], []).append(src)
    out: dict[str, torch.Tensor] = {}
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="kiln: loading weights", file=sys.stderr, disable=not show
    ) as bar:
        for path, sources in by_file.items():
            try:
                with safe_open(str(path), framework="pt") as f:
                    for src in sources:
                        hf_name = names[src.hf]
                        tensor = _finite(f.get_tensor(hf_name), hf_name, path)
                        for kiln, t in zip(src.targets, src.convert(tensor), strict=True):
                            out[kiln] = t.to(device=device, dtype=dtype).contiguous()
                        bar.update(found[hf_name][2])
            except (SafetensorError, OSError) as e:
                raise _unreadable(path, e) from None
    shapes = param_shapes(cfg)
    assert all(tuple(out[n].shape) == s for n, s in shapes.items()), "weight plan produced a wrong shape"
    return {n: out[n] for n in shapes}
