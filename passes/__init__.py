"""kiln compiler passes: one pass per file.

Each module here that defines `PASS` (a kiln.compile.pipeline.Pass) is a pass; its docstring says what it matches,
what it emits and what it requires. kiln.compile.pipeline.DEFAULT_PIPELINE lists the ones that run by default:
gqa_fusion, rope_fusion, norm_fusion, flash_tiling. Modules starting with `_` are shared helpers.
"""
