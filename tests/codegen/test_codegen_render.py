"""The renderer (codegen/render.py) and the kernel cache (codegen/cache.py).

Every template, rendered with a real parameter set, must import as a @triton.jit kernel whose constexpr
parameters are exactly the ones its wrapper passes (what it computes is checked against the reference ops by
the kernel tests: tests/test_kernel_table.py and the paged / quantized kernel tests).
"""

import ast
import inspect

import pytest

from kiln.codegen import render as render_mod
from kiln.codegen.cache import KernelCache
from kiln.codegen.render import render, template_names
from kiln.errors import CodegenError

RENDER_CASES = {
    "mod_route": dict(op="mod_route", tile={"BLOCK_T": 32, "BLOCK_D": 128, "BLOCK_S": 16, "num_warps": 4},
                      params={"SCORE": True}),
    "mod_select": dict(op="mod_route", tile={"BLOCK_T": 32, "BLOCK_D": 128, "num_warps": 4}, params={"SCORE": True}),
    "mod_scatter": dict(op="mod_scatter", tile={"BLOCK_C": 32, "BLOCK_D": 128, "num_warps": 4}, params={}),
    "norm": dict(
        op="rms_norm",
        tile={"BLOCK_D": 128, "num_warps": 4},
        params={"IS_RMS": True, "HAS_RESIDUAL": True, "HAS_BIAS": False},
    ),
    "rope": dict(op="qk_norm_rope", tile={"BLOCK_H": 4, "BLOCK_HALF": 32, "num_warps": 4}, params={"NORM": True}),
    "act": dict(op="gated_act", tile={"BLOCK_SIZE": 1024, "num_warps": 4}, params={"ACT": "silu", "GATED": True}),
    "flash_attn": dict(
        op="attention",
        tile={"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_D": 128, "num_warps": 8, "num_stages": 3},
        params={"CAUSAL": True, "HAS_WINDOW": False, "EVEN_D": True, "INPUT_PRECISION": None, "DOT_FP32": False,
                "USE_TMA": False},
    ),
    "paged_kv_write": dict(op="paged_kv_write", tile={"BLOCK_H": 8, "BLOCK_D": 128, "num_warps": 1},
                           params={"QUANT": False}),
    "paged_decode": dict(
        op="paged_attention_decode",
        tile={"BLOCK_G": 16, "BLOCK_N": 64, "BLOCK_D": 128, "num_warps": 4, "num_stages": 2},
        params={"HAS_WINDOW": False, "EVEN_D": True, "INPUT_PRECISION": None, "DOT_FP32": False, "KV_QUANT": False},
    ),
    "paged_merge": dict(op="split_kv_merge", tile={"BLOCK_S": 8, "BLOCK_D": 128, "num_warps": 4}, params={}),
    "paged_prefill": dict(
        op="paged_attention_prefill",
        tile={"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_D": 128, "num_warps": 8, "num_stages": 3},
        params={"CAUSAL": True, "HAS_WINDOW": True, "EVEN_D": True, "INPUT_PRECISION": None, "DOT_FP32": False,
                "KV_QUANT": True},
    ),
    "quant_gemv": dict(
        op="linear_w4",
        tile={"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1},
        params={"BITS": 4, "GROUP": 128, "HAS_ZEROS": True, "HAS_BIAS": False, "ZERO_IS_MIN": True,
                "GROUP_SCALES8": False, "EVEN_K": True, "SPLIT_K": 2},
    ),
    "quant_gemm": dict(
        op="linear_w8",
        tile={"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
        params={"BITS": 8, "GROUP": 32, "HAS_ZEROS": False, "HAS_BIAS": True, "INPUT_PRECISION": None,
                "DOT_FP32": False, "ZERO_IS_MIN": False, "GROUP_SCALES8": True, "EVEN_K": False, "SPLIT_K": 1},
    ),
    "quant_reduce": dict(
        op="linear_w4", tile={"BLOCK_N": 256, "num_warps": 4}, params={"SPLIT_K": 3, "HAS_BIAS": True}
    ),
    "spec_verify": dict(op="spec_verify", tile={"BLOCK_V": 4096, "num_warps": 8}, params={"HAS_DRAFT_PROBS": True}),
}


def test_every_template_has_a_render_case():
    assert sorted(RENDER_CASES) == template_names()


@pytest.mark.parametrize("family", sorted(RENDER_CASES))
def test_every_template_renders_to_a_jit_kernel_with_the_wrappers_constexprs(family, tmp_path):
    case = RENDER_CASES[family]
    ast.parse(render(family, name=f"{family}_kernel", **case))
    fn = KernelCache(tmp_path).load(family, f"{family}_kernel", **case)
    assert callable(getattr(fn, "__getitem__", None)), "a triton kernel is launched as kernel[grid](...)"
    params = inspect.signature(fn.fn).parameters  # the jitted (or interpreted) function's own signature
    constexprs = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
    launch_options = {"num_warps", "num_stages"}
    wanted = {k for k in case["tile"] if k not in launch_options} | set(case["params"])
    assert constexprs == wanted, f"{family}: kernel constexprs {sorted(constexprs)}, wrapper passes {sorted(wanted)}"


def test_header_names_family_op_tile_and_params():
    source = render("norm.py.j2", name="k", op="layer_norm", tile={"BLOCK_D": 64}, params={"IS_RMS": False})
    head = source.splitlines()[:6]
    assert "# family: norm" in head
    assert "# op: layer_norm" in head
    assert "# tile: BLOCK_D=64" in head
    assert "# params: IS_RMS=False" in head


def test_undefined_variable_is_a_codegen_error():
    with pytest.raises(CodegenError, match="'name' is undefined"):
        render("norm")


def test_unknown_template_is_a_codegen_error():
    with pytest.raises(CodegenError, match="no kernel template 'matmul'"):
        render("matmul", name="k")


def _counting_render(monkeypatch):
    calls = []

    def counted(template, **params):
        calls.append(template)
        return render_mod.render(template, **params)

    monkeypatch.setattr("kiln.codegen.cache.render", counted)
    return calls


def test_second_load_is_a_hit_that_neither_renders_nor_imports(tmp_path, monkeypatch):
    from kiln.codegen.cache import KernelCache

    renders = _counting_render(monkeypatch)
    cache = KernelCache(tmp_path)
    params = RENDER_CASES["act"]
    first = cache.load("act", "act_kernel", **params)
    second = cache.load("act", "act_kernel", **params)
    assert first is second
    assert len(renders) == 1
    assert (cache.stats.hits, cache.stats.misses, cache.stats.imports, cache.stats.disk_writes) == (1, 1, 1, 1)
    cache.load("act", "act_kernel", **{**params, "params": {"ACT": "gelu", "GATED": True}})
    assert len(renders) == 2 and cache.stats.imports == 2

    # A later process (a new cache object) finds the file: no render, no write; a hit.
    again = KernelCache(tmp_path)
    again.load("act", "act_kernel", **params)
    assert len(renders) == 2
    assert (again.stats.hits, again.stats.misses, again.stats.disk_writes) == (1, 0, 0)


def test_cache_files_are_valid_python_and_kernels(tmp_path):
    from kiln.codegen.cache import KernelCache

    cache = KernelCache(tmp_path)
    for family, params in RENDER_CASES.items():
        fn = cache.load(family, f"{family}_kernel", **params)
        # A triton JITFunction (or the interpreter's stand-in); both wrap the plain function as .fn.
        assert fn.fn.__module__.startswith(f"kiln_kernel_{family}_")
    files = sorted(tmp_path.glob("*.py"))
    assert len(files) == len(RENDER_CASES)
    for f in files:
        compile(f.read_text(), str(f), "exec")
    assert not list(tmp_path.glob("*.tmp")), "atomic writes leave no temp files behind"


def test_key_depends_on_request_template_and_triton_version(tmp_path, monkeypatch):
    import kiln.codegen.cache as cache_mod

    params = RENDER_CASES["act"]
    key = cache_mod.kernel_key("act", "act_kernel", params, "3.6.0")
    assert key == cache_mod.kernel_key("act.py.j2", "act_kernel", dict(params), "3.6.0")
    assert key != cache_mod.kernel_key("act", "act_kernel", params, "3.9.0")
    assert key != cache_mod.kernel_key("act", "other_kernel", params, "3.6.0")
    assert key != cache_mod.kernel_key("act", "act_kernel", {**params, "params": {"ACT": "relu"}}, "3.6.0")
    # Editing the template text changes the key too.
    edited = tmp_path / "act.py.j2"
    edited.write_text((render_mod.TEMPLATE_DIR / "act.py.j2").read_text() + "\n# edited\n")
    monkeypatch.setattr(render_mod, "TEMPLATE_DIR", tmp_path)
    assert key != cache_mod.kernel_key("act", "act_kernel", params, "3.6.0")


def test_key_hashes_the_files_a_template_includes(tmp_path, monkeypatch):
    import shutil

    import kiln.codegen.cache as cache_mod

    flash, norm = RENDER_CASES["flash_attn"], RENDER_CASES["norm"]
    before = (cache_mod.kernel_key("flash_attn", "k", flash, "3.6.0"), cache_mod.kernel_key("norm", "k", norm, "3.6.0"))
    for f in render_mod.TEMPLATE_DIR.glob("*.j2"):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "_attention.py.j2").write_text((tmp_path / "_attention.py.j2").read_text() + "\n# edited\n")
    monkeypatch.setattr(render_mod, "TEMPLATE_DIR", tmp_path)
    after = (cache_mod.kernel_key("flash_attn", "k", flash, "3.6.0"), cache_mod.kernel_key("norm", "k", norm, "3.6.0"))
    assert after[0] != before[0], "flash_attn includes _attention.py.j2: editing it must change the key"
    assert after[1] == before[1], "norm includes nothing"


def test_default_cache_honours_kiln_cache_dir_and_counts(tmp_path, monkeypatch):
    import kiln.codegen.cache as cache_mod

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cache_mod, "_default", None)  # a fresh default cache for this test only
    fn = cache_mod.load_kernel("rope", "rope_kernel", **RENDER_CASES["rope"])
    assert cache_mod.load_kernel("rope", "rope_kernel", **RENDER_CASES["rope"]) is fn
    stats = cache_mod.cache_stats()
    assert (stats.hits, stats.misses, stats.renders) == (1, 1, 1)
    assert len(list(tmp_path.glob("rope_*.py"))) == 1
