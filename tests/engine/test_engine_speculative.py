"""Speculative decoding in the engine (speculative_config): greedy and seeded outputs equal those without it, token
for token, over batches, draft counts 1..3, rows that end mid-draft (EOS, stop token ids, stop strings, max_tokens),
preemption and prefix-cache hits; the recurrent states after partly rejected drafts are those of plain decoding (the
outputs after them would differ otherwise)."""

import math
import re

import jax
import numpy as np
import pytest

from qwen_jax import LLM, SamplingParams
from qwen_jax.config import load_config
from qwen_jax.engine import step
from qwen_jax.engine.replica import VERIFY_WORKING_PER_STATE
from qwen_jax.engine.speculative import MAX_DRAFTS, parse_speculative_config
from qwen_jax.models.decoder import cache_shapes


def greedy(max_tokens, **extra):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


@pytest.fixture(scope="module")
def two_drafts(hybrid_mtp_dir, kit) -> LLM:
    """The model verifying 2 drafts on every step that can."""
    return LLM(hybrid_mtp_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **kit.ENGINE_ARGS)


@pytest.fixture(scope="module")
def plain(hybrid_mtp_dir, kit):
    """The same model (its head loaded and unused) without speculation."""
    return LLM(hybrid_mtp_dir, speculative_config="off", **kit.ENGINE_ARGS)


# one draft, and the most the default policy runs (k = 2 sits between them: the suite's time is better spent elsewhere)
@pytest.fixture(scope="module", params=[1, 3], ids=lambda k: f"k{k}")
def speculative(request, hybrid_mtp_dir, kit):
    k = request.param
    return k, LLM(hybrid_mtp_dir, speculative_config={"method": "mtp", "num_speculative_tokens": k},
                  **kit.ENGINE_ARGS)


def test_greedy_outputs_equal_plain_decoding(plain, speculative, kit):
    k, llm = speculative
    prompts = [kit.prompt(n, seed=950 + n) for n in (5, 23, 40, 12)] + [kit.EOS_PROMPT]
    params = [greedy(17, ignore_eos=True), greedy(9, ignore_eos=True), greedy(12, ignore_eos=True),
              greedy(14, ignore_eos=True, stop_token_ids=[7]), greedy(12)]
    expected = plain.generate(prompts, params)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [(o.finish_reason, o.stop_reason) for o in got] == [(o.finish_reason, o.stop_reason) for o in expected]
    for one, params_one in zip(prompts, params):  # one at a time: other batch shapes, the same tokens
        assert llm.generate([one], params_one)[0].token_ids == plain.generate([one], params_one)[0].token_ids
    stats = llm.engine.stats()
    rows = stats["spec_verified_rows_total"]
    assert rows > 0 and stats["spec_drafted_tokens_total"] == k * rows
    assert stats["spec_accepted_tokens_total"] > 0  # some drafts were right: partly accepted rows ran
    # a row accepts its drafts in order: as many at each position as at any later one, none past k
    per_position = stats["spec_accepted_tokens_per_position"]
    assert sum(per_position) == stats["spec_accepted_tokens_total"]
    assert per_position[:k] == sorted(per_position[:k], reverse=True) and not any(per_position[k:])
    kit.assert_idle(llm)


def test_preemption_under_speculation_keeps_outputs(plain, speculative, kit):
    """Four long requests need more blocks than the cache has: some are preempted and recomputed."""
    k, llm = speculative
    prompts = [kit.prompt(40, seed=970 + i) for i in range(4)]
    params = greedy(24, ignore_eos=True)
    before = llm.engine.stats()["num_preemptions_total"]
    got = llm.generate(prompts, params)
    assert llm.engine.stats()["num_preemptions_total"] > before
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, params)]
    kit.assert_idle(llm)


def test_seeded_sampled_rows_emit_what_plain_decoding_emits(plain, speculative, kit):
    """Each position of a verify row draws with the key its output token has in plain decoding (the distribution:
    test_speculative.py), so seeded rows with temperature, top-k and top-p give the same tokens as without
    speculation, whatever was accepted."""
    k, llm = speculative
    prompts = [kit.prompt(n, seed=930 + n) for n in (6, 19, 33)]
    params = [SamplingParams(max_tokens=15, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=11, temperature=1.0, top_k=5, seed=8, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=13, temperature=0.6, top_p=0.9, seed=9, ignore_eos=True)]
    before = llm.engine.stats()["spec_verified_rows_total"]
    got, expected = llm.generate(prompts, params), plain.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [len(o.token_ids) for o in got] == [15, 11, 13]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(got[1].logprobs, expected[1].logprobs)) < 1e-4
    assert llm.engine.stats()["spec_verified_rows_total"] > before
    kit.assert_idle(llm)


def test_a_stop_string_inside_accepted_drafts_cuts_as_without_them(plain, speculative, kit):
    """Several tokens come back at once; the text still ends where the stop string starts, as without speculation."""
    k, llm = speculative
    prompt = llm.tokenizer.encode("Once upon a time, a small robot")
    params = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    text = plain.generate([prompt], SamplingParams(**params))[0].text
    match = re.search(r"[A-Za-z]{3}", text[len(text) // 3:])
    assert match, f"no ASCII word in {text!r}"
    stopped = [engine.generate([prompt], SamplingParams(**params, stop=[match.group()]))[0]
               for engine in (plain, llm)]
    assert stopped[1].text == stopped[0].text == text[:text.find(match.group())]
    assert stopped[1].token_ids == stopped[0].token_ids and stopped[1].finish_reason == "stop"
    kit.assert_idle(llm)


def test_prefix_caching_on_and_off_give_the_same_outputs(hybrid_mtp_dir, kit):
    """Prompts sharing a prefix: hits restore recurrent-state snapshots, and speculation runs on top of them."""
    config = {"method": "mtp", "num_speculative_tokens": 2}
    base = kit.prompt(40, seed=990)
    prompts = [base + kit.prompt(5, seed=991), base + kit.prompt(9, seed=992), base]
    params = greedy(12, ignore_eos=True)
    cached = LLM(hybrid_mtp_dir, speculative_config=config, **kit.ENGINE_ARGS)
    first = cached.generate(prompts[:1], params)
    again = cached.generate(prompts, params)
    assert again[1].num_cached_tokens > 0
    uncached = LLM(hybrid_mtp_dir, speculative_config=config, **dict(kit.ENGINE_ARGS, enable_prefix_caching=False))
    assert [o.token_ids for o in uncached.generate(prompts, params)] == [o.token_ids for o in again]
    assert first[0].token_ids == again[0].token_ids
    kit.assert_idle(cached)


def test_a_full_warmup_leaves_speculation_nothing_to_compile(plain, hybrid_mtp_dir, kit):
    """The head's program after a plain step, the verify step and the staging that catches a step up on a verify
    program compile with each bucket: serving greedy requests under speculation jits none of them (on a GPU such a
    compile would hold every running request)."""
    llm = LLM(hybrid_mtp_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **kit.ENGINE_ARGS)
    llm.engine.warmup(full=True)
    jitted = (step.verify_step._cache_size(), step.draft_step._cache_size(), step.stage_behind._cache_size())
    prompts = [kit.prompt(n, seed=940 + n) for n in (4, 21, 37)]
    params = [greedy(9, ignore_eos=True), SamplingParams(max_tokens=7, temperature=0.7, seed=1, ignore_eos=True),
              greedy(11, ignore_eos=True)]
    got = llm.generate(prompts, params)
    assert (step.verify_step._cache_size(), step.draft_step._cache_size(), step.stage_behind._cache_size()) == jitted
    assert llm.engine.stats()["spec_verified_rows_total"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, params)]
    kit.assert_idle(llm)


def test_verify_steps_fit_the_memory_held_back_from_the_caches(plain, hybrid_mtp_dir, kit, monkeypatch):
    """On a device that reports its memory, a verify step's tokens are capped by the memory the caches leave (a
    verify step keeps a slot's worth of GDN state a token of its bucket until its commit): with room for 8 tokens,
    k = 2 verifies steps of up to 2 rows and decodes larger ones plainly, with plain decoding's tokens."""
    per_slot = sum(math.prod(s.shape) * s.dtype.itemsize
                   for s in jax.tree.leaves(cache_shapes(load_config(hybrid_mtp_dir), 0, kit.BLOCK, 1)))
    config = {"method": "mtp", "num_speculative_tokens": 2}
    # room for the working memory of 8.5 verify tokens: capped to the bucket of 8
    kit.fake_memory(monkeypatch, hybrid_mtp_dir, dict(kit.ENGINE_ARGS, speculative_config=config),
                    held_back=8.5 * VERIFY_WORKING_PER_STATE * per_slot)
    llm = LLM(hybrid_mtp_dir, speculative_config=config, **kit.ENGINE_ARGS)
    monkeypatch.undo()
    replica = llm.engine.replicas[0]
    assert replica.max_verify_tokens == 8
    assert [replica.scheduler.speculation.drafts_at(rows) for rows in (1, 2, 3, 4)] == [2, 2, 0, 0]
    prompts = [kit.prompt(n, seed=1200 + n) for n in (6, 15, 26)]
    params = [greedy(n, ignore_eos=True) for n in (4, 9, 13)]  # rows finish apart: 3, 2, then 1 decode
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, params)]
    assert llm.engine.stats()["spec_verified_rows_total"] > 0
    kit.assert_idle(llm)


def test_a_model_without_an_mtp_head_cannot_speculate(hybrid_dir, kit):
    with pytest.raises(ValueError, match="MTP head"):
        LLM(hybrid_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **kit.ENGINE_ARGS)


@pytest.mark.parametrize("config, problem", [
    ({"method": "ngram", "num_speculative_tokens": 2}, "method"),
    ({"method": "mtp", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": 9}, "num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown"),
    ("{not json", "JSON"),
])
def test_a_bad_speculative_config_is_a_clear_error(config, problem):
    with pytest.raises(ValueError, match=problem):
        parse_speculative_config(config)


def test_several_rounds_a_program_emit_what_plain_decoding_emits(plain, hybrid_mtp_dir, kit):
    """With several decode steps a program (num_scheduler_steps 4), a few rows verify eight rounds in one program,
    each round's positions after the tokens emitted before it: greedy and seeded rows, rows that end inside a
    program (EOS, max_tokens) and rows joining later give plain decoding's tokens."""
    k = 2
    llm = LLM(hybrid_mtp_dir, speculative_config={"method": "mtp", "num_speculative_tokens": k},
              **dict(kit.ENGINE_ARGS, num_scheduler_steps=4))
    prompts = [kit.prompt(n, seed=1010 + n) for n in (7, 18, 29)] + [kit.EOS_PROMPT]
    params = [greedy(21, ignore_eos=True), SamplingParams(max_tokens=17, temperature=0.9, seed=3, ignore_eos=True),
              greedy(6, ignore_eos=True), greedy(15)]
    got, expected = llm.generate(prompts, params), plain.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [(o.finish_reason, o.stop_reason) for o in got] == [(o.finish_reason, o.stop_reason) for o in expected]
    for one, params_one in zip(prompts, params):  # alone: every program is eight rounds of one row
        assert llm.generate([one], params_one)[0].token_ids == plain.generate([one], params_one)[0].token_ids
    stats = llm.engine.stats()
    assert stats["spec_drafted_tokens_total"] == k * stats["spec_verified_rows_total"] > 0
    kit.assert_idle(llm)


def test_by_default_a_model_with_a_head_speculates_where_it_pays(plain, hybrid_mtp_dir, kit, monkeypatch):
    """No speculative_config: the policy verifies drafts while the measured acceptance pays for them; once it does
    not (here: the estimate forced down), decode steps run plain and skip the head, and every PROBE_EVERY-th verifies
    again. Outputs are plain decoding's throughout."""
    from qwen_jax.engine import speculative

    monkeypatch.setattr(speculative, "PROBE_EVERY", 3)
    llm = LLM(hybrid_mtp_dir, **kit.ENGINE_ARGS)
    policy = llm.engine.replicas[0].scheduler.speculation
    assert policy is not None and policy.drafts_at(1) == MAX_DRAFTS
    prompts = [kit.prompt(n, seed=1030 + n) for n in (9, 26)]
    params = greedy(24, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    verified = llm.engine.stats()["spec_verified_rows_total"]
    assert verified > 0
    policy.accepted, policy.rejected = 0.0, 1e6  # as if no draft had ever been accepted
    steps = llm.engine.num_steps
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    probes = llm.engine.stats()["spec_verified_rows_total"] - verified
    plain_steps = llm.engine.num_steps - steps
    assert 0 < probes and plain_steps > probes  # mostly plain steps, a probe now and then
    assert llm.engine.replicas[0].scheduler.speculation.acceptance < 0.1
    kit.assert_idle(llm)


def test_speculation_off_and_models_without_a_head_run_plain(hybrid_dir, kit):
    llm = LLM(hybrid_dir, **kit.ENGINE_ARGS)  # the default asks for the head only where there is one
    assert llm.engine.replicas[0].scheduler.speculation is None
    off = parse_speculative_config({"method": "mtp", "num_speculative_tokens": 0})
    assert parse_speculative_config("off") == off == (0, False)
    assert parse_speculative_config(None, has_mtp=False).num_drafts == 0
    assert parse_speculative_config('{"method": "mtp"}') == (MAX_DRAFTS, False)


@pytest.mark.parametrize("setting", [
    dict(temperature=0.8, top_k=4, seed=3), dict(temperature=1.0, top_k=20, top_p=0.95, seed=4),
    dict(temperature=0.9, top_p=0.7, seed=5, logprobs=2), dict(temperature=0.0, logprobs=3),
    dict(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3),
    dict(temperature=1.0, seed=6, frequency_penalty=1.0, logit_bias={40: 3.0, 41: -100.0}),
    dict(temperature=0.0, min_tokens=6, stop_token_ids=[45]), dict(temperature=0.7, min_p=0.1, seed=7)],
    ids=["top_k", "generation_config", "top_p_logprobs", "greedy_logprobs", "penalties", "bias_frequency",
         "min_tokens", "min_p"])
def test_every_sampling_setting_verifies_with_plain_decodings_tokens(plain, two_drafts, kit, setting):
    """Speculation serves every sampling setting (but grammars): top-k / top-p (a checkpoint's generation_config
    too), logprobs, penalties, logit bias, min_tokens' bans, seeds. Its rows verify drafts, and greedy and seeded
    requests emit plain decoding's very tokens (float32), their logprobs too."""
    llm = two_drafts
    prompt = kit.prompt(14, seed=1050)
    params = SamplingParams(max_tokens=10, ignore_eos="min_tokens" not in setting, **setting)
    before = llm.engine.stats()["spec_verified_rows_total"]
    got, expected = llm.generate([prompt], params)[0], plain.generate([prompt], params)[0]
    assert got.token_ids == expected.token_ids
    if params.logprobs is not None:
        assert [t.token_id for t in got.logprobs] == [t.token_id for t in expected.logprobs]
        np.testing.assert_allclose([t.logprob for t in got.logprobs], [t.logprob for t in expected.logprobs],
                                   rtol=1e-5, atol=1e-5)
    assert llm.engine.stats()["spec_verified_rows_total"] > before


def test_verify_programs_are_issued_before_the_one_before_is_read_back(plain, hybrid_mtp_dir, kit):
    """The core keeps the device a step ahead through verify programs too: the next one is built from the booked
    counts (every draft) and catches up on the device on what the one before it accepted. Rows accept only some of
    their drafts here, so a wrong catch-up would change the tokens."""
    llm = LLM(hybrid_mtp_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **kit.ENGINE_ARGS)
    runner = llm.engine.replicas[0].runner
    events = []
    execute, fetch = runner.executor, runner.fetch

    def logged_execute(ops):
        out = execute(ops)
        events.append(("issue", ops[-1].KIND, getattr(ops[-1], "behind", False), id(out)))
        return out

    def logged_fetch(out):
        events.append(("read", id(out)))
        return fetch(out)

    runner.executor, runner.fetch = logged_execute, logged_fetch
    prompts = [kit.prompt(n, seed=950 + n) for n in (5, 23, 40)]
    params = [greedy(20, ignore_eos=True), SamplingParams(max_tokens=16, temperature=0.9, seed=5, ignore_eos=True),
              greedy(18, ignore_eos=True)]
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, params)]
    issued = [e for e in events if e[0] == "issue"]
    read_at = {e[1]: i for i, e in enumerate(events) if e[0] == "read"}
    # a verify program issued while the verify program before it was not read back yet, and caught up on it
    overlapped = [b for a, b in zip(issued, issued[1:]) if a[1] == b[1] == "verify" and b[2]
                  and read_at[a[3]] > events.index(b)]
    assert overlapped
    stats = llm.engine.stats()
    assert 0 < stats["spec_accepted_tokens_total"] < stats["spec_drafted_tokens_total"]
    kit.assert_idle(llm)


def test_aborting_a_request_while_its_verify_program_runs_leaves_the_others_exact(plain, hybrid_mtp_dir, kit):
    """A request aborted between the issue of its verify program and that program's read-back frees its blocks and
    slot at once; the program's tokens for it are dropped, and the other requests go on as in plain decoding."""
    llm = LLM(hybrid_mtp_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **kit.ENGINE_ARGS)
    engine = llm.engine
    prompts = {"kept": kit.prompt(23, seed=973), "aborted": kit.prompt(5, seed=955)}
    params = greedy(16, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    tokens = {rid: [] for rid in prompts}
    while not any(step.verifies for step in engine._in_flight):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert [out.finish_reason for out in engine.abort(["aborted"])] == ["abort"]
    while engine.has_unfinished:
        for out in engine.step():
            assert out.request_id == "kept"
            tokens["kept"] += out.new_token_ids
    assert tokens["kept"] == plain.generate([prompts["kept"]], params)[0].token_ids
    kit.assert_idle(llm)


def test_speculation_at_128_rows_emits_plain_decodings_tokens(hybrid_mtp_dir, kit):
    """The default policy verifies steps of 128 decoding rows (VERIFY_COST's measured 128-row costs; a CPU has no
    device memory to cap the tokens): greedy rows emit plain decoding's tokens, and seeded sampled rows (top-k,
    top-p, a penalty) the tokens plain decoding draws with the same keys, so its distribution too."""
    args = dict(kit.ENGINE_ARGS, max_num_seqs=128, max_num_batched_tokens=512, num_kv_blocks=128 * 2 + 8,
                num_snapshots=0, enable_prefix_caching=False)
    prompts = [kit.prompt(5 + n % 4, seed=2000 + n) for n in range(128)]
    params = [greedy(7, ignore_eos=True) if n % 2 else
              SamplingParams(max_tokens=7, temperature=0.9, top_k=6, top_p=0.9, presence_penalty=0.5, seed=n,
                             ignore_eos=True) for n in range(128)]
    expected = [o.token_ids for o in LLM(hybrid_mtp_dir, speculative_config="off", **args).generate(prompts, params)]
    llm = LLM(hybrid_mtp_dir, **args)
    policy = llm.engine.replicas[0].scheduler.speculation
    verified_at = []
    drafts_for = policy.drafts_for
    policy.drafts_for = lambda rows: verified_at.append((rows, drafts_for(rows))) or verified_at[-1][1]
    assert policy.drafts_at(128) > 0
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert any(rows == 128 and k for rows, k in verified_at)
    kit.assert_idle(llm)
