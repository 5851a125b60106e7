"""The engine with kernels="gpu" (the Pallas kernels: GDN decode and chunked prefill, paged attention for decode and
prefill, MoE GEMM, the one-row projections; interpreted on the CPU) generates the same greedy tokens as with the
jnp reference, on the built-in hybrid model in float32.
"""

import numpy as np
import pytest

import pallas_kernels.gdn
import pallas_kernels.paged_attention
import pallas_kernels.skinny_matmul
import qwen_jax.layers.hot_ops
from qwen_jax.llm import LLM
from qwen_jax.sampling_params import SamplingParams

PROMPTS = [list(range(5, 65)), [3, 4], [7]]  # 60 tokens: a 48-token first prefill step, then 12 (state carried over)


@pytest.fixture(scope="module")
def outputs():
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    result, attention_seq, prefill_seq, skinny_rows = {}, [], [], []
    kernel = pallas_kernels.paged_attention.paged_attention
    spy = lambda q, *args, **kwargs: attention_seq.append(q.shape[0]) or kernel(q, *args, **kwargs)
    prefill = pallas_kernels.gdn.prefill
    prefill_spy = lambda q, *args, **kwargs: prefill_seq.append(q.shape[0]) or prefill(q, *args, **kwargs)
    skinny = pallas_kernels.skinny_matmul.matmul_many  # every launch of the one-row kernel (matmul calls it)
    skinny_spy = lambda x, ws, **kwargs: skinny_rows.append((x.shape[0], len(ws))) or skinny(x, ws, **kwargs)
    for kernels in ("reference", "gpu"):
        llm = LLM(None, max_num_seqs=4, max_model_len=96, kernels=kernels, dtype="float32")
        with pytest.MonkeyPatch.context() as patch:  # records each trace of the kernels (the step's token count)
            patch.setattr(pallas_kernels.paged_attention, "paged_attention", spy)
            patch.setattr(pallas_kernels.gdn, "prefill", prefill_spy)
            patch.setattr(pallas_kernels.skinny_matmul, "matmul_many", skinny_spy)
            patch.setattr(qwen_jax.layers.hot_ops, "MIN_K", 16)  # the built-in model's K is 64, not 512+
            result[kernels] = llm.generate(PROMPTS, params)
            # alone, a sequence decodes one row a step: the one-row projection kernel's case
            result[kernels, "alone"] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0))
    result["attention_seq"], result["prefill_seq"], result["skinny_rows"] = attention_seq, prefill_seq, skinny_rows
    return result


def test_gpu_kernels_give_the_reference_greedy_tokens(outputs):
    for ref, fast in zip(outputs["reference"], outputs["gpu"]):
        assert fast.token_ids == ref.token_ids
        assert len(fast.token_ids) == 8


def test_gpu_kernels_run_the_paged_attention_kernel_for_prefill_and_decode(outputs):
    """Traced for one-token steps (decode alone) and for steps of many tokens (prefill chunks beside decode rows)."""
    assert 1 in outputs["attention_seq"] and max(outputs["attention_seq"]) > 1


def test_gpu_kernels_run_the_gdn_prefill_kernel_for_prompts(outputs):
    """Prompts prefill through the chunked kernel, in steps of more than one chunk (32 tokens:
    gdn_prefill.default_tiles)."""
    assert outputs["prefill_seq"] and max(outputs["prefill_seq"]) > 32


def test_gpu_kernels_give_close_logprobs(outputs):
    for ref, fast in zip(outputs["reference"], outputs["gpu"]):
        a = np.array([t.logprob for t in ref.logprobs])
        b = np.array([t.logprob for t in fast.logprobs])
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


def test_one_sequence_decodes_through_the_one_row_projection_kernel(outputs):
    """Alone, a sequence decodes one row a step: its projections run the skinny matmul kernel, same tokens; a
    layer's projections of the same x share a launch (attention q/k/v/gate: 4 weights; GDN q/k/v/z with b and a,
    which are 4 columns wide in the built-in model and join as one masked 16-column block each: 6)."""
    rows, weights = zip(*outputs["skinny_rows"])
    assert set(rows) == {1} and max(weights) == 6 and 4 in weights  # traced for one-row decode steps only
    ref, fast = outputs["reference", "alone"][0], outputs["gpu", "alone"][0]
    assert fast.token_ids == ref.token_ids and len(fast.token_ids) == 6


def test_unknown_kernels_name_is_rejected():
    with pytest.raises(ValueError, match="kernels must be"):
        LLM(None, kernels="cuda-magic")
