"""A KV pool too small for one sequence of the longest allowed length says how to fix it in the words of the entry
point used: LLM's arguments here (and the Engine's, the same names); the CLI's flags in tests/cli/test_messages_run.py.
Only the setting the pool was sized from is named: with num_blocks given, gpu_memory_utilization changes nothing."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import KilnError
from kiln.runtime.kv_pool import PoolTooSmallError, choose_num_blocks
from tests.support.fake_step import FakeStepModel


def test_num_blocks_too_small_names_llms_arguments():
    with pytest.raises(KilnError) as e:
        choose_num_blocks(FakeStepModel(), 128, block_size=16, num_blocks=8)
    msg = str(e.value)
    assert msg.endswith("= 9 (0.0 MiB); raise num_blocks to at least 9, or lower max_model_len "
                        "(LLM(num_blocks=..., max_model_len=...))"), msg
    assert "--" not in msg and "gpu_memory_utilization" not in msg and "kiln serve" not in msg, msg


class _CudaFake(FakeStepModel):
    device = torch.device("cuda")


def test_a_pool_sized_from_memory_names_gpu_memory_utilization(monkeypatch):
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 10 << 20))  # 1 MiB free of 10
    with pytest.raises(PoolTooSmallError) as e:
        choose_num_blocks(_CudaFake(), 1 << 20, block_size=16, gpu_memory_utilization=0.95)
    msg = str(e.value)
    assert "from gpu_memory_utilization 0.95" in msg and msg.endswith(
        "; raise gpu_memory_utilization (or free GPU memory), or lower max_model_len "
        "(LLM(gpu_memory_utilization=..., max_model_len=...))"), msg
    assert "num_blocks to at least" not in msg
    flags = e.value.advised("--num-blocks", "--gpu-memory-utilization", "lower --max-model-len")
    assert str(flags).endswith("; raise --gpu-memory-utilization (or free GPU memory), or lower --max-model-len")


def test_advised_keeps_the_facts_and_rewords_only_the_fix():
    with pytest.raises(PoolTooSmallError) as e:
        choose_num_blocks(FakeStepModel(), 128, block_size=16, num_blocks=3)
    assert (e.value.need, e.value.usable_tokens, e.value.from_memory) == (9, 32, False)
    facts = str(e.value).split("; ")[0]
    again = e.value.advised("--num-blocks", "--gpu-memory-utilization", None)
    assert str(again) == facts + "; raise --num-blocks to at least 9" and isinstance(again, KilnError)
