"""Steady state never compiles: once a workload's shapes have been seen, more of the same work (new prompts, same
lengths and parameters, prefix-cache hits included) reuses the compiled step, snapshot and sampler programs.

Counts the entries of the jitted functions' compile caches.
"""

from types import SimpleNamespace

import numpy as np

from qwen_jax import LLM, SamplingParams
from qwen_jax.engine.runner import step_groups, step_shapes


def workload(kit, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Mixed lengths and sampling parameters; a shared prefix between two prompts; fresh tokens per seed."""
    base = kit.prompt(40, seed=seed)
    prompts = [base, kit.prompt(9, seed=seed + 1), base[:32] + kit.prompt(5, seed=seed + 2),
               kit.prompt(33, seed=seed + 3), kit.prompt(47, seed=seed + 4), base]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, seed=seed, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=1.0, top_k=5, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.5, min_p=0.1, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)]
    return prompts, params


def test_no_recompilation_in_steady_state(engines, kit):
    llm = engines("hybrid")
    llm.generate(*workload(kit, seed=500))
    warm = kit.compile_counts()
    outs = llm.generate(*workload(kit, seed=600))
    assert kit.compile_counts() == warm
    assert [len(o.token_ids) for o in outs] == [8, 5, 10, 3, 6, 8]
    assert outs[5].num_cached_tokens == 32 and outs[0].token_ids == outs[5].token_ids
    kit.assert_idle(llm)


def test_step_shapes_cover_every_plan():
    """Whatever rows a step holds (up to max_num_seqs rows, prefill chunks within the token budget and the model
    length), the padded shapes its programs run are among step_shapes: a full warm-up compiles them all."""
    rng = np.random.default_rng(0)
    for max_num_seqs, budget, max_len in [(64, 2048, 2304), (48, 3000, 512), (4, 64, 64), (1, 2048, 8192)]:
        shapes = set(step_shapes(max_num_seqs, budget, max_len))
        seen = set()
        for _ in range(300):
            num_decode = int(rng.integers(0, max_num_seqs + 1))
            left, prefill = min(budget - num_decode, max_len), []
            while left >= 2 and num_decode + len(prefill) < max_num_seqs and rng.random() < 0.8:
                n = int(rng.integers(2, left + 1)) if rng.random() < 0.5 else int(rng.integers(2, min(left, 40) + 1))
                prefill.append(SimpleNamespace(num_tokens=n))
                left -= n
            decode = [SimpleNamespace(num_tokens=1)] * num_decode
            for rows, seq_len, batch_size in step_groups(decode, prefill, budget):
                assert len(rows) <= batch_size and len(rows) * seq_len <= max(budget, seq_len)
                assert all(r.num_tokens <= seq_len for r in rows)
                seen.add((batch_size, seq_len))
        assert seen <= shapes, sorted(seen - shapes)
        assert len(seen) > len(shapes) // 2  # the plans drawn reach most shapes: the check is not vacuous


def test_full_warmup_leaves_nothing_to_compile(llama_dir, kit):
    """After warmup(full=True) a mixed workload (prefill chunks of several lengths next to decode rows, batch sizes
    1 to max_num_seqs) compiles no step program: serving never stalls on a compile. kernels="gpu" uses full-width
    block tables, so (rows, length) is the whole shape."""
    llm = LLM(llama_dir, kernels="gpu", **kit.ENGINE_ARGS)
    llm.engine.warmup(full=True)
    warm = kit.compile_counts()
    prompts = [kit.prompt(n, seed=700 + n, vocab=kit.LLAMA_VOCAB) for n in (3, 40, 17, 60, 9, 33)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)] * len(prompts))
    assert [len(o.token_ids) for o in outs] == [4] * len(prompts)
    assert kit.compile_counts()["step"] == warm["step"]
