"""Render Triton kernel source from the Jinja2 templates in codegen/templates/.

A template is one kernel family written as plain Triton; Jinja only fills in the kernel name and a header
comment. Everything a family varies on (norm kind, activation, causal, tile sizes) is a `tl.constexpr`
argument, so branching stays in Python and Triton specializes on it. The header records the instance
(family, op, tile config, flags) so a dumped or cached .py file says what it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

from kiln.errors import CodegenError

TEMPLATE_DIR = Path(__file__).parent / "templates"
_SUFFIX = ".py.j2"

_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
)


def template_names() -> list[str]:
    """The kernel families there are templates for, e.g. ["act", "flash_attn", "norm", "rope"]. Files whose name
    starts with "_" are shared device code that family templates include, not families."""
    return sorted(p.name.removesuffix(_SUFFIX) for p in TEMPLATE_DIR.glob(f"*{_SUFFIX}") if not p.name.startswith("_"))


def template_sources(family: str) -> list[str]:
    """The texts that go into a family's kernels: its template, then every file it includes (transitively)."""
    seen: list[str] = []
    todo = [f"{family.removesuffix(_SUFFIX)}{_SUFFIX}"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.append(name)
        source = (TEMPLATE_DIR / name).read_text()
        todo += [node.template.value for node in _env.parse(source).find_all(jinja2.nodes.Include)]
    return [(TEMPLATE_DIR / n).read_text() for n in seen]


def _format_items(items: dict[str, Any] | None) -> str:
    if not items:
        return "-"
    return " ".join(f"{k}={v!r}" for k, v in sorted(items.items()))


def header(family: str, params: dict[str, Any]) -> str:
    """The comment block on top of every rendered kernel: family, op, tile config and the other params."""
    rest = {k: v for k, v in params.items() if k not in ("name", "op", "tile", "params")}
    flags = dict(params.get("params") or {}, **rest)
    lines = [
        f"# kiln generated Triton kernel (template codegen/templates/{family}{_SUFFIX}); do not edit",
        f"# family: {family}",
        f"# kernel: {params.get('name', '-')}",
        f"# op: {params.get('op', '-')}",
        f"# tile: {_format_items(params.get('tile'))}",
        f"# params: {_format_items(flags)}",
    ]
    return "\n".join(lines)


def render(template: str, **params: Any) -> str:
    """Render `template` ("norm" or "norm.py.j2") with `params` into Triton source.

    Conventional params: `name` (the @triton.jit function's name), `op`, `tile` (dict of tile sizes and
    launch options) and `params` (dict of constexpr flags); all of them go into the header comment.
    """
    family = template.removesuffix(_SUFFIX)
    try:
        tmpl = _env.get_template(family + _SUFFIX)
    except jinja2.TemplateNotFound:
        raise CodegenError(
            f"no kernel template {family!r}; expected one of {template_names()} in {TEMPLATE_DIR}"
        ) from None
    try:
        return tmpl.render(header=header(family, params), **params)
    except jinja2.UndefinedError as e:
        raise CodegenError(
            f"template {family}{_SUFFIX} needs a parameter that was not given ({e.message}); "
            f"pass it to render() (given: {sorted(params)})"
        ) from None
    except jinja2.TemplateError as e:
        raise CodegenError(f"template {family}{_SUFFIX} failed to render: {e}") from None
