"""The spec language: grammar, parser, typed AST, validation (every error with file:line:col), formatter, loader."""
