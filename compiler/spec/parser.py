"""Spec text -> SpecFile AST (spec_ast.py) with lark's LALR parser; every node keeps its source span, and
the `# ...` comments are collected into SpecFile.comments for the formatter.

Syntax errors become a SpecError whose one Diagnostic says, in plain words, what was found and what was
expected there (never lark's token names), with a hint. A leading UTF-8 byte order mark is skipped; an invisible
or non-ASCII character is named by its code point. Expressions nested deeper than MAX_NESTING are refused with
a position before anything recursive (the tree transformer in kiln.spec.tree_to_ast, validation, the formatter)
walks them, so no input reaches Python's recursion limit.
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from contextvars import ContextVar
from copy import copy
from functools import lru_cache
from importlib.resources import files

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken, VisitError

from kiln.errors import Diagnostic, SpecError
from kiln.spec.ast import Comment, Expr, SpecFile
from kiln.spec.tree_to_ast import CallError, ToAst

# Regex terminals in plain words; string terminals are shown as themselves in backticks.
_WORDS = {"NAME": "a name", "INT": "a number", "FLOAT": "a number", "STRING": "a string", "$END": "end of file"}
_VALUE_STARTS = {"INT", "FLOAT", "STRING", "TRUE", "FALSE", "NAME", "MINUS", "LPAR"}
_GENERIC_HINT = ("settings are `key = value`, separated by spaces or newlines; values are numbers, strings, "
                 "true/false, names, calls like f(x, key = value), and `+`")


MAX_NESTING = 100  # calls and operators inside one another; real specs need fewer than 10
_BOM = "\ufeff"

# The comments of the parse in progress: the cached Lark's lexer callback is fixed, so it reports here.
_comment_sink: ContextVar[list[Comment] | None] = ContextVar("kiln_spec_comments", default=None)


def _on_comment(tok: Token) -> Token:
    sink = _comment_sink.get()
    if sink is not None:
        sink.append(Comment(tok.line, tok.column, str(tok).rstrip()))  # rstrip: trailing blanks and a CRLF's \r
    return tok


@lru_cache(maxsize=2)
def _lark(start: str = "start") -> Lark:
    """The parser of a whole file (`start`), or of one value (`value`: a flag or API argument in the spec syntax).
    Two instances rather than two start symbols in one: a shared LALR table would merge states and change what
    a file's syntax errors say was expected."""
    grammar = files("kiln.spec").joinpath("grammar.lark").read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=False,
                lexer_callbacks={"COMMENT": _on_comment}, start=start)


def _too_deep(tree: Tree) -> Tree | None:
    """The first node nested deeper than MAX_NESTING expression levels, found without recursion."""
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            return node
        for child in node.children:
            if isinstance(child, Tree):
                stack.append((child, depth + (child.data in ("binop", "call"))))
    return None


def parse_spec(text: str, path: str = "<spec>") -> SpecFile:
    """Parse spec source text into a SpecFile; raises SpecError (one Diagnostic) on a syntax error."""
    text = text.removeprefix(_BOM)  # editors on Windows write one; it is no content
    comments: list[Comment] = []
    token = _comment_sink.set(comments)
    try:
        model, compile_block = _parse(text, path, "start")
    finally:
        _comment_sink.reset(token)
    return SpecFile(model=model, compile=compile_block, path=path, source=text, comments=tuple(comments))


_VALUE_HINT = ("write one value in the spec syntax: a name, a number, a \"string\" or a call like "
               "f(key = value, key = \"text\")")


def parse_expr(text: str, path: str = "<value>") -> Expr:
    """Parse one value in the spec syntax (e.g. a flag's `ngram(n = 3, k = 4)`); errors point into `text`, with
    `path` (the flag's name) where a file name would be."""
    try:
        return _parse(text.removeprefix(_BOM), path, "value")
    except SpecError as e:  # a file's wording ("end of file", hints about settings) -> a value's
        d = e.diagnostics[0]
        keep = d.hint if d.hint.startswith(("strings", "a string", "remove it")) else _VALUE_HINT
        raise SpecError([dataclasses.replace(d, message=d.message.replace("end of file", "end of text"),
                                             hint=keep)]) from None


def _parse(text: str, path: str, start: str):
    try:
        tree: Tree = _lark(start).parse(text)
    except UnexpectedInput as e:
        raise SpecError([_syntax_diagnostic(e, text, path)]) from None
    deep = _too_deep(tree)
    if deep is not None:
        line, col = deep.meta.line, deep.meta.column
        raise SpecError([Diagnostic(path, line, col, f"expression nested more than {MAX_NESTING} levels deep",
                                    "split it up: no spec needs this many calls or operators inside one another",
                                    source_line(text, line))])
    try:
        return ToAst().transform(tree)
    except VisitError as e:
        err = e.orig_exc
        if not isinstance(err, CallError):
            raise
        line, col = err.span.line, err.span.column
        raise SpecError([Diagnostic(path, line, col, err.message, err.hint, source_line(text, line))]) from None


def source_line(text: str, line: int) -> str:
    lines = text.split("\n")  # lark counts lines by "\n" only; splitlines() would also break at \x0c, \u2028, ...
    return lines[line - 1].rstrip("\r") if 0 < line <= len(lines) else ""


def _describe(names: set[str]) -> str:
    """Expected terminals in plain words, e.g. "`}`, `=` or a name"."""
    terminals = {t.name: t.pattern for t in _lark().terminals}
    words: list[str] = []
    if {"INT", "STRING", "NAME"} <= names:
        words.append("a value")
        names = names - _VALUE_STARTS
    for n in sorted(names):
        pattern = terminals.get(n)
        word = f"`{pattern.value}`" if pattern is not None and pattern.type == "str" else _WORDS.get(n, n.lower())
        if word not in words:
            words.append(word)
    if len(words) <= 1:
        return "".join(words)
    return ", ".join(words[:-1]) + " or " + words[-1]


def _syntax_diagnostic(e: UnexpectedInput, text: str, path: str) -> Diagnostic:
    if isinstance(e, UnexpectedToken):
        tok = e.token
        expected = _describe(set(e.accepts or e.expected))
        if tok.type == "$END":
            line, col = (tok.end_line or 1, tok.end_column or 1) if tok.line else (1, 1)
            found, hint = "end of file", _token_hint(tok, expected)
        else:
            line, col = tok.line, tok.column
            found, hint = f"`{tok}`", _token_hint(tok, expected)
    else:
        assert isinstance(e, UnexpectedCharacters)
        line, col = e.line, e.column
        char = text[e.pos_in_stream] if e.pos_in_stream < len(text) else ""
        expected = _describe(_accepts(e.state) if e.state is not None else set(e.allowed or ()))
        found, hint = _char_name(char), _char_hint(char, text[e.pos_in_stream:e.pos_in_stream + 40])
    message = f"unexpected {found}" + (f", expected {expected}" if expected else "")
    return Diagnostic(path, line, col, message, hint, source_line(text, line))


def _accepts(state) -> set[str]:
    """Terminals the parser would really take here (the lexer's set is wider: LALR merges lookaheads)."""
    conf = copy(state.parse_conf)
    conf.callbacks = {}  # a trial feed must not build tree nodes
    found = set()
    for name in state.parse_conf.states[state.position]:
        if not name.isupper():
            continue
        trial = state.copy(deepcopy_values=False)
        trial.parse_conf = conf
        try:
            trial.feed_token(Token(name, ""), is_end=name == "$END")
        except UnexpectedInput:
            continue
        found.add(name)
    return found


def _token_hint(tok: Token, expected: str) -> str:
    if tok.type == "$END" and "`}`" in expected:
        return "every `{` needs a matching `}`"
    if expected == "`model`":
        return 'a spec starts with `model "name" {`'
    if expected == "a string":
        return 'the model name is a double-quoted string: model "name" {'
    if tok.type == "COMMA":
        return "settings are separated by spaces or newlines, not commas"
    if expected == "`{`":
        return "a block is written `name {` ... `}`"
    if expected == "`=`":
        return "settings and assignments are written `name = value`"
    if tok.type == "EQUAL":
        return "keyword arguments are written `key = value` inside a call's parentheses"
    if tok.type == "LAYER":
        return "`layer` starts the layer block: `layer { ... }`"
    return _GENERIC_HINT


def _char_name(char: str) -> str:
    """`x` for plain ASCII; the code point and Unicode name for anything a reader might not see or tell apart."""
    if char.isascii() and char.isprintable():
        return f"character `{char}`"
    name = unicodedata.name(char, "a control character" if unicodedata.category(char) == "Cc" else "unnamed")
    shown = f"`{char}` " if char.isprintable() and not char.isspace() else ""
    return f"character {shown}U+{ord(char):04X} ({name})"


def _char_hint(char: str, rest: str = "") -> str:
    """A hint for an unexpected character `char`; `rest`: the text from it on (a few dozen characters)."""
    if char and char in "\u201c\u201d\u2018\u2019":
        return 'strings use straight double quotes: "..." (a word processor turned them into curly ones)'
    if not (char.isascii() and char.isprintable()):
        return ("remove it or retype the line: specs are plain ASCII outside strings and comments "
                "(invisible characters often come from copying text out of documents or web pages)")
    if char == "'":
        return "strings use double quotes"
    if char == '"':
        return "a string must end with `\"` on the same line"
    if char and char in ";:":
        return "settings are separated by spaces or newlines; no `;` or `:` is needed"
    if fraction := re.match(r"\.\d+", rest):
        return f"a number starts with a digit: write 0{fraction[0]}, not {fraction[0]}"
    return _GENERIC_HINT
