"""Property: for any mutation of a valid config.json, `kiln import` either writes a spec that `kiln check`
accepts, or refuses with one KilnError (exit 2, nothing written); never both, never another exception."""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.cli import main
from tests.support.hf_models import FAMILIES, _config

BASES = {fam: _config(fam).to_dict() for fam in FAMILIES}
ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.sampled_from([10**20, -(10**20), 2**63, 1e300, -1e-300, 0.5, 1.0, 4096, math.nan, math.inf, -math.inf]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.lists(st.integers(-2, 5), max_size=3),
    st.sampled_from([["full_attention"], ["sliding_attention"] * 2, ["full_attention", "sliding_attention"], {}]),
    st.dictionaries(st.sampled_from(["rope_type", "type", "factor", "rope_theta", "low_freq_factor"]),
                    st.one_of(st.sampled_from(["linear", "llama3", "default", "yarn"]), st.floats(-2, 1e5)),
                    max_size=4),
)


@st.composite
def mutated_configs(draw) -> dict:
    hf = json.loads(json.dumps(BASES[draw(st.sampled_from(FAMILIES))]))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["delete", "set", "set", "extra", "nested"]))
        key = draw(st.sampled_from(sorted(hf))) if hf else "model_type"
        if op == "delete":
            hf.pop(key, None)
        elif op == "set":
            hf[key] = draw(ODD_VALUES)
        elif op == "extra":
            hf[draw(st.sampled_from(["my_flag", "rope_scaling", "layer_types", "attention_bias", "head_dim",
                                     "quantization_config", "partial_rotary_factor", "sliding_window"]))] = \
                draw(ODD_VALUES)
        elif isinstance(hf.get("rope_parameters"), dict):
            hf["rope_parameters"][draw(st.sampled_from(["rope_theta", "rope_type", "factor"]))] = draw(ODD_VALUES)
    return hf


def run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hf=mutated_configs())
def test_import_writes_a_checkable_spec_or_refuses(hf):
    with tempfile.TemporaryDirectory() as tmp:
        d, out = Path(tmp) / "ckpt", Path(tmp) / "out.kiln"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(hf))
        code, err = run(["import", str(d), "-o", str(out)])
        assert "Traceback" not in err
        if code == 0:
            assert out.is_file()
            check, check_err = run(["check", str(out)])
            assert check == 0, f"kiln import wrote a spec that kiln check rejects:\n{out.read_text()}\n{check_err}"
        else:
            assert code == 2 and "kiln: error:" in err, err
            assert not out.exists(), "a refused import must not write the output file"
