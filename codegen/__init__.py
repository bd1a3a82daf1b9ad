"""kiln code generation: Jinja2 templates rendered into Triton kernels.

- templates/*.py.j2: one Triton kernel family each (norm, rope, act, flash_attn), plain tutorial-style
  Triton whose variants are tl.constexpr arguments; Jinja fills only the kernel name and a header.
- render.py: `render(template, **params) -> str` (StrictUndefined; errors are CodegenError).
- cache.py: `load_kernel(template, name, **params)` renders once, writes KILN_CACHE_DIR/<family>_<key>.py
  atomically, imports it, and memoizes per process; `cache_stats()` counts hits, misses, renders, imports.
- norm.py, rope.py, act.py, flash_attn.py, paged.py, quant.py: host wrappers (check, allocate, grid, launch)
  with the signatures of the matching kiln ops; they pass kernel arguments by keyword through _host.launch;
  tiles.py: TileConfig, the default_tile heuristic and the autotuner's candidate lists; autotune.py: timing
  candidates (injectable timer) with the winners cached under KILN_CACHE_DIR/autotune/; paged_tiles.py: the
  split-KV decode's split count and tile, and the paged prefill's tile.

Nothing here imports triton at module import time, so TRITON_INTERPRET=1 can still be set afterwards.
"""
