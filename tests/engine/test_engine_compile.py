"""Steady state never compiles: once a workload's shapes have been seen, more of the same work (new prompts, same
lengths and parameters, prefix-cache hits included) reuses the compiled step, snapshot and sampler programs.

Counts the entries of the jitted functions' compile caches.
"""

import math
import re

import jax
import llguidance
import numpy as np
import pytest
from jax._src.dispatch import BACKEND_COMPILE_EVENT

from qwen_jax import LLM, SamplingParams
from qwen_jax.config import load_config
from qwen_jax.engine import buckets, step
from qwen_jax.engine import replica as replica_module
from qwen_jax.engine.replica import VERIFY_WORKING_PER_STATE
from qwen_jax.models.decoder import cache_shapes
from qwen_jax.sampling_params import StructuredOutputsParams


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
        sizes = buckets.token_buckets(budget, max_num_seqs)
        assert sizes[-1] == budget and sizes == sorted(set(sizes))
        for _ in range(300):
            requests = int(rng.integers(1, max_num_seqs + 1))
            tokens = int(rng.integers(requests, max(requests, budget) + 1)) if requests <= budget else None
            if tokens is None:
                continue
            size = buckets.bucket_for(tokens, sizes)
            assert size >= tokens and buckets.request_bucket(size, max_num_seqs) >= requests
            assert size < 2 * tokens or size <= 1 or size == sizes[0]  # never more than twice the tokens


class CompileCounter:
    """Counts XLA compiles (JAX's backend-compile events) while it is on."""

    def __init__(self):
        self.count, self.on = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, name: str, seconds: float, **kwargs) -> None:
        if self.on and name == BACKEND_COMPILE_EVENT:
            self.count += 1


def varied_workload(kit, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of many lengths (prefill chunks, decode rows, batches of 1 to max_num_seqs) under every sampling
    setting: greedy, temperature, a checkpoint's generation_config (top-k 20 with top-p 0.95), top-k, top-p alone,
    min-p, seeds, logprobs and top logprobs, logit_bias, repetition / presence / frequency penalties, min_tokens."""
    lengths = (3, 40, 17, 52, 9, 33, 1, 25, 12, 7)
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, top_k=20, top_p=0.95),
             dict(temperature=0.8, top_k=5, seed=seed), dict(temperature=0.7, top_p=0.9),
             dict(temperature=1.0, logprobs=3), dict(temperature=0.5, min_p=0.1, logprobs=0),
             dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
             dict(temperature=1.0, logit_bias={7: 2.5, 30: -100.0}, frequency_penalty=0.4, seed=seed + 1),
             dict(temperature=0.9, top_k=20, top_p=0.95, min_tokens=4)]
    prompts = [kit.prompt(n, seed=seed + n) for n in lengths]
    params = [SamplingParams(max_tokens=6, ignore_eos=True, **kind) for kind in kinds]
    return prompts, params


@pytest.mark.parametrize("speculative_config", [None, "off"])
def test_after_a_full_warm_up_a_varied_workload_compiles_nothing(hybrid_mtp_dir, kit, speculative_config,
                                                                 monkeypatch):
    """Ready means full speed: once warmup(full=True) has run, serving never compiles and never falls back to a
    program the table lacks, whatever the batch (sizes 1 to max_num_seqs, prefill chunks beside decode rows, several
    decode steps a program, verify steps) and whatever its sampling: every setting runs the several-step and verify
    programs compiled ahead. A greedy logit_bias request alone, which once compiled a verify step while serving,
    runs them too. The warm-up also built the grammar engine's vocabulary, so the first constrained request does not
    build it."""
    vocabularies = []
    build = llguidance.LLTokenizer
    monkeypatch.setattr(llguidance, "LLTokenizer", lambda *a, **k: vocabularies.append(1) or build(*a, **k))
    monkeypatch.setattr(replica_module, "DECODE_STEPS_MAX_ROWS", 2)  # several decode steps a program for 1-2 rows
    counter = CompileCounter()
    prompts_seen = [speculative_config]
    llm = LLM(hybrid_mtp_dir, speculative_config=speculative_config, num_scheduler_steps=4, **kit.ENGINE_ARGS)
    runner = llm.engine.replicas[0].runner
    llm.engine.warmup(full=True)
    assert not runner.programs.missing(runner.shapes.catalog(runner.shapes.token_buckets))
    counter.on = True
    jax.jit(lambda x: x + 1)(np.arange(len(prompts_seen)))  # the counter sees a compile
    assert counter.count == 1
    counter.count = 0
    steps = []
    monkeypatch.setattr(runner, "executor", lambda ops, run=runner.executor: steps.append(ops) or run(ops))
    for seed in (900, 950):
        prompts, params = varied_workload(kit, seed)
        outs = llm.generate(prompts, params)
        assert [len(o.token_ids) for o in outs] == [6] * len(prompts)
        for i, p in enumerate(params):  # one request alone: several decode steps, or verify rounds
            assert len(llm.generate(prompts[i:i + 1], p)[0].token_ids) == 6
        pair = llm.generate(prompts[:2], [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 2)
        assert [len(o.token_ids) for o in pair] == [12, 12]
    biased = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={5: 1.0}, ignore_eos=True)
    assert len(llm.generate(prompts[:1], biased)[0].token_ids) == 10
    assert counter.count == 0 and llm.engine.stats()["program_fallbacks_total"] == 0
    several = {type(op).__name__ for ops in steps for op in ops if isinstance(op, step.DecodeSteps | step.Verify)}
    assert several == ({"Verify", "DecodeSteps"} if speculative_config is None else {"DecodeSteps"})
    multi = [op for ops in steps for op in ops if isinstance(op, step.DecodeSteps | step.Verify)]
    assert {(op.path, op.top) for op in multi} == {(1, 0), (2, 20)}  # both model variants served rows
    if speculative_config is None:
        assert llm.engine.stats()["spec_verified_rows_total"] > 0  # verify steps ran, compiled ahead
    assert vocabularies == [1]
    constrained = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]{1,6}"))
    assert re.fullmatch("[ab]{1,6}", llm.generate([[17, 301, 45]], constrained)[0].text)
    assert vocabularies == [1]
    assert counter.count == 0 and llm.engine.stats()["program_fallbacks_total"] == 0
    kit.assert_idle(llm)


def test_the_memory_plan_refuses_at_start_what_cannot_fit(hybrid_mtp_dir, kit, monkeypatch):
    """A fixed num_speculative_tokens whose one-request verify step keeps more recurrent states than the memory the
    caches leave fails when the engine starts, naming what to lower; so does a warm-up whose programs' working
    memory (as XLA reports it) does not fit there. Never an out-of-memory while serving."""
    per_slot = sum(math.prod(s.shape) * s.dtype.itemsize
                   for s in jax.tree.leaves(cache_shapes(load_config(hybrid_mtp_dir), 0, kit.BLOCK, 1)))
    per_token = VERIFY_WORKING_PER_STATE * per_slot
    for drafts in (2, 1):  # room for the working memory of 2.5 verify tokens
        config = {"method": "mtp", "num_speculative_tokens": drafts}
        kit.fake_memory(monkeypatch, hybrid_mtp_dir, dict(kit.ENGINE_ARGS, speculative_config=config),
                        held_back=2.5 * per_token)
        if drafts == 2:
            with pytest.raises(ValueError, match="lower num_speculative_tokens or --max-num-seqs"):
                LLM(hybrid_mtp_dir, speculative_config=config, **kit.ENGINE_ARGS)
    llm = LLM(hybrid_mtp_dir, speculative_config=config, **kit.ENGINE_ARGS)
    monkeypatch.undo()
    replica = llm.engine.replicas[0]
    assert replica.max_verify_tokens == 2 and replica.held_back == pytest.approx(2.5 * per_token, abs=1)
    replica.held_back = 1024.0  # less than the programs' working memory
    with pytest.raises(ValueError, match=r"the step program (\S+) needs .* working memory.*lower --max-num-batched-"
                                         r"tokens") as refused:
        llm.engine.warmup(full=False)
    working = replica.compiler.working_bytes
    largest = max(working, key=working.__getitem__)
    assert working[largest] > 1024 and str(refused.value).startswith(f"the step program {largest} needs")
    # the device runs out of memory all the same (another process took some): the start ends naming the program
    replica.held_back, runner = None, replica.runner
    run = runner.executor

    def out_of_memory(ops):
        if isinstance(ops[0], step.Forward):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 11.22GiB")
        return run(ops)

    runner.executor = out_of_memory
    with pytest.raises(MemoryError, match=r"the step program forward\[\d+\] ran out of device memory on its first "
                                          r"run at start-up .*: lower --gpu-memory-utilization"):
        llm.engine.warmup(full=False)
