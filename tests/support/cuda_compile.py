"""Compile generated kernels for a CUDA target on a machine without a GPU (triton ships ptxas), so a kernel that
would fail to compile, or overflow shared memory, on an H100 / A100 is found before any GPU time is spent.

Run as a script (triton must be imported without TRITON_INTERPRET): reads a JSON list of requests on stdin,
each {"template", "name", "op", "consts", "options", "dtypes", "arch", "divisible", "none", "ones"}: an argument
named in "dtypes" gets that type, other pointers dtypes["*"], the integers named in "divisible" are multiples of 16,
those in "none" are launched as None (unused descriptors) and those in "ones" as 1 (both constexprs to triton).
Compiles each for that arch and prints one JSON object per request: {"shared": bytes, "cp_async": async copies
in the PTX, "tma": bulk tensor copies, "mma": wgmma / mma instructions, "error": message or null}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _signature(arg_names: list[str], consts: dict, dtypes: dict[str, str]) -> dict[str, str]:
    sig = {}
    for name in arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in dtypes:  # pointers of another dtype, tensor descriptors ("tensordesc<bf16[64,128]>")
            sig[name] = dtypes[name]
        elif name.endswith("_ptr"):
            sig[name] = dtypes.get(name, dtypes["*"])
        elif name == "scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_one(req: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kiln.codegen._host import _request
    from kiln.codegen.cache import load_kernel

    consts, options = req["consts"], req["options"]
    fn = load_kernel(req["template"], req["name"], op=req["op"], **_request(consts, options))
    # Arguments launched as None (unused descriptors) are constexprs to triton, and so are integers equal to 1.
    consts = {**consts, **{name: None for name in req.get("none", ())}, **{name: 1 for name in req.get("ones", ())}}
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in consts]
    if missing:  # typed i32 below it would compile as a runtime value: a different kernel from a real launch's
        return {"error": f"the request lacks constexpr(s) {missing} of {req['template']}"}
    sig = _signature(list(fn.arg_names), consts, req["dtypes"])
    # Pointers and row strides 16-byte aligned / divisible by 16, as torch allocations and real shapes give.
    aligned = [i for i, n in enumerate(fn.arg_names) if n.endswith("_ptr") or n in req.get("divisible", ())]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    try:
        k = triton.compile(ASTSource(fn, sig, consts, attrs=attrs), target=GPUTarget("cuda", req["arch"], 32),
                           options=options)  # fmt: skip
    except Exception as e:  # reported to the test, which names the kernel
        return {"error": f"{type(e).__name__}: {e}"[:2000]}
    ptx = k.asm["ptx"]
    return {"shared": k.metadata.shared, "cp_async": ptx.count("cp.async.c"), "error": None,
            "tma": ptx.count("cp.async.bulk.tensor"),
            "mma": ptx.count("wgmma.mma_async") + ptx.count("mma.sync")}  # fmt: skip


def ptxas_available() -> bool:
    """Whether triton's CUDA backend, with its ptxas, is installed (it is in the CPU wheels too)."""
    try:
        import triton.backends.nvidia as nv
    except ImportError:
        return False
    return (Path(nv.__file__).parent / "bin" / "ptxas").exists()


def compile_in_subprocess(requests: list[dict]) -> list[dict]:
    """Compile each request in a fresh python without TRITON_INTERPRET (the tests run under it); asserts that
    every request compiled and returns the results in order."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "tests.support.cuda_compile"], input=json.dumps(requests), env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(requests), r.stderr[-3000:]
    for req, res in zip(requests, results, strict=True):
        assert res["error"] is None, f"{req['template']} {req['consts']} for sm{req['arch']}: {res['error']}"
    return results


def main() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    for req in json.load(sys.stdin):
        print(json.dumps(compile_one(req)), flush=True)


if __name__ == "__main__":
    main()

