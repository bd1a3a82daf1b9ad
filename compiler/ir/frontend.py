"""ModelConfig -> Level-1 fx.GraphModule of torch.ops.kiln.* ops.

The graph is written node by node (no tracing; kiln.ir.graph_builder), so every node is exactly one kiln op and
carries a readable name (layers_0_attn0_q, layers_0_mlp0_down, ...). Weights are GraphModule parameters named as
`model_config.param_shapes` names them; the rotary frequencies are one non-persistent buffer, `rope_inv_freq`.
"""

from __future__ import annotations

import math
import sys
from statistics import NormalDist

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import kiln.ir.ops  # noqa: F401  (registers torch.ops.kiln.*)
import kiln.ir.ops_mod  # noqa: F401  (registers the Mixture-of-Depths ops)
from kiln.errors import KilnError, WeightError
from kiln.ir.attrs import set_tensor
from kiln.ir.graph_builder import INV_FREQ, GraphBuilder
from kiln.model_config import DTYPES, ModelConfig, RopeConfig, param_shapes
from kiln.progress import PROGRESS_THRESHOLD

# Mixture-of-Depths selection: "causal" (threshold or predictor, what kiln serves and `kiln run` uses) or
# "training" (the top capacity of each sequence by router score, for training and perplexity).
MOD_FORMS = ("causal", "training")
_DEFAULT_ROPE = RopeConfig(theta=10000.0)

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
assert tuple(TORCH_DTYPES) == DTYPES, "one entry per dtype name in kiln.model_config.DTYPES"


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """fp32 [head_dim / 2] rotary inverse frequencies with the config's scaling folded in (as HF computes them)."""
    rope = cfg.rope or _DEFAULT_ROPE
    d = cfg.head_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = rope.scaling
    if sc is None:
        return inv_freq
    if sc.kind == "linear":
        return inv_freq / sc.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
    low_wavelen = sc.original_context / sc.low_freq_factor
    high_wavelen = sc.original_context / sc.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / sc.factor, inv_freq)
    smooth = (sc.original_context / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def random_weights(
    cfg: ModelConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Seeded random weights for every name in param_shapes; on device "meta" nothing is allocated.

    Norm weights are 1 and biases 0; every matrix, embeddings included, is N(0, 1/dim_in). Small embeddings
    keep a tied lm_head from simply echoing the current token, so random models produce varied tokens.
    Mixture-of-Depths routers start as `router_start` says.
    """
    device = torch.device(device)
    if device.type == "meta":
        return {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in param_shapes(cfg).items()}
    from tqdm import tqdm  # lazy: only a real allocation needs it

    # On CUDA the values are drawn on the device (a host draw plus copy of an 8B model takes minutes); the CPU
    # stream stays the reference one, so CPU results do not change. Same seed, same device: same weights.
    where = device if device.type == "cuda" else torch.device("cpu")
    gen = torch.Generator(device=where).manual_seed(seed)
    shapes = param_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values()) * dtype.itemsize
    out: dict[str, torch.Tensor] = {}
    # Same rule as checkpoint loading: a bar on stderr for models over 1 GiB (a 1B model takes ~20 s on a CPU).
    with tqdm(total=total, unit="B", unit_scale=True, desc="kiln: random weights", file=sys.stderr,
              disable=total <= PROGRESS_THRESHOLD) as bar:
        for name, shape in shapes.items():
            if ".router." in name and name.endswith(("router.bias", "router.threshold")):
                t = torch.full(shape, router_start(cfg)[name.rsplit(".", 1)[1]], device=where)
            elif name.endswith(".bias"):
                t = torch.zeros(shape, device=where)
            elif len(shape) == 1:
                t = torch.ones(shape, device=where)
            else:
                t = torch.randn(shape, generator=gen, device=where).mul_(shape[1] ** -0.5)
            out[name] = t.to(device=device, dtype=dtype)
            bar.update(math.prod(shape) * dtype.itemsize)
    return out


def router_start(cfg: ModelConfig) -> dict[str, float]:
    """The random-init values of a routed layer's router.bias and router.threshold.

    router.weight is N(0, 1/dim) like every matrix and the bias 1, so r = x @ w.T + 1 is about 1 and the model
    starts near the dense one (a routed token's output is x + r * (body(x) - x)). r - 1 then has a standard
    deviation of about dim^-0.5 for inputs whose elements have the embeddings' scale, so the threshold
    1 + z * dim^-0.5, z the standard normal quantile at 1 - capacity, routes about `capacity` of the tokens in
    the causal form (exactly half at capacity 0.5; deeper layers, whose residual has grown, drift toward half).
    At capacity 1 the threshold is 0: every token routes. The predictor's matrices are small random and its
    biases 0, so its logit is centred on 0 and it routes about half the tokens.
    """
    capacity = cfg.route.capacity if cfg.route is not None else 1.0
    z = NormalDist().inv_cdf(1.0 - capacity) if capacity < 1.0 else None
    return {"bias": 1.0, "threshold": 1.0 + z * cfg.dim**-0.5 if z is not None else 0.0}


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Raise WeightError listing every missing, unexpected and wrongly shaped tensor."""
    expected = param_shapes(cfg)
    problems = [f"  missing: {n} (expected shape {list(s)})" for n, s in expected.items() if n not in weights]
    problems += [
        f"  wrong shape: {n} expected {list(s)}, got {list(weights[n].shape)}"
        for n, s in expected.items()
        if n in weights and tuple(weights[n].shape) != s
    ]
    problems += [f"  unexpected: {n} (shape {list(t.shape)})" for n, t in weights.items() if n not in expected]
    if problems:
        routers = sorted(n for n in expected if ".router." in n and n not in weights)
        hint = (f"\n  hint: the spec routes layers (route = mod(...)) but the weights lack {len(routers)} router "
                "tensor(s); add them to the checkpoint (names as in kiln.model_config.ModConfig), or remove the "
                "route setting to run the dense model" if routers else "")
        raise WeightError(
            f"weights do not match model {cfg.name!r} ({len(problems)} problem(s)):\n"
            + "\n".join(problems)
            + "\n  hint: the checkpoint and the spec disagree; check vocab, dim, heads, kv_heads, head_dim, ffn,"
            " layers and tie_embeddings in the spec, or the name mapping of the checkpoint" + hint
        )


def build_graph(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    mod_form: str = "causal",
) -> fx.GraphModule:
    """The Level-1 graph for `cfg`: forward(tokens [B, T] int64, positions [B, T] int64) -> logits [B, T, vocab].

    Without `weights`, seeded random weights are made (`random_weights`). Weights are cast to `dtype` and moved
    to `device`; device "meta" builds without allocating anything. node.meta["val"] is filled on every node.
    mod_form: how the routed layers of a Mixture-of-Depths model select tokens (MOD_FORMS): "causal" (router
    score > threshold, or predictor logit > 0; what serving and `kiln run` use) or "training" (the top capacity
    of each sequence by router score: for training and perplexity, it looks at the whole sequence). A routed
    layer is emitted in the dense-masked form (kiln.ir.ops_mod); the mod_routing pass gathers it.
    """
    if mod_form not in MOD_FORMS:
        raise KilnError(f"mod_form {mod_form!r} is not a Mixture-of-Depths form; use one of {', '.join(MOD_FORMS)}")
    device = torch.device(device)
    if weights is None:
        weights = random_weights(cfg, seed=seed, dtype=dtype, device=device)
    else:
        check_weights(cfg, weights)
    graph = GraphBuilder(cfg, mod_form).build()
    root = torch.nn.Module()
    for name in param_shapes(cfg):  # registration order = param_shapes order, so state_dict() lists it the same way
        set_tensor(root, name, weights[name].detach().to(device, dtype))
    uses_rope = any(n.op == "get_attr" and n.target == INV_FREQ for n in graph.nodes)
    if uses_rope:
        root.register_buffer(INV_FREQ, rope_inv_freq(cfg).to(device), persistent=False)  # always fp32
    gm = fx.GraphModule(root, graph, class_name=_class_name(cfg.name))
    for name, child in root.named_children():  # GraphModule installs submodules in its own order; restore ours
        delattr(gm, name)
        gm.add_module(name, child)
    if uses_rope:
        # GraphModule re-registers it as persistent; the frequencies derive from the config, they are not weights.
        gm.register_buffer(INV_FREQ, root.get_buffer(INV_FREQ), persistent=False)
    return propagate_fake(gm)


def _class_name(name: str) -> str:
    cleaned = "".join(c if c.isalnum() else "_" for c in name)
    return "Kiln_" + cleaned if cleaned else "KilnModel"


def propagate_fake(gm: fx.GraphModule, batch: int = 1, seq: int = 8) -> fx.GraphModule:
    """Fill node.meta["val"] on every node with FakeTensors for a [batch, seq] input; computes nothing."""
    ref = next(iter(gm.parameters()), None)
    device = ref.device if ref is not None else torch.device("cpu")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        tokens = torch.zeros(batch, seq, dtype=torch.long, device=device)
        positions = torch.arange(seq, device=device).expand(batch, seq).contiguous()
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(tokens, positions)
    return gm
