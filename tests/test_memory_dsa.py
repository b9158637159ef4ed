"""The memory accounting's term for the DSA kernels' backward (agentrl/config/memory.py)."""
from __future__ import annotations

from agentrl.config import memory
from agentrl.config.model_shapes import shapes_of


def _act(dense_dsa: bool, tokens: int, tp: int = 1):
    s = shapes_of("GLM-5.2_5layer")
    return s, memory.activation_bytes(s, range(0, 5), tokens=tokens, tp=tp, in_flight=1, chunk=4096, last=True,
                                      index_topk=2048, dense_dsa=dense_dsa)


def test_the_kernels_backward_is_counted_only_when_the_kernels_run_and_its_scratch_is_capped():
    s, dense = _act(True, 4096)
    assert dense["dsa_kernel_backward"] == 0.0 and dense["dense_dsa_scores"] > 0
    s, small = _act(False, 1024)
    assert small["dense_dsa_scores"] == 0.0
    # 1024 tokens: dS + P of 64 heads x 1024 x 1024 bf16 (top-k capped at the tokens), dkv fp32 + bf16
    assert small["dsa_kernel_backward"] == s.heads * 1024 * 1024 * 4 + 1024 * (s.kv_lora + s.qk_rope) * 6
    s, big = _act(False, 65536)
    assert big["dsa_kernel_backward"] == memory.DSA_BWD_SCRATCH_BYTES + 65536 * (s.kv_lora + s.qk_rope) * 6


def test_the_cap_is_the_kernels_own():
    from kernels.sparse_mla_bwd_split import SCRATCH_BYTES

    assert memory.DSA_BWD_SCRATCH_BYTES == SCRATCH_BYTES
