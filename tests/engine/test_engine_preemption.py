"""Recompute preemption: when the KV pool runs dry the newest sequence gives its memory back and is recomputed
later; no request is lost and greedy outputs are those of an unhurried run.

Four rows of 64 tokens need 16 blocks; the shared engine geometry has 14.
"""

from qwen_jax import SamplingParams


def test_preemption_under_a_small_pool_loses_nothing(engines, kit, monkeypatch):
    llm = engines("hybrid", False)
    scheduler = llm.engine.replicas[0].scheduler
    prompts = [kit.prompt(40, seed=400 + i) for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]

    preempted = []
    original = scheduler._preempt

    def counting(seq):
        preempted.append((seq.request_id, len(seq.output_token_ids)))
        original(seq)

    monkeypatch.setattr(scheduler, "_preempt", counting)
    counted = llm.engine.stats()["num_preemptions_total"]
    outs = llm.generate(prompts, params)
    assert preempted, "the pool was large enough: the test no longer exercises preemption"
    assert llm.engine.stats()["num_preemptions_total"] - counted == len(preempted)  # what /metrics reports
    assert all(o.queue_seconds is not None and o.queue_seconds >= 0 for o in outs)
    assert all(n > 0 for _, n in preempted)  # preempted mid-decode, with generated tokens to recompute
    assert [o.token_ids for o in outs] == alone
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in outs)
    kit.assert_idle(llm)
