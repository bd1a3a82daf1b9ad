"""The graph writer behind kiln.ir.frontend.build_graph: a ModelConfig's layer program -> fx nodes of kiln ops.

GraphBuilder emits one node per kiln op, named by where it stands (`layers.0.attn0.q` -> layers_0_attn0_q); each
weight is one get_attr node (tied embeddings share it), the rotary frequencies the buffer INV_FREQ. A
Mixture-of-Depths routed layer is written in the dense-masked form.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import kiln.ir.ops  # noqa: F401  (registers torch.ops.kiln.*)
import kiln.ir.ops_mod  # noqa: F401  (registers the Mixture-of-Depths ops)
from kiln.model_config import Add, AttentionCall, LayerExpr, MlpCall, ModelConfig, NormCall, Var

kiln_ops = torch.ops.kiln
GATED_KIND = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh"}
INV_FREQ = "rope_inv_freq"


class GraphBuilder:
    """Emits the graph; one instance per build."""

    def __init__(self, cfg: ModelConfig, mod_form: str = "causal"):
        self.cfg, self.mod_form = cfg, mod_form
        self.graph = fx.Graph()
        self.attrs: dict[str, fx.Node] = {}
        self.routed: fx.Node | None = None  # the routed-token mask while a routed layer's body is emitted

    def attr(self, name: str) -> fx.Node:
        # One get_attr node per tensor, so tied embeddings share a single node.
        if name not in self.attrs:
            self.attrs[name] = self.graph.get_attr(name)
        return self.attrs[name]

    def maybe_attr(self, name: str, present: bool) -> fx.Node | None:
        return self.attr(name) if present else None

    def op(self, target, args: tuple, name: str) -> fx.Node:
        return self.graph.create_node("call_function", target, args, name=name.replace(".", "_"))

    def linear(self, x: fx.Node, prefix: str, bias: bool) -> fx.Node:
        w, b = self.attr(f"{prefix}.weight"), self.maybe_attr(f"{prefix}.bias", bias)
        return self.op(kiln_ops.linear.default, (x, w, b), prefix)

    def norm(self, x: fx.Node, prefix: str) -> fx.Node:
        eps, w = self.cfg.norm.eps, self.attr(f"{prefix}.weight")
        if self.cfg.norm.kind == "rms":
            return self.op(kiln_ops.rms_norm.default, (x, w, eps), prefix)
        return self.op(kiln_ops.layer_norm.default, (x, w, self.attr(f"{prefix}.bias"), eps), prefix)

    def attention(self, x: fx.Node, site: AttentionCall, prefix: str, positions: fx.Node) -> fx.Node:
        cfg = self.cfg
        q, k, v = (self.linear(x, f"{prefix}.{p}", site.qkv_bias) for p in ("q", "k", "v"))
        if site.qk_norm:  # per head, before rope (Qwen3); eps is the model norm's
            q, k = (self.op(kiln_ops.head_rms_norm.default, (t, self.attr(f"{prefix}.{p}_norm.weight"), cfg.norm.eps),
                            f"{prefix}.{p}_norm") for t, p in ((q, "q"), (k, "k")))
        if cfg.positions == "rope" and site.rope:
            inv_freq = self.attr(INV_FREQ)
            q = self.op(kiln_ops.rope.default, (q, positions, inv_freq), f"{prefix}.q_rope")
            k = self.op(kiln_ops.rope.default, (k, positions, inv_freq), f"{prefix}.k_rope")
        args = (q, k, v, cfg.heads, cfg.kv_heads, site.causal, site.window or 0, cfg.head_dim**-0.5)
        if self.routed is not None:  # a routed layer: attention among its routed tokens only
            out = self.op(kiln_ops.routed_attention.default, (q, k, v, self.routed, *args[3:]), prefix)
        else:
            out = self.op(kiln_ops.attention.default, args, prefix)
        return self.linear(out, f"{prefix}.o", site.out_bias)

    def mlp(self, x: fx.Node, site: MlpCall, prefix: str) -> fx.Node:
        gate = self.linear(x, f"{prefix}.gate", site.bias) if site.gated else None
        up = self.linear(x, f"{prefix}.up", site.bias)
        if gate is not None:
            h = self.op(kiln_ops.gated_act.default, (gate, up, GATED_KIND[site.act]), f"{prefix}.act")
        else:
            h = self.op(kiln_ops.act.default, (up, site.act), f"{prefix}.act")
        return self.linear(h, f"{prefix}.down", site.bias)

    def expr(self, e: LayerExpr, env: dict[str, fx.Node], layer: int, positions: fx.Node) -> fx.Node:
        if isinstance(e, Var):
            assert e.name in env, f"layer program reads undefined variable {e.name!r}"  # validation guarantees it
            return env[e.name]
        if isinstance(e, Add):
            left = self.expr(e.left, env, layer, positions)
            right = self.expr(e.right, env, layer, positions)
            return self.op(kiln_ops.add.default, (left, right), f"layers.{layer}.add")
        arg = self.expr(e.arg, env, layer, positions)
        prefix = f"layers.{layer}.{e.site}"
        if isinstance(e, NormCall):
            return self.norm(arg, prefix)
        if isinstance(e, AttentionCall):
            return self.attention(arg, e, prefix, positions)
        if isinstance(e, MlpCall):
            return self.mlp(arg, e, prefix)
        raise TypeError(f"unknown layer expression {e!r}")

    def route(self, x: fx.Node, layer: int) -> tuple[fx.Node, fx.Node]:
        """(router score r, routed-token mask) of a routed layer, in the builder's form."""
        p, route = f"layers.{layer}.router", self.cfg.route
        w, b = self.attr(f"{p}.weight"), self.attr(f"{p}.bias")
        r = self.op(kiln_ops.mod_router.default, (x, w, b), p)
        if self.mod_form == "training":
            return r, self.op(kiln_ops.mod_topk_mask.default, (r, route.capacity), f"{p}.mask")
        if route.decide == "predictor":
            fc = [self.attr(f"{p}.predictor.fc{j}.{k}") for j in (1, 2) for k in ("weight", "bias")]
            logit = self.op(kiln_ops.mod_predictor.default, (x, *fc), f"{p}.predictor")
            return r, self.op(kiln_ops.mod_threshold_mask.default, (logit, None), f"{p}.mask")
        return r, self.op(kiln_ops.mod_threshold_mask.default, (r, self.attr(f"{p}.threshold")), f"{p}.mask")

    def build(self) -> fx.Graph:
        cfg, g = self.cfg, self.graph
        tokens, positions = g.placeholder("tokens"), g.placeholder("positions")
        x = self.op(kiln_ops.embedding.default, (self.attr("embed.weight"), tokens), "embed")
        if cfg.positions == "learned":
            pos = self.op(kiln_ops.embedding.default, (self.attr("pos_embed.weight"), positions), "pos_embed")
            x = self.op(kiln_ops.add.default, (x, pos), "embed_add")
        for i in range(cfg.layers):
            routed = cfg.route is not None and cfg.route.routed(i)
            if routed:
                r, self.routed = self.route(x, i)
            env = {"x": x}
            for stmt in cfg.body:
                env[stmt.target] = self.expr(stmt.value, env, i, positions)
            if routed:  # the dense-masked form: out = x + mask * r * (body(x) - x)
                x = self.op(kiln_ops.mod_combine.default, (x, env["x"], r, self.routed), f"layers.{i}.mod_combine")
                self.routed = None
            else:
                x = env["x"]
        if cfg.final_norm:
            x = self.norm(x, "final_norm")
        head = "embed.weight" if cfg.tie_embeddings else "lm_head.weight"
        logits = self.op(kiln_ops.linear.default, (x, self.attr(head), None), "logits")
        g.output(logits)
        g.lint()
        return g
