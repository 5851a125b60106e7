"""`load_format="dummy_echo"` (weights.echo_params): the dummy weights with every residual writer zero and the MTP
head drafting what the main model emits. The main model's next token is a function of the current token alone,
speculation accepts (almost) every draft, and its greedy outputs stay those of plain decoding, token for token."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

from qwen_jax import LLM, SamplingParams
from qwen_jax.config import parse_config
from qwen_jax.models.decoder import RESIDUAL_WRITERS
from qwen_jax.weights import dummy_params, echo_params
from sharding import mesh, rules

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def echo_dir(hybrid_dir, tmp_path_factory) -> str:
    """The tiny float32 hybrid MoE's config with an MTP head (mtp_num_hidden_layers 1) and its tokenizer, no weights:
    the dummy load formats need only these."""
    directory = tmp_path_factory.mktemp("dummy_echo")
    for name in os.listdir(hybrid_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(hybrid_dir, name), directory / name)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, mtp_num_hidden_layers=1)))
    return str(directory)


@pytest.fixture(scope="module")
def plain(echo_dir, kit):
    return LLM(echo_dir, load_format="dummy_echo", speculative_config="off", **kit.ENGINE_ARGS)


@pytest.fixture(scope="module")
def speculative(echo_dir, kit):
    return LLM(echo_dir, load_format="dummy_echo", speculative_config={"method": "mtp", "num_speculative_tokens": 2},
               **kit.ENGINE_ARGS)


def _prompts(kit) -> list[list[int]]:
    return [kit.prompt(n, seed=600 + n) for n in (3, 11, 26, 7)]


def test_echo_params_zero_the_residual_writers_and_keep_the_rest_in_their_shards(echo_dir):
    """On an expert-parallel mesh: every residual writer is zero, the head's fc is [I; 0] and its norms scale by 1
    and by the main final norm's weight; every other leaf (routers included) is the dummy weights' own, and every leaf
    keeps its sharding."""
    cfg = parse_config(json.load(open(os.path.join(echo_dir, "config.json"))))
    shardings = rules.param_shardings(cfg, mesh.make_mesh(2, 1, True))
    dummy = jax.tree.map(np.asarray, dummy_params(cfg, seed=4, shardings=shardings))
    echoed = echo_params(cfg, dummy_params(cfg, seed=4, shardings=shardings))
    flat = jax.tree_util.tree_flatten_with_path(echoed)[0]
    assert all(leaf.sharding == want for (_, leaf), want in zip(flat, jax.tree.leaves(shardings), strict=True))
    head = echoed["mtp"]
    h = cfg.hidden_size
    assert np.array_equal(head["fc"], np.concatenate([np.eye(h), np.zeros((h, h))]))
    assert cfg.norm_plus_one and not np.any(head["pre_fc_norm_embedding"])  # (1 + w): scale 1
    assert np.array_equal(head["final_norm"], echoed["final_norm"])
    zeroed = set()
    for (path, leaf), (_, before) in zip(flat, jax.tree_util.tree_flatten_with_path(dummy)[0], strict=True):
        name = str(path[-1].key)
        if name in RESIDUAL_WRITERS:
            assert not np.any(leaf) and np.any(before), jax.tree_util.keystr(path)
            zeroed.add(name)
        elif path[0].key != "mtp" or name not in ("fc", "pre_fc_norm_embedding", "final_norm"):
            assert np.array_equal(leaf, before), jax.tree_util.keystr(path)
    assert zeroed == {"o", "out", "w_down", "shared_down"}


def test_the_next_token_depends_on_the_current_token_alone(plain, kit):
    """The residual stream stays the token's embedding: a token predicts the same next token in every context."""
    ending = 123
    contexts = [kit.prompt(n, seed=620 + n) + [ending] for n in (4, 9, 30)]
    outputs = plain.generate(contexts, GREEDY)
    assert len({o.token_ids[0] for o in outputs}) == 1
    successor: dict[int, int] = {}
    for prompt, out in zip(_prompts(kit) + contexts, plain.generate(_prompts(kit), GREEDY) + outputs):
        sequence = [prompt[-1], *out.token_ids]
        for token, following in zip(sequence, sequence[1:]):
            assert successor.setdefault(token, following) == following, f"token {token} in two contexts"


def test_speculation_accepts_the_drafts_and_emits_plain_decodings_tokens(plain, speculative, kit):
    prompts = _prompts(kit)
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert [o.token_ids for o in speculative.generate(prompts, GREEDY)] == expected
    for prompt, tokens in zip(prompts, expected):  # one at a time: other batch shapes, the same tokens
        assert speculative.generate([prompt], GREEDY)[0].token_ids == tokens
    stats = speculative.engine.stats()
    drafted, accepted = stats["spec_drafted_tokens_total"], stats["spec_accepted_tokens_total"]
    assert drafted >= 2 * 2 * len(prompts)  # several verify steps per request
    assert accepted >= 0.9 * drafted, (accepted, drafted)
    kit.assert_idle(speculative)


def test_an_unknown_load_format_is_an_error_naming_the_formats(echo_dir):
    with pytest.raises(ValueError, match="load_format 'dumy': expected one of auto, dummy, dummy_echo"):
        LLM(echo_dir, load_format="dumy")


def test_seeded_rows_that_accept_some_drafts_emit_what_plain_decoding_emits(plain, speculative, kit):
    """At a low temperature the echo head's drafts are often, not always, what a seeded row draws: a verify program
    planned before the one before it is read back must move each row's seed counter on by the drafts that program
    accepted (step.stage_behind), or the row draws other numbers than plain decoding does."""
    prompts = _prompts(kit)
    params = [SamplingParams(max_tokens=20, temperature=0.02, seed=11 + i, ignore_eos=True)
              for i in range(len(prompts))]
    before = speculative.engine.stats()
    got = speculative.generate(prompts, params)
    after = speculative.engine.stats()
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, params)]
    accepted = after["spec_accepted_tokens_total"] - before["spec_accepted_tokens_total"]
    assert 0 < accepted < after["spec_drafted_tokens_total"] - before["spec_drafted_tokens_total"]
    kit.assert_idle(speculative)
