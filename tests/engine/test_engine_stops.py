"""Why requests end: max_tokens, EOS (with ignore_eos and min_tokens), stop token ids, stop strings, abort; memory is
returned the moment a request ends.

The tiny hybrid model is rigged so that its greedy continuation of EOS_PROMPT emits EOS at step EOS_STEP.
"""

import re

from qwen_jax import SamplingParams


def test_eos_ends_generation_unless_ignored_or_too_early(engines, kit):
    llm = engines("hybrid")
    greedy = dict(temperature=0.0, max_tokens=6)
    stopped, ignored, delayed = (llm.generate([kit.EOS_PROMPT], params)[0] for params in (
        SamplingParams(**greedy), SamplingParams(**greedy, ignore_eos=True),
        SamplingParams(**greedy, min_tokens=kit.EOS_STEP + 2)))
    head = ignored.token_ids[:kit.EOS_STEP]
    assert ignored.token_ids[kit.EOS_STEP] == kit.EOS
    assert (len(ignored.token_ids), ignored.finish_reason, ignored.stop_reason) == (6, "length", None)

    assert stopped.token_ids == head + [kit.EOS]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", kit.EOS)
    assert stopped.text == llm.tokenizer.decode(head)  # the EOS token is not detokenized

    # min_tokens bans every EOS id (514 and 512) until that many tokens exist; later EOS ends the request again.
    assert delayed.token_ids[:kit.EOS_STEP] == head
    assert not {kit.EOS, 512} & set(delayed.token_ids[:kit.EOS_STEP + 2])
    assert len(delayed.token_ids) >= kit.EOS_STEP + 2
    assert delayed.finish_reason == ("stop" if delayed.token_ids[-1] in (kit.EOS, 512) else "length")
    kit.assert_idle(llm)


def test_stop_token_ids_and_max_tokens(engines, kit):
    llm = engines("hybrid")
    full = llm.generate([kit.EOS_PROMPT], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert (len(full.token_ids), full.finish_reason) == (5, "length")
    second = full.token_ids[1]
    out = llm.generate([kit.EOS_PROMPT], SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[second]))[0]
    assert out.token_ids == full.token_ids[:2]
    assert (out.finish_reason, out.stop_reason) == ("stop", second)
    one = llm.generate([kit.EOS_PROMPT], SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert (one.token_ids, one.finish_reason) == (full.token_ids[:1], "length")
    kit.assert_idle(llm)


def test_stop_string_cuts_text_and_generation(engines, kit):
    llm = engines("hybrid")
    prompt = llm.tokenizer.encode("Once upon a time, a small robot")
    params = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    full = llm.generate([prompt], SamplingParams(**params))[0]
    text = full.text
    # Three ASCII letters from the second half of the (gibberish) text; its first occurrence is where it must cut.
    match = re.search(r"[A-Za-z]{3}", text[len(text) // 3:])
    assert match, f"no ASCII word in {text!r}"
    stop = match.group()
    cut = text.find(stop)
    assert 0 < cut

    out = llm.generate([prompt], SamplingParams(**params, stop=["never appears in gibberish", stop]))[0]
    assert out.text == text[:cut]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    n = len(out.token_ids)
    assert n < 16 and out.token_ids == full.token_ids[:n]
    assert stop in llm.tokenizer.decode(full.token_ids[:n]) and stop not in llm.tokenizer.decode(full.token_ids[:n - 1])
    kit.assert_idle(llm)


def test_abort_frees_blocks_and_slots_at_once(engines, kit):
    engine = engines("hybrid").engine
    long = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"abort-{i}", kit.prompt(34, seed=300 + i), long)
    engine.add_request("abort-waiting", kit.prompt(34, seed=310), long)  # a fifth row never frees up for it
    engine.add_request("abort-queued", kit.prompt(34, seed=311), long)
    running = ["abort-0", "abort-1", "abort-2", "abort-waiting"]
    while any(not engine.seqs[rid].output_token_ids for rid in running):
        engine.step()
    stats = engine.stats()
    assert (stats["num_running"], stats["num_waiting"], stats["state_slots_used"]) == (4, 1, 4)
    assert stats["kv_blocks_used"] == 4 * 3  # 34 prompt tokens + a few generated: 3 blocks each

    assert [(o.request_id, o.finish_reason) for o in engine.abort(["abort-1"])] == [("abort-1", "abort")]
    stats = engine.stats()  # freed at once, though a step that still writes them may be in flight
    assert (stats["num_running"], stats["kv_blocks_used"], stats["state_slots_used"]) == (3, 9, 3)

    queued = engine.abort(["abort-queued"])  # never scheduled: nothing to free, but it ends
    assert [(o.finish_reason, o.new_token_ids) for o in queued] == [("abort", [])]
    assert engine.abort(["abort-1", "no-such-request"]) == []
    assert [o.finish_reason for o in engine.abort(["abort-0", "abort-2", "abort-waiting"])] == ["abort"] * 3
    assert engine.step() == []  # the step in flight comes back; its tokens of aborted requests are dropped
    assert not engine.has_unfinished
    kit.assert_idle(engines("hybrid"))


def test_stop_string_before_min_tokens_does_not_count(engines, kit):
    """As in vLLM, stop strings only end a request once min_tokens tokens exist; an earlier occurrence stays in the
    text and generation goes on."""
    llm = engines("hybrid")
    prompt = llm.tokenizer.encode("Once upon a time, a small robot")
    params = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    full = llm.generate([prompt], SamplingParams(**params))[0]
    once = [w for w in re.findall(r"(?=([A-Za-z]{3}))", full.text) if full.text.count(w) == 1]
    assert once, f"no ASCII trigram occurs once in {full.text!r}"
    cut = llm.generate([prompt], SamplingParams(**params, stop=[once[0]]))[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) < 16
    out = llm.generate([prompt], SamplingParams(**params, stop=[once[0]], min_tokens=16))[0]
    assert (out.token_ids, out.text, out.finish_reason) == (full.token_ids, full.text, "length")
    kit.assert_idle(llm)


def test_text_held_back_for_a_possible_stop_string_is_released_at_eos(engines, kit):
    """A stop string that the output only starts to spell is held back while streaming; EOS must release it."""
    llm = engines("hybrid")
    greedy = dict(temperature=0.0, max_tokens=6)
    plain = llm.generate([kit.EOS_PROMPT], SamplingParams(**greedy))[0]
    assert plain.finish_reason == "stop" and plain.stop_reason == kit.EOS and plain.text
    unfinished_stop = plain.text + "\u2603"  # the whole output is a prefix of it, so all of it is held back
    held = llm.generate([kit.EOS_PROMPT], SamplingParams(**greedy, stop=[unfinished_stop]))[0]
    assert (held.finish_reason, held.stop_reason) == ("stop", kit.EOS)
    assert held.text == plain.text
