"""The engine detokenizes a request's output after its prompt (Detokenizer's prompt_token_ids), as vLLM does: the
text is decode(prompt + output) less decode(prompt), for the byte-level fallback of the random-weight specs and for
a sentencepiece GGUF, streamed or not. The first tokens are forced with logit_bias."""

from __future__ import annotations

import pytest

from kiln.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    from kiln import LLM

    return LLM("tiny-llama", device="cpu", seed=0, use_kernels=False)


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    from kiln import LLM
    from tests.support.spm_files import write_spm_gguf

    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    write_spm_gguf(path)
    return LLM(weights=str(path), device="cpu", dtype="fp32", use_kernels=False, max_model_len=64)


def _texts(llm, prompt_ids: list[int], params: SamplingParams) -> tuple[str, str]:
    """The whole text, and the deltas of a stream of the same request joined."""
    whole = llm.generate(prompt_token_ids=[prompt_ids], sampling_params=params)[0].outputs[0].text
    deltas = [o.outputs[0].delta_text for o in llm.generate_stream(prompt_token_ids=[prompt_ids],
                                                                   sampling_params=params)]
    assert not any("\ufffd" in d for d in deltas), deltas
    return whole, "".join(deltas)


def test_a_character_the_prompt_begins_comes_out_whole(tiny):
    """The prompt's ids end with the first 2 bytes of 東 (E6 9D B1): the third completes it in the output."""
    prompt = list(b"Tokyo: ") + [0xE6, 0x9D]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logit_bias={0xB1: 100})
    assert _texts(tiny, prompt, params) == ("東", "東")


def test_a_sentencepiece_words_leading_space_is_kept(spm):
    """Prompt "hello the", output "▁yo": " yo", as vLLM streams it (decoded alone, the piece loses its space)."""
    tok = spm.tokenizer
    yo = tok._tok.token_to_id("▁yo")
    prompt = tok.encode("hello the")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logit_bias={yo: 100})
    assert _texts(spm, prompt, params) == (" yo", " yo")
    out = spm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=6,
                                                                                  ignore_eos=True))[0].outputs[0]
    full, head = tok.decode(prompt + out.token_ids), tok.decode(prompt)
    assert full.startswith(head) and out.text == full[len(head) :]
