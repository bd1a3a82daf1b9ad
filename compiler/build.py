"""From (spec, checkpoint, flags) to a ready-to-run model: the one place the CLI and the Python API share.

LoadedModel and the settings it is loaded with live in kiln.loaded_model, the spec / weights paths in
kiln.model_paths, a checkpoint's sampling defaults in kiln.generation_defaults; all importable from here too.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch

from kiln.compile.pipeline import CALIBRATION_TOKENIZER
from kiln.compile.prequantized import keep_quantized_linears
from kiln.compile.quantized import SPEC, check_stored_settings, is_quantized_checkpoint, load_quantized
from kiln.errors import KilnError
from kiln.generation_defaults import GENERATION_KEYS, generation_defaults_for, read_generation_defaults  # noqa: F401
from kiln.gguf.config import GGUFError, architecture, config_from_gguf, open_gguf
from kiln.gguf.files import bundled_weights, is_gguf
from kiln.gguf.tokenizer import load_gguf_tokenizer
from kiln.gguf.weights import load_gguf_weights
from kiln.hf.config import config_from_hf, load_hf_config
from kiln.hf.spec_match import check_spec_matches
from kiln.hf.weights import load_hf_weights
from kiln.ir.frontend import TORCH_DTYPES, build_graph
from kiln.loaded_model import LoadedModel, _dtype_error, fit_quantize, quantize_label, resolve_device, say  # noqa: F401
from kiln.model_config import DTYPE_AUTO, DTYPES, CompileConfig, ModelConfig, dtype_name
from kiln.model_paths import check_weights_dir, resolve_model_paths
from kiln.quant.formats import QuantScheme, as_scheme, dequantize, kept_from_spec, override_scheme
from kiln.quant.sizing import resolve_group
from kiln.spec.loader import DEFAULT_SPEC, load_spec
from kiln.spec.route import describe_route
from kiln.tokenizer import load_tokenizer
from kiln.train.router_files import attach_routers, check_routers_file

log = logging.getLogger(__name__)


def checkpoint_dtype(weights_dir: Path) -> str | None:
    """The dtype a Hugging Face checkpoint says it is in (config.json's torch_dtype, transformers 5's dtype), as
    kiln names it; None when it says none kiln computes in."""
    hf = load_hf_config(weights_dir)
    name = dtype_name(hf.get("torch_dtype") or hf.get("dtype"))
    return name if name in DTYPES else None


def _model_from_checkpoint(weights: Path, *, quiet: bool = False) -> tuple[ModelConfig, str]:
    """A checkpoint's ModelConfig from its config.json and its model_type; the import notes go to stderr unless
    quiet (a look ahead at the shapes, whose load says them later)."""
    hf = load_hf_config(weights)
    notes: list[str] = []
    cfg = config_from_hf(hf, name=weights.name, source=str(weights / "config.json"), notes=notes)
    for note in [] if quiet else notes:
        say(f"note: {note}")
    return cfg, hf.get("model_type", "")


def load_model(
    spec: str | os.PathLike | None = None,
    weights: str | os.PathLike | None = None,
    *,
    dtype: str | None = None,
    device: str = "auto",
    seed: int = 0,
    quantize: str | None = None,
    routers: str | os.PathLike | None = None,
    generation_config: str | os.PathLike = "auto",
) -> LoadedModel:
    """Build the Level-1 graph with weights.

    spec: a .kiln path or a bundled spec name; when None it is read from the checkpoint's config.json, or the
    bundled default spec is used when there is no checkpoint either. A checkpoint directory or a .gguf file given
    as the spec is taken as the weights (resolve_model_paths). weights: a HF checkpoint directory or a .gguf file;
    when None the weights are seeded random. dtype and quantize (a scheme name such as int8 or int4-gptq-g128)
    override the spec's compile part (CLI flags win; quantize sets the format and method: with_quantize); dtype takes
    vLLM's names too, and "auto": the spec's dtype, or without a spec a checkpoint's config.json torch_dtype.
    routers: a `kiln train-router` file whose Mixture-of-Depths routers are attached to the dense model (before any
    quantization, which then covers the routed model). generation_config: where LoadedModel.generation_defaults come
    from ("auto": the checkpoint's generation_config.json; "vllm": none; or a directory holding one), as vLLM's
    --generation-config.
    """

    spec, weights = resolve_model_paths(spec, weights)
    dtype = dtype_name(dtype)
    if dtype is not None and dtype != DTYPE_AUTO and dtype not in DTYPES:
        raise KilnError(_dtype_error(dtype))
    dev = resolve_device(device)
    if routers is not None:
        check_routers_file(routers)  # before the weights load: a wrong path fails in a second, not a minute

    weights = weights if weights is not None else bundled_weights(spec)  # a bundled spec may name a packaged GGUF
    if is_gguf(weights):
        gen = generation_defaults_for(generation_config, None)  # a GGUF carries no generation_config.json
        m = _load_gguf(spec, weights, dtype=None if dtype == DTYPE_AUTO else dtype, dev=dev, seed=seed,
                       quantize=quantize, routers=routers)
        m.generation_defaults, m.generation_source = gen
        return m
    weights_dir = Path(weights) if weights is not None else None
    if weights_dir is not None and is_quantized_checkpoint(weights_dir):
        if routers is not None:
            raise KilnError(f"routers {routers} (--routers): {weights_dir} is a `kiln quantize` checkpoint, and "
                            "routers attach to a model's dense weights; give the original checkpoint (with "
                            "--quantize to quantize the routed model)")
        gen = generation_defaults_for(generation_config, weights_dir)
        m = _load_quantized(weights_dir, spec, dev, dtype=None if dtype == DTYPE_AUTO else dtype, quantize=quantize)
        m.generation_defaults, m.generation_source = gen
        return m
    if weights_dir is not None:
        check_weights_dir(weights_dir)
    gen = generation_defaults_for(generation_config, weights_dir)  # before the weights: a bad file fails fast
    if dtype == DTYPE_AUTO:  # vLLM's default: the model's own dtype
        dtype = checkpoint_dtype(weights_dir) if spec is None and weights_dir is not None else None

    model_type = ""
    if spec is None and weights_dir is not None:
        cfg, model_type = _model_from_checkpoint(weights_dir)
        comp, source = CompileConfig(), str(weights_dir)
    else:
        loaded = load_spec(spec if spec is not None else DEFAULT_SPEC)
        cfg, comp, source = loaded.model, loaded.compile, loaded.path
        if weights_dir is not None:
            hf_cfg, model_type = _model_from_checkpoint(weights_dir)
            check_spec_matches(cfg, hf_cfg, source, str(weights_dir / "config.json"))

    if dtype is not None:
        comp = dataclasses.replace(comp, dtype=dtype)
    if quantize is not None:
        comp = with_quantize(comp, quantize)
    comp = fit_quantize(comp, cfg)
    tdtype = TORCH_DTYPES[comp.dtype]

    params = None
    if weights_dir is not None:
        params = load_hf_weights(weights_dir, cfg, model_type=model_type, dtype=tdtype, device=dev)
    gm = build_graph(cfg, params, dtype=tdtype, device=dev, seed=seed)
    if routers is not None:
        cfg, comp, gm = _with_routers(cfg, comp, gm, routers)
    tokenizer = load_tokenizer(weights_dir, vocab=cfg.vocab)
    comp = _with_tokenizer(comp, tokenizer)
    return LoadedModel(model=cfg, compile=comp, gm=gm, tokenizer=tokenizer, device=dev, source=source,
                       random_seed=seed if weights_dir is None else None, generation_defaults=gen[0],
                       generation_source=gen[1])


def with_quantize(comp: CompileConfig, quantize: str) -> CompileConfig:
    """comp with a --quantize name (LLM's quantize=) over the spec's `quantize`: the name sets the format and method;
    the spec's lm_head / embeddings and, for GPTQ, its calibration stay (kiln.quant.formats.override_scheme), as a
    note says. `kiln quantize --quantize` takes the same scheme, so its output is what this quantizes."""
    scheme = override_scheme(comp.extra.get("quantize"), quantize)
    kept = kept_from_spec(scheme) if comp.extra.get("quantize") else []
    if kept:
        say(f"note: quantize {quantize!r} (--quantize) sets the format and method; kept from the spec: "
            f"{', '.join(kept)}")
    return dataclasses.replace(comp, extra={**comp.extra, "quantize": scheme})


def _with_tokenizer(comp: CompileConfig, tokenizer: object) -> CompileConfig:
    """comp carrying the model's tokenizer for the quantize pass: a GPTQ calibration file is encoded into this model's
    tokens wherever the model compiles (kiln.compile.pipeline.CALIBRATION_TOKENIZER); kiln's byte-level fallback is
    the tokenizer of a model without one, whose tokens are then the file's bytes."""
    return dataclasses.replace(comp, extra={**comp.extra, CALIBRATION_TOKENIZER: tokenizer})


def _load_quantized(
    weights_dir: Path, spec: str | os.PathLike | None, dev: torch.device, *, dtype: str | None, quantize: str | None
) -> LoadedModel:
    """A checkpoint written by `kiln quantize`: its graph is already passed (fusion + quantize), no calibration.

    Its scheme and float dtype are fixed when it is written: --quantize / --dtype that agree are accepted,
    others refused (the weights cannot be re-quantized or re-cast here), never silently ignored; a spec whose own
    `quantize` differs is warned about (the checkpoint runs as stored).
    """

    loaded = load_spec(spec if spec is not None else weights_dir / SPEC)
    if spec is not None:  # the stored spec.kiln is what the weights were quantized as
        check_spec_matches(loaded.model, load_spec(weights_dir / SPEC).model, loaded.path, str(weights_dir / SPEC))
    dtype = dtype_name(dtype)
    if dtype is not None and dtype not in DTYPES:
        raise KilnError(_dtype_error(dtype))
    have, stored = check_stored_settings(weights_dir, loaded.model, quantize=quantize, dtype=dtype)
    if spec is not None and loaded.compile.extra.get("quantize"):  # --quantize over it keeps lm_head / embeddings
        own = loaded.compile.extra["quantize"]
        _warn_spec_scheme(loaded.path, as_scheme(own) if quantize is None else override_scheme(own, quantize), have,
                          loaded.model, weights_dir)
    gm = load_quantized(weights_dir, loaded.model, device=dev)
    comp = dataclasses.replace(loaded.compile, dtype=stored)
    comp = dataclasses.replace(comp, extra={k: v for k, v in comp.extra.items() if k != "quantize"})  # stored already
    tokenizer = load_tokenizer(weights_dir, vocab=loaded.model.vocab)
    return LoadedModel(loaded.model, comp, gm, tokenizer, dev, source=str(weights_dir),
                       stored_quantize=have.label)


def _stored_form(scheme: QuantScheme) -> tuple[str, bool, bool]:
    """What a scheme fixes in stored weights (its calibration options shaped them, but are not recorded reliably)."""
    return scheme.label, scheme.lm_head, scheme.embeddings


def _warn_spec_scheme(source: str, want: QuantScheme, have: QuantScheme, model: ModelConfig, weights_dir: Path) -> None:
    """Warn when the spec's own `quantize` is not the one a `kiln quantize` checkpoint was written with."""
    try:
        want = resolve_group(want, model)[0]
    except KilnError:
        pass  # a group that fits no K: compared as written, still a difference worth the warning
    if _stored_form(want) != _stored_form(have):
        def words(s: QuantScheme) -> str:
            return s.label + "".join(f", {k} = true" for k in ("lm_head", "embeddings") if getattr(s, k))

        log.warning("%s asks for quantize %s, but %s was quantized by `kiln quantize` with %s: it runs as stored; "
                    "quantize again from this spec to get its scheme", source, words(want), weights_dir, words(have))


def describe_model(spec: str | os.PathLike | None = None, weights: str | os.PathLike | None = None) -> ModelConfig:
    """The ModelConfig load_model would build, read without any weights (a spec, config.json or GGUF metadata), so
    that what depends on the shapes (e.g. which quantization groups fit) is checked before slow work."""
    spec, weights = resolve_model_paths(spec, weights)
    weights = weights if weights is not None else bundled_weights(spec)
    if spec is not None:
        return load_spec(spec).model
    if weights is None:
        return load_spec(DEFAULT_SPEC).model
    if is_gguf(weights):
        return config_from_gguf(open_gguf(Path(weights)), Path(weights))
    path = Path(weights)
    if is_quantized_checkpoint(path):
        return load_spec(path / SPEC).model
    check_weights_dir(path)
    return _model_from_checkpoint(path, quiet=True)[0]


def _with_routers(cfg: ModelConfig, comp: CompileConfig, gm: torch.fx.GraphModule,
                  routers: str | os.PathLike) -> tuple[ModelConfig, CompileConfig, torch.fx.GraphModule]:
    """The routed model: its config, its compile config (extra["route"] turns the mod_routing pass on, as a routed
    spec's validation does) and its Level-1 graph."""
    cfg, gm = attach_routers(cfg, gm, routers)
    say(f"routers from {routers}: {describe_route(cfg)}")
    return cfg, dataclasses.replace(comp, extra={**comp.extra, "route": cfg.route}), gm


def _load_gguf(spec: str | os.PathLike | None, weights: str | os.PathLike, *, dtype: str | None,
               dev: torch.device, seed: int, quantize: str | None, routers: str | os.PathLike | None) -> LoadedModel:
    """A GGUF file -> LoadedModel; the spec (when given) must match the file's tensors. Linears stored as Q4_0 /
    Q4_1 / Q8_0 stay quantized on CUDA, or anywhere with quantize="gguf" (the CPU reference op would dequantize them
    every step); everything else is dequantized with the gguf package. quantize="none" dequantizes everything; any
    other scheme dequantizes everything and then lets kiln's quantize pass requantize as asked."""

    path = Path(weights)
    reader = open_gguf(path)
    arch = architecture(reader, path)
    if spec is None:
        cfg, comp, source = config_from_gguf(reader, path), CompileConfig(), str(path)
    else:
        loaded = load_spec(spec)
        cfg, comp, source = loaded.model, loaded.compile, loaded.path
        check_spec_matches(cfg, config_from_gguf(reader, path), source, f"{path}'s metadata")
    dtype = dtype_name(dtype)
    if dtype is not None and dtype != DTYPE_AUTO:
        if dtype not in DTYPES:
            raise GGUFError(_dtype_error(dtype))
        comp = dataclasses.replace(comp, dtype=dtype)
    if routers is not None and quantize == "gguf":
        raise GGUFError(f"routers {routers} (--routers) attach to dense weights, and quantize 'gguf' keeps "
                        f"{path.name}'s linears quantized; leave quantize out, or name a kiln scheme (int8, int4, ...)")
    # Kept int4 pays off where the generated kernels run (CUDA); the CPU reference op would dequantize every step.
    # Routers attach to the dense graph: the file's linears are then dequantized (a kiln scheme may requantize).
    keep = quantize == "gguf" or (quantize is None and "quantize" not in comp.extra and dev.type == "cuda"
                                  and routers is None)
    if quantize not in (None, "none", "gguf"):
        comp = with_quantize(comp, quantize)
    comp = fit_quantize(comp, cfg)
    tdtype = TORCH_DTYPES[comp.dtype]
    tokenizer = load_gguf_tokenizer(reader, path)  # before the weights: a bad tokenizer fails fast, nothing loaded
    w = load_gguf_weights(reader, path, cfg, arch=arch, keep=keep, dtype=tdtype, device=dev)
    params = dict(w.dense)
    for name, qw in w.quantized.items():  # the graph is built dense, then the kept linears are swapped in
        params[name] = dequantize(qw, tdtype)
    gm = build_graph(cfg, params, dtype=tdtype, device=dev, seed=seed)
    if w.quantized:
        gm = keep_quantized_linears(gm, w.quantized)
    if routers is not None:
        cfg, comp, gm = _with_routers(cfg, comp, gm, routers)
    say(f"{path.name}: {w.summary()}")
    comp = _with_tokenizer(comp, tokenizer)
    return LoadedModel(model=cfg, compile=comp, gm=gm, tokenizer=tokenizer, device=dev, source=source,
                       stored_quantize="gguf" if w.quantized else None)
