"""kiln's user-facing errors.

Every error a user can cause is one of these, with a message that names the thing and the fix. The CLI
prints them without a traceback and exits 2. Bare asserts are for internal invariants only.
"""

from __future__ import annotations

from dataclasses import dataclass


class KilnError(Exception):
    """Base of every error a user can cause."""


@dataclass(frozen=True)
class Diagnostic:
    """One problem in a spec file, with its position (1-based line and column)."""

    path: str
    line: int
    column: int
    message: str
    hint: str = ""
    source_line: str = ""

    def render(self) -> str:
        head = f"{self.path}:{self.line}:{self.column}: error: {self.message}"
        parts = [head]
        if self.source_line:
            # A control character (NUL, ...) would vanish or garble the terminal; one `?` keeps the caret aligned.
            shown = "".join(c if c.isprintable() or c == "\t" else "?" for c in self.source_line)
            parts.append(f"    {shown}")
            parts.append("    " + " " * max(self.column - 1, 0) + "^")
        if self.hint:
            parts.append(f"  hint: {self.hint}")
        return "\n".join(parts)


class SpecError(KilnError):
    """One or more problems in a spec file. `diagnostics` holds all of them, in source order."""

    def __init__(self, diagnostics: list[Diagnostic]):
        self.diagnostics = sorted(diagnostics, key=lambda d: (d.line, d.column))
        super().__init__("\n".join(d.render() for d in self.diagnostics))


class WeightError(KilnError):
    """A checkpoint that does not match the spec: missing, unexpected or wrongly shaped tensors."""


class PassError(KilnError):
    """A compiler pass failed or the pass pipeline is ill-formed."""


class CodegenError(KilnError):
    """A kernel could not be rendered or compiled for the requested parameters."""


class RequestError(KilnError):
    """A generation request with a bad parameter; names the parameter and the allowed range. param: the request
    field at fault where there is one (the server's 400 names it), code: a machine-readable reason (e.g.
    "context_length_exceeded", OpenAI's code for a prompt too long for the context)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class UsageError(KilnError):
    """A bad flag value or path (an output that cannot be written, an input that cannot be read): names the
    flag or path and the fix."""


class InternalError(RuntimeError):
    """A failure inside kiln that no input should cause: a bug. Deliberately not a KilnError, so it keeps its
    traceback (the CLI prints it and asks for a report) instead of passing for a user's mistake."""

    def __init__(self, message: str):
        super().__init__(f"{message}\nthis is a bug in kiln; please report it with the command and spec that caused it")
