"""Comments survive formatting: each goes back next to the construct it was written beside."""

from __future__ import annotations

import re
from importlib.resources import files

import pytest

from kiln.cli.commands import main
from kiln.spec.ast import Comment, ModelBlock, Num, Setting, SpecFile
from kiln.spec.formatter import format_spec
from kiln.spec.loader import bundled_specs
from kiln.spec.parser import parse_spec

MESSY = """\
# leading comment
# a second line of it
model "tiny"{  # after the header
  # before vocab
  vocab=512 dim   =  64   # after dim
  rope = rope(theta = 1e4,
     # inside a multi-line setting
     scaling=linear(factor=2))   # after rope
  # before the layer block

  layer{ # after layer {
    # before h
    h=norm(x)
    x=x+attention(h)  # after x
    # end of the layer block
  }  # after the layer's }
  # before tie_embeddings
  tie_embeddings=false
  # end of the model block
}   # after the model's }
# between the blocks
compile{dtype=bf16 # after dtype
# end of the compile block
}
# end of the file
"""

GOLDEN = """\
# leading comment
# a second line of it
model "tiny" {  # after the header
  # before vocab
  vocab = 512
  dim = 64  # after dim
  # inside a multi-line setting
  rope = rope(theta = 10000.0, scaling = linear(factor = 2))  # after rope

  # before the layer block
  layer {  # after layer {
    # before h
    h = norm(x)
    x = x + attention(h)  # after x
    # end of the layer block
  }  # after the layer's }

  # before tie_embeddings
  tie_embeddings = false
  # end of the model block
}  # after the model's }

# between the blocks
compile {
  dtype = bf16  # after dtype
  # end of the compile block
}
# end of the file
"""


def _comments(text: str) -> list[str]:
    return [c.rstrip() for c in re.findall(r"#[^\n]*", text)]  # no bundled or test spec has `#` in a string


def test_golden_with_comments_everywhere():
    assert format_spec(parse_spec(MESSY)) == GOLDEN
    assert _comments(GOLDEN) == _comments(MESSY)


def test_comments_are_collected_in_order_but_not_compared():
    spec = parse_spec('# top\nmodel "m" {\n  a = "#not a comment"  # real\n}\n')
    assert spec.comments == (Comment(1, 1, "# top"), Comment(3, 25, "# real"))
    assert spec == parse_spec('model "m" { a = "#not a comment" }')


def test_idempotent():
    once = format_spec(parse_spec(MESSY))
    assert format_spec(parse_spec(once)) == once
    assert parse_spec(once) == parse_spec(MESSY)


def test_crlf_and_trailing_blanks_are_dropped_from_comments():
    assert format_spec(parse_spec('# top  \r\nmodel "m" {\r\n  a = 1  # one\t\r\n}\r\n')) == \
        '# top\nmodel "m" {\n  a = 1  # one\n}\n'


def test_ast_built_in_code_formats_as_before():
    spec = SpecFile(ModelBlock("m", (Setting("a", Num(1)),)))
    assert format_spec(spec) == 'model "m" {\n  a = 1\n}\n'


@pytest.mark.parametrize("name", bundled_specs())
def test_bundled_specs_are_canonical_with_their_comments(name):
    source = files("kiln.specs").joinpath(f"{name}.kiln").read_text()
    assert _comments(source)  # every bundled spec opens with a comment
    assert format_spec(parse_spec(source)) == source


def test_fmt_write_keeps_comments(tmp_path, capsys):
    path = tmp_path / "messy.kiln"
    path.write_text(MESSY)
    assert main(["fmt", "--write", str(path)]) == 0
    assert path.read_text() == GOLDEN
    assert main(["fmt", "--check", str(path)]) == 0
    capsys.readouterr()
