"""The `kiln` command line: the parser (one subcommand per family module) and main(), which keeps the error
contract. The commands live by family: run.py (`kiln run`), spec_files.py (`check`, `fmt`, `import`; no torch),
compile_cmd.py (`compile`), quantize.py (`quantize`), train_router.py (`train-router`), bench.py (`bench
throughput | quality | perplexity`, perplexity's flags from perplexity_parser.py, `bench serve` from serve.py),
serve.py (`serve`); common.py holds what they share. Building the parser loads no torch: `kiln check`, `kiln fmt`
and `kiln --help` stay fast, so a command's torch-loading imports wait until it runs.

The error contract: only KilnError is a user error: one message naming the file, flag or value and the fix, no
traceback, exit 2 (argparse's own flag errors exit 2 too). Any other exception is a bug in kiln: its traceback
is printed with one line saying so, and the exit status is 1. `--debug` (before or after the subcommand) shows
a user error's traceback too, still exiting 2, and re-raises a bug. A closed stdout (`kiln run ... | head -c 1`)
ends the command quietly with 141, as SIGPIPE ends Unix tools. Output files and directories are checked before
any work and written whole or not at all. Generated text goes to stdout, everything else (timings, notes,
progress) to stderr; diagnostics from inside kiln go through the `kiln` logger, which main() routes to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from kiln import __version__
from kiln.cli.bench import add_bench_parser
from kiln.cli.common import EXIT_BROKEN_PIPE, EXIT_BUG, EXIT_USER_ERROR, setup_logging
from kiln.cli.compile_cmd import add_compile_parser
from kiln.cli.quantize import add_quantize_parser
from kiln.cli.run import add_run_parser
from kiln.cli.serve import add_serve_parser
from kiln.cli.spec_files import add_spec_file_parsers
from kiln.cli.train_router import add_train_router_parser
from kiln.cli.unknown_flags import check_unknown_flags
from kiln.errors import KilnError, SpecError

REPORT_BUGS = "the kiln issue tracker"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description="kiln: a declarative compiler for LLM inference")
    p.add_argument("--version", action="version", version=f"kiln {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_run_parser(sub)
    add_spec_file_parsers(sub)  # check, fmt, import
    add_compile_parser(sub)
    add_quantize_parser(sub)
    add_train_router_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    _debug_everywhere(p)
    return p


def _debug_everywhere(parser: argparse.ArgumentParser) -> None:
    """Accept --debug after the subcommand too (`kiln run --debug ...`). SUPPRESS: an absent flag leaves the
    top-level value alone."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                child.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                   help="show tracebacks for errors")
                _debug_everywhere(child)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    check_unknown_flags(parser, argv)
    args = parser.parse_args(argv)
    setup_logging(args.debug)
    # Status lines (kiln.progress.say and the like) are the commands' own output: shown without --debug too.
    logging.getLogger("kiln.status").setLevel(logging.INFO)
    try:
        return args.func(args)
    except BrokenPipeError:
        _drop_stdout()
        return EXIT_BROKEN_PIPE
    except KilnError as e:
        if args.debug:  # the traceback, but still a user error: exit 2, as without --debug
            traceback.print_exc()
        msg = str(e)
        print(msg if isinstance(e, SpecError) else f"kiln: error: {msg}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130
    except Exception:
        if args.debug:
            raise
        traceback.print_exc()
        print(f"kiln: this is a bug in kiln, not a problem with your input; please report it on {REPORT_BUGS} "
              "with the command line, `kiln --version` and the traceback above", file=sys.stderr)
        return EXIT_BUG


def _drop_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush into the closed pipe stays quiet."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (captured in-process)
        pass


if __name__ == "__main__":
    sys.exit(main())
