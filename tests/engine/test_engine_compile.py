"""Steady state never compiles: once a workload's shapes have been seen, more of the same work (new prompts, same
lengths and parameters, prefix-cache hits included) reuses the compiled step, snapshot and sampler programs.

Counts the entries of the jitted functions' compile caches.
"""

import numpy as np

from qwen_jax import LLM, SamplingParams
from qwen_jax.engine import step


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
    warm = kit.compile_counts(llm)
    outs = llm.generate(*workload(kit, seed=600))
    assert kit.compile_counts(llm) == warm
    assert [len(o.token_ids) for o in outs] == [8, 5, 10, 3, 6, 8]
    assert outs[5].num_cached_tokens == 32 and outs[0].token_ids == outs[5].token_ids
    kit.assert_idle(llm)


def test_token_buckets_cover_every_plan():
    """Whatever a step holds (up to max_num_seqs requests, any mix of decode rows and prefill chunks within the token
    budget), its tokens fit a bucket and its requests fit that bucket's request count: a full warm-up, which
    compiles one forward per bucket, compiles every forward serving can run."""
    rng = np.random.default_rng(0)
    for max_num_seqs, budget in [(64, 2048), (48, 3000), (4, 64), (1, 2048), (256, 2048)]:
        buckets = step.token_buckets(budget, max_num_seqs)
        assert buckets[-1] == budget and buckets == sorted(set(buckets))
        for _ in range(300):
            requests = int(rng.integers(1, max_num_seqs + 1))
            tokens = int(rng.integers(requests, max(requests, budget) + 1)) if requests <= budget else None
            if tokens is None:
                continue
            size = step.bucket_for(tokens, buckets)
            assert size >= tokens and step.request_bucket(size, max_num_seqs) >= requests
            assert size < 2 * tokens or size <= 1 or size == buckets[0]  # never more than twice the tokens


def test_full_warmup_leaves_nothing_to_compile(llama_dir, kit):
    """After warmup(full=True) a mixed workload (prefill chunks of several lengths next to decode rows, batch sizes
    1 to max_num_seqs) compiles no forward and no input-staging program: serving never stalls on a compile."""
    llm = LLM(llama_dir, kernels="gpu", **kit.ENGINE_ARGS)
    llm.engine.warmup(full=True)
    buckets = llm.engine.replicas[0].runner.token_buckets
    warm = kit.compile_counts(llm)
    prompts = [kit.prompt(n, seed=700 + n, vocab=kit.LLAMA_VOCAB) for n in (3, 40, 17, 60, 9, 33)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)] * len(prompts))
    assert [len(o.token_ids) for o in outs] == [4] * len(prompts)
    after = kit.compile_counts(llm)
    assert (after["forward"], after["stage"]) == (warm["forward"], warm["stage"]) == (len(buckets), len(buckets))


def test_background_buckets_serve_only_after_their_first_run(llama_dir, kit):
    """A server's warm-up compiles most buckets in the background. A program's first run costs the host far more
    than later ones (on a GPU: loading it, recording its graphs), so a bucket serves steps only once it has run on
    padding, which the engine does while idle (run_compiled); until then steps take buckets that have run. Outputs
    are those of a fully warmed engine."""
    prompts = [kit.prompt(n, seed=800 + n, vocab=kit.LLAMA_VOCAB) for n in (5, 40, 17, 60)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    reference = [o.token_ids for o in LLM(llama_dir, **kit.ENGINE_ARGS).generate(prompts, params)]

    llm = LLM(llama_dir, **kit.ENGINE_ARGS)
    core, runner = llm.engine, llm.engine.replicas[0].runner
    core.warmup(full=True, background=True)
    runner._compiling.join()
    has_run = list(runner._ready)
    waiting = list(runner._to_run)
    assert waiting and set(waiting).isdisjoint(has_run)
    used, ran = [], []
    forward, run_padding = runner._forward, runner.run_padding
    runner._forward = lambda layout: (used.append(step.layout_shape(layout, "tokens")[0]), forward(layout))[1]
    runner.run_padding = lambda size: (ran.append(size), run_padding(size))[1]

    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    assert used and set(used) <= set(has_run)  # nothing waiting for its first run served a step
    while core.run_compiled():
        pass
    assert sorted(ran) == sorted(waiting) and runner._ready is None and not runner._to_run
    used.clear()
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    assert set(used) - set(has_run)  # now the best-fitting buckets serve
    kit.assert_idle(llm)
