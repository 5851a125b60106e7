"""Structured outputs on the tiny hybrid model (random weights, temperature 1): JSON that validates against its schema
for every seed, regexes and choices honoured, free rows beside constrained ones unchanged, grammars ended, aborted
and preempted cleanly, and bad grammars refused naming the problem."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from qwen_jax import SamplingParams
from qwen_jax.sampling_params import StructuredOutputsParams

PROMPT = [17, 301, 45, 99]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "k", "b", "e"],
          "properties": {"n": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                         "k": {"type": "integer", "minimum": 0, "maximum": 99},
                         "b": {"type": "boolean"}, "e": {"enum": ["x", "yz"]}}}


def constrained(seed: int, max_tokens: int = 60, **spec) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))


def test_json_schema_output_validates_for_every_seed(engines, kit):
    llm = engines("hybrid")
    outs = llm.generate([PROMPT] * 12, [constrained(s, json=SCHEMA, disable_any_whitespace=True) for s in range(12)])
    values = []
    for out in outs:
        assert out.finish_reason == "stop" and out.token_ids[-1] in (kit.EOS, 512)
        values.append(json.loads(out.text))
        jsonschema.validate(values[-1], SCHEMA)
    assert len({json.dumps(v) for v in values}) > 6  # sampled, not one forced string
    kit.assert_idle(llm)


def test_json_object_regex_and_choice_are_honoured(engines, kit):
    llm = engines("hybrid")
    regex = r"[a-c]{2,5}-\d{2}"
    choices = ["yes", "no", "maybe \"so\""]
    params = ([constrained(s, regex=regex) for s in range(3)] + [constrained(s, choice=choices) for s in range(3)]
              + [constrained(s, json_object=True, max_tokens=40, disable_any_whitespace=True) for s in range(2)])
    outs = llm.generate([PROMPT] * len(params), params)
    assert all(re.fullmatch(regex, o.text) for o in outs[:3])
    assert all(o.text in choices for o in outs[3:6])
    for out in outs[6:]:  # a JSON object, whole or cut by max_tokens
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.text.startswith("{")
    kit.assert_idle(llm)


def test_free_rows_beside_constrained_rows_get_their_own_outputs(engines, kit):
    llm = engines("hybrid")
    prompts = [kit.prompt(9, seed=50), kit.prompt(14, seed=51)]
    free = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True)]
    alone = [o.token_ids for o in llm.generate(prompts, free)]
    mixed = llm.generate([prompts[0], PROMPT, prompts[1], PROMPT],
                         [free[0], constrained(1, regex=r"\d{3}"), free[1], constrained(2, choice=["ab", "cd"])])
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    assert re.fullmatch(r"\d{3}", mixed[1].text) and mixed[3].text in ("ab", "cd")
    kit.assert_idle(llm)


def test_a_finished_grammar_ends_the_request_even_when_eos_is_ignored(engines, kit):
    llm = engines("hybrid")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["ab", "cd"]))
    out = llm.generate([PROMPT], params)[0]
    assert out.text in ("ab", "cd") and out.finish_reason == "stop" and out.stop_reason in (kit.EOS, 512)
    kit.assert_idle(llm)


def test_aborted_and_preempted_constrained_requests(engines, kit, monkeypatch):
    """Four requests that fill the cache preempt one another; one is aborted part-way. The others' JSON still
    validates, and nothing is left behind."""
    llm = engines("hybrid")
    engine = llm.engine
    scheduler = engine.replicas[0].scheduler
    preempt, preempted = scheduler._preempt, []
    monkeypatch.setattr(scheduler, "_preempt", lambda seq: (preempted.append(len(seq.output_token_ids)),
                                                             preempt(seq)))
    long_prompt = kit.prompt(30, seed=60)
    params = [constrained(s, json=SCHEMA, max_tokens=34, disable_any_whitespace=True) for s in range(4)]
    for i, p in enumerate(params):
        engine.add_request(f"c{i}", long_prompt, p)
        llm.output.add(f"c{i}", long_prompt, p)
    finished, aborted = {}, None
    while engine.has_unfinished:
        results, ended = llm.output.process(engine.step())
        engine.abort(ended)
        if preempted and aborted is None:  # once the cache ran dry, abort one that still runs
            aborted = next(iter(engine.seqs))
            results += llm.output.process(engine.abort([aborted]))[0]
        finished.update({o.request_id: o for o in results if o.finished})
    assert any(n > 0 for n in preempted), "no request was preempted mid-output: the test lost its point"
    assert finished.pop(aborted).finish_reason == "abort"
    assert len(finished) == 3
    for out in finished.values():
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMA)
        else:  # cut by max_tokens: a prefix of a JSON object
            assert out.text.startswith("{") and out.finish_reason == "length"
    kit.assert_idle(llm)


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "not a valid JSON schema"),
    (dict(json="{not json"), "not a valid JSON schema"),
    (dict(regex="(ab"), "not a valid regular expression"),
    (dict(grammar="root ::= missing"), "not a valid grammar"),
    (dict(structural_tag={"type": "structural_tag", "format": {"type": "any_text"}}), "not a valid structural tag"),
])
def test_invalid_grammars_are_refused_naming_the_problem(engines, kit, spec, message):
    llm = engines("hybrid")
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT], constrained(0, **spec))
    kit.assert_idle(llm)


@pytest.mark.parametrize("spec, message", [
    ({}, "exactly one of"),
    (dict(regex="a", choice=["a"]), "exactly one of"),
    (dict(choice=[]), "non-empty list of non-empty strings"),
    (dict(choice=["a", 3]), "non-empty list of non-empty strings"),
    (dict(json=3), "an object or its JSON text"),
])
def test_malformed_structured_outputs_params_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**spec)


def test_a_structural_tag_constrains_only_what_its_triggers_begin(shared_data):
    """vLLM's structural tag: free text, in which each structure's `begin` starts a JSON value of its schema that
    its `end` closes."""
    from transformers import AutoTokenizer

    from qwen_jax.engine.grammar import GrammarCompiler

    path = shared_data / "qwen3_5_tokenizer"
    hf = AutoTokenizer.from_pretrained(path)
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(lambda: (path / "tokenizer.json").read_text(), len(hf), [eos])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    tag = {"type": "structural_tag", "triggers": ["<f="],
           "structures": [{"begin": "<f=add>", "schema": schema, "end": "</f>"}]}

    def fits(text: str) -> bool:
        matcher = compiler.matcher(StructuredOutputsParams(structural_tag=tag))
        try:
            for token in hf.encode(text, add_special_tokens=False) + [eos]:
                matcher.accept(token)
        except ValueError:
            return False
        return matcher.is_terminated

    assert fits('Sure. <f=add>{"a": 3}</f> and done.') and fits("no call at all")
    assert not fits('<f=add>{"a": "three"}</f>') and not fits("<f=add>{}</f>")


def test_structured_outputs_never_import_torch(shared_data):
    """The grammar engine is llguidance, with HF tokenizers inside: a serving process checks grammars and builds
    the vocabulary without transformers' torch (the light install has none)."""
    code = ("import sys; import qwen_jax, qwen_jax.llm, qwen_jax.engine.core, server.app; "
            "from qwen_jax.engine import grammar; from qwen_jax.sampling_params import StructuredOutputsParams as S; "
            "grammar.check_structured_outputs(S(json={'type': 'object'})); "
            "g = grammar.GrammarCompiler(lambda: open(sys.argv[1]).read(), 248320, [248046]); g.prepare(); "
            "g.matcher(S(regex='a+')); print(sorted(m for m in ('xgrammar', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, str(shared_data / "qwen3_5_tokenizer" / "tokenizer.json")],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
