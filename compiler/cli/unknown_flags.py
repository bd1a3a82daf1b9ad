"""Unknown long flags, named before argparse parses: argparse reports an unrecognized flag only once everything
else parses, so a misspelt required flag (`kiln run --promt hi`) reads as a missing one ("one of the arguments
--prompt --prompt-ids is required"). This names the flag the user typed and the closest flag the command has."""

from __future__ import annotations

import argparse
import difflib


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _long_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


def _takes_value(parser: argparse.ArgumentParser, flag: str) -> bool:
    for action in parser._actions:
        if flag in action.option_strings:
            return action.nargs != 0
    return False


def check_unknown_flags(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Call parser.error (exit 2) on the first `--flag` the (sub)command it follows does not have, with the
    closest known flag when one is near. Values of flags are skipped; `--` ends the flags; argparse's unique-prefix
    abbreviations are left to argparse."""
    current, names, expect_value = parser, ["kiln"], False
    for token in argv:
        if token == "--":
            return
        if expect_value:  # the value of the flag before it (argparse reports a missing one itself)
            expect_value = False
            continue
        subcommands = _subcommands(current)
        if not token.startswith("-"):
            if token in subcommands:
                current, names = subcommands[token], [*names, token]
            continue
        if not token.startswith("--") or " " in token:
            continue  # short flags, negative numbers and, as argparse reads them, values with a space
        flag, has_value = token.split("=", 1)[0], "=" in token
        known = _long_flags(current) + _long_flags(parser)  # --debug / --version sit on the top level too
        if any(k == flag or k.startswith(flag) for k in known):
            expect_value = not has_value and _takes_value(current, flag)
            continue
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
        hint = f"did you mean {close[0]}?" if close else f"see `{' '.join(names)} --help` for its flags"
        current.error(f"unrecognized argument {flag}: {hint}")
