"""kiln code generation: Jinja2 templates rendered into Triton kernels."""
