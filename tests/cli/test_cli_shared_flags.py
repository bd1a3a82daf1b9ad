"""One source for each fact: a flag that several `kiln` subcommands share (--device, --weights, --seed, --quantize,
the engine's flags ...) means the same thing in each, so it has the same type, choices and default everywhere
(defined once, in kiln.cli.common). The real parser is walked, so a command that copies a flag and lets it drift
fails here. The few differences that are meant are listed in EXCEPTIONS."""

from __future__ import annotations

import argparse

import pytest

from kiln.cli.commands import build_parser

# flag -> the subcommands that have it (at least these: a flag that silently left a command would make the
# comparison below vacuous)
SHARED = {
    "--device": {"run", "quantize", "train-router", "serve", "bench throughput", "bench quality",
                 "bench perplexity"},
    "--weights": {"run", "compile", "quantize", "train-router", "serve", "bench throughput", "bench quality",
                  "bench perplexity"},
    "--seed": {"run", "train-router", "serve", "bench throughput", "bench serve"},
    "--quantize": {"run", "compile", "quantize", "serve", "bench throughput"},
    "--max-num-seqs": {"serve", "bench throughput"},
    "--max-num-batched-tokens": {"serve", "bench throughput"},
    "--dtype": {"run", "compile", "quantize", "serve", "bench throughput", "bench quality"},
    "--routers": {"run", "serve", "bench throughput"},
    "--generation-config": {"run", "serve"},
    "--chat-template": {"run", "serve"},
    "--num-blocks": {"run", "serve", "bench throughput"},
    "--block-size": {"run", "serve", "bench throughput"},
    "--kv-cache-dtype": {"run", "serve", "bench throughput"},
    "--gpu-memory-utilization": {"run", "serve", "bench throughput"},
    "--speculation": {"run", "serve", "bench throughput"},
    "--overlap-outputs": {"run", "serve", "bench throughput"},
    "--async-scheduling": {"run", "serve", "bench throughput"},
    "--enable-prefix-caching": {"run", "serve", "bench throughput"},
}

# (flag, subcommand) -> the attributes that differ on purpose, and their values there
EXCEPTIONS = {
    # training runs where it is told: cpu unless --device cuda (and a GGUF is dequantized off CUDA)
    ("--device", "train-router"): {"default": "cpu"},
    # not given: unseeded sampling (random weights still take seed 0)
    ("--seed", "run"): {"default": None},
}

ATTRS = ("type", "choices", "default", "required", "nargs", "const", "action")


def _subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                path = f"{prefix} {name}".strip()
                out[path] = child
                out |= _subcommands(child, path)
    return out


def _attrs(action: argparse.Action) -> dict:
    got = {a: getattr(action, a) for a in ATTRS if a != "action"}
    got["action"] = type(action)
    return got


@pytest.fixture(scope="module")
def subcommands() -> dict[str, argparse.ArgumentParser]:
    return _subcommands(build_parser())


def _holders(subcommands, flag: str) -> dict[str, argparse.Action]:
    return {name: p._option_string_actions[flag] for name, p in subcommands.items()
            if flag in p._option_string_actions}


@pytest.mark.parametrize("flag", sorted(SHARED))
def test_a_shared_flag_is_the_same_in_every_subcommand(subcommands, flag):
    holders = _holders(subcommands, flag)
    assert SHARED[flag] <= holders.keys(), f"{flag} is missing from {sorted(SHARED[flag] - holders.keys())}"
    seen = {}
    for name, action in sorted(holders.items()):
        got = _attrs(action)
        expected_diff = EXCEPTIONS.get((flag, name), {})
        for attr, value in expected_diff.items():
            assert got[attr] == value, f"`kiln {name} {flag}`: {attr} {got[attr]!r}, expected {value!r}"
            del got[attr]
        for attr, value in got.items():
            if attr in seen:
                first, first_value = seen[attr]
                assert value == first_value, (f"`kiln {name} {flag}` has {attr} {value!r}, but `kiln {first} "
                                              f"{flag}` has {first_value!r}: define the flag once (kiln.cli.common)")
            else:
                seen[attr] = (name, value)


def test_every_exception_is_still_needed(subcommands):
    """An exception that no longer differs (or names a flag the command lost) is stale: drop it."""
    for (flag, name), diff in EXCEPTIONS.items():
        holders = _holders(subcommands, flag)
        assert name in holders, f"`kiln {name}` has no {flag} any more"
        others = [_attrs(a) for n, a in holders.items() if (flag, n) not in EXCEPTIONS]
        assert others, flag
        for attr, value in diff.items():
            assert others[0][attr] != value, f"`kiln {name} {flag}`'s {attr} is no exception any more"


def test_seed_takes_the_sampling_seed_range_everywhere(subcommands):
    """A plain int --seed would take -1 or 2**64 and fail later, deep in torch; seed_arg refuses them up front."""
    for name in _holders(subcommands, "--seed"):
        p = subcommands[name]
        action = p._option_string_actions["--seed"]
        for bad in ("-1", str(2**64)):
            with pytest.raises(argparse.ArgumentTypeError):
                action.type(bad)
        assert action.type("7") == 7, name
