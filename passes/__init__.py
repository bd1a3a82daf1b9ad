"""kiln compiler passes: one pass per file."""
