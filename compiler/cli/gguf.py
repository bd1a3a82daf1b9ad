"""CLI glue for GGUF files: `kiln import FILE.gguf` and `kiln run --chat` (the tokenizer's chat template)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.gguf.config import config_from_gguf, open_gguf
from kiln.hf.to_spec import config_to_spec
from kiln.spec.formatter import format_spec


def cmd_import_gguf(args: argparse.Namespace) -> int:
    """Write the spec of a GGUF model (its metadata only is read; no tensor is dequantized)."""

    src = Path(args.hf_dir)
    cfg = config_from_gguf(open_gguf(src), src, name=args.name or "")
    text = f"# imported by `kiln import` from {src.name}; run it with --weights {src}\n" + format_spec(
        config_to_spec(cfg))
    if args.output:
        Path(args.output).write_text(text)
        print(f"kiln: wrote {args.output} ({cfg.name}, {cfg.layers} layers)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
