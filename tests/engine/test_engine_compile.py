"""Steady state never compiles: once a workload's shapes have been seen, more of the same work (new prompts, same
lengths and parameters, prefix-cache hits included) reuses the compiled step, snapshot and sampler programs.

Counts the entries of the jitted functions' compile caches.
"""

from qwen_jax import SamplingParams


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
