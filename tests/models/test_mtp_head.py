"""Qwen3.5's MTP head: its config, params and cache layout, loading from every checkpoint layout the loader reads,
and `mtp_forward` against a torch reference built from HF transformers' own Qwen3.5-MoE modules.

The reference is never our code: HF's decoder layer and RMSNorm, a torch Linear for fc, wired as vLLM's
Qwen3_5MultiTokenPredictor runs them.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import shutil
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from checkpoint_layouts import fused_experts, language_model_layout, per_expert, save_sharded
from safetensors.torch import load_file, save_file
from support import shared_data
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm

from qwen_jax import LLM, SamplingParams, create_engine
from qwen_jax.config import from_hf_dict, load_config
from qwen_jax.layers.batch import ragged
from qwen_jax.layers.hot_ops import ops_for
from qwen_jax.models import decoder
from qwen_jax.models.mtp import mtp_forward, next_tokens_in_request
from qwen_jax.weights import SafetensorsSource, WeightError, load_params
from sharding import mesh, rules

CONFIGS = shared_data("configs")
BLOCK = 8
FP32_TOL = 1e-4


# arch -> HF's (decoder layer, RMSNorm) classes: the MoE model's head has an MoE layer, the dense model's a dense one.
HF_MODULES = {"qwen3_5_moe": (Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm),
              "qwen3_5": (Qwen3_5DecoderLayer, Qwen3_5RMSNorm)}


class TorchMTP(torch.nn.Module):
    """The MTP head from HF's own modules: fc(cat[norm_e(embed(next token)), norm_h(hidden)]) -> one full-attention
    Qwen3.5 decoder layer -> norm. Parameter names are the checkpoint's below `mtp.`."""

    def __init__(self, arch: str, config):
        super().__init__()
        layer_cls, norm_cls = HF_MODULES[arch]
        h, eps = config.hidden_size, config.rms_norm_eps
        layer_config = copy.deepcopy(config)
        layer_config.layer_types = ["full_attention"] * config.num_hidden_layers
        self.pre_fc_norm_embedding = norm_cls(h, eps)
        self.pre_fc_norm_hidden = norm_cls(h, eps)
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.layers = torch.nn.ModuleList([layer_cls(layer_config, 0)])
        self.norm = norm_cls(h, eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings) -> torch.Tensor:
        """embeds, hidden: [1, T, H] of one sequence at positions 0..T-1 -> the head's normed output [1, T, H]."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        t = x.shape[1]
        causal = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=causal)
        return self.norm(x)


@pytest.fixture(scope="module")
def mtp_checkpoints(checkpoints, tmp_path_factory):
    """arch -> the tiny float32 model of the parity tests plus a random MTP head, saved per-expert in one file with a
    config declaring one MTP layer (built once per module)."""
    made: dict[str, SimpleNamespace] = {}

    def get(arch: str) -> SimpleNamespace:
        if arch in made:
            return made[arch]
        ckpt = checkpoints(arch)
        torch.manual_seed(11)
        head = TorchMTP(arch, ckpt.model.config).float().eval()
        with torch.no_grad():
            for name, p in head.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
                else:  # modules built outside a PreTrainedModel are not initialised
                    p.normal_(0.0, 0.64 if name.endswith("mlp.gate.weight") else 0.08)  # confident routing
        main = load_file(ckpt.dirs["float32"] + "/model.safetensors")
        state = {**main, **per_expert({"mtp." + k: v for k, v in head.state_dict().items()})}
        config = dict(ckpt.config_for("float32"), mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
        directory = tmp_path_factory.mktemp(f"mtp_{arch}")
        save_file(state, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps(config))
        made[arch] = SimpleNamespace(model=ckpt.model, head=head, state=state, main_state=main, config=config,
                                     dir=str(directory), cfg=from_hf_dict(config))
        return made[arch]

    return get


@pytest.fixture(scope="module")
def mtp_checkpoint(mtp_checkpoints):
    """The Qwen3.5-MoE one (the released checkpoints' architecture)."""
    return mtp_checkpoints("qwen3_5_moe")


# ---- config, params, cache ----------------------------------------------------------------------------------------
def test_config_reads_mtp_layers_from_text_only_and_conditional_generation_configs():
    real = load_config(f"{CONFIGS}/Qwen3.5-35B-A3B.json")  # ForConditionalGeneration: under text_config
    assert real.num_mtp_layers == 1 and real.has_mtp and real.mtp_is_moe
    dense = load_config(f"{CONFIGS}/Qwen3.5-4B.json")
    assert dense.has_mtp and not dense.mtp_is_moe
    with open(f"{CONFIGS}/Qwen3.5-35B-A3B.json") as f:
        text = json.load(f)["text_config"]
    assert from_hf_dict(dict(text, model_type="qwen3_5_moe_text")).num_mtp_layers == 1
    assert from_hf_dict(dict(text, mtp_num_hidden_layers=0)).num_mtp_layers == 0
    assert not load_config(f"{CONFIGS}/Qwen3-30B-A3B.json").has_mtp


def test_config_refuses_heads_it_cannot_run():
    with open(f"{CONFIGS}/Qwen3.5-35B-A3B.json") as f:
        text = json.load(f)["text_config"]
    with pytest.raises(ValueError, match="mtp_num_hidden_layers 2"):
        from_hf_dict(dict(text, mtp_num_hidden_layers=2))
    with pytest.raises(ValueError, match="mtp_use_dedicated_embeddings"):
        from_hf_dict(dict(text, mtp_use_dedicated_embeddings=True))


def test_param_and_cache_shapes_have_the_head_only_when_the_model_has_it(mtp_checkpoint):
    cfg = mtp_checkpoint.cfg
    shapes = decoder.param_shapes(cfg)
    h = cfg.hidden_size
    attn = cfg.attention_layers[0]
    assert shapes["mtp"]["fc"].shape == (2 * h, h)
    assert jax.tree.map(lambda s: s.shape, shapes["mtp"]["layer"]) == jax.tree.map(lambda s: s.shape,
                                                                                  shapes["layers"][attn])
    cache = decoder.cache_shapes(cfg, 5, BLOCK, 3)
    assert cache["mtp"] == cache["layers"][attn]
    without = dataclasses.replace(cfg, num_mtp_layers=0)
    assert "mtp" not in decoder.param_shapes(without) and "mtp" not in decoder.cache_shapes(without, 5, BLOCK, 3)
    # memory sizing counts the head's KV pages: one more attention layer's worth per block
    one = mesh.make_mesh(1)
    page = 2 * BLOCK * cfg.num_kv_heads * cfg.head_dim * 4
    assert (rules.cache_bytes_per_device(cfg, one, 1, BLOCK, 0)
            - rules.cache_bytes_per_device(without, one, 1, BLOCK, 0)) == page


def test_real_35b_a3b_head_is_sharded_like_a_main_attention_moe_layer():
    cfg = load_config(f"{CONFIGS}/Qwen3.5-35B-A3B.json")
    m = mesh.make_mesh(tensor_parallel_size=8, enable_expert_parallel=True)
    specs = rules.param_specs(cfg, m)
    assert specs["mtp"]["layer"] == specs["layers"][3]
    assert specs["mtp"]["fc"] == jax.sharding.PartitionSpec(None, None)
    cache = rules.cache_specs(cfg, m, num_blocks=64, block_size=16, num_slots=8)
    assert cache["mtp"] == cache["layers"][3]


def test_dummy_params_fill_the_head(mtp_checkpoint):
    cfg = mtp_checkpoint.cfg
    params = decoder.random_params(cfg, seed=0)
    shapes = decoder.param_shapes(cfg)
    assert jax.tree.structure(params) == jax.tree.structure(shapes)
    head = params["mtp"]
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "final_norm"):
        assert np.all(np.asarray(head[norm]) == 0.0), norm  # (1 + w) norms start at the identity
    assert float(np.std(np.asarray(head["fc"]))) == pytest.approx(0.02, rel=0.1)


# ---- loading -------------------------------------------------------------------------------------------------------
LAYOUTS = {
    "sharded_with_index": lambda state, d: save_sharded(state, d),
    "fused_experts": lambda state, d: save_file(fused_experts(state), str(d / "model.safetensors")),
    "language_model_prefix": lambda state, d: save_file(
        dict(language_model_layout(state), **{"model.visual.patch_embed.proj.weight": torch.randn(3, 5)}),
        str(d / "model.safetensors")),
    "language_model_prefix_fused_sharded": lambda state, d: save_sharded(
        fused_experts(language_model_layout(state)), d, num_files=3),
}


def test_head_loads_with_the_checkpoints_values(mtp_checkpoint):
    params = load_params(mtp_checkpoint.cfg, SafetensorsSource(mtp_checkpoint.dir))
    head, ref = params["mtp"], mtp_checkpoint.head
    np.testing.assert_array_equal(np.asarray(head["fc"]), ref.fc.weight.detach().numpy().T)
    np.testing.assert_array_equal(np.asarray(head["final_norm"]), ref.norm.weight.detach().numpy())
    np.testing.assert_array_equal(np.asarray(head["pre_fc_norm_embedding"]),
                                  ref.pre_fc_norm_embedding.weight.detach().numpy())
    experts = ref.layers[0].mlp.experts
    inter = mtp_checkpoint.cfg.moe_intermediate_size
    np.testing.assert_array_equal(np.asarray(head["layer"]["mlp"]["w_up"]),
                                  experts.gate_up_proj.detach().numpy()[:, inter:].transpose(0, 2, 1))
    np.testing.assert_array_equal(np.asarray(head["layer"]["mlp"]["w_down"]),
                                  experts.down_proj.detach().numpy().transpose(0, 2, 1))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_checkpoint_layout_loads_the_same_params(layout, mtp_checkpoint, tmp_path):
    LAYOUTS[layout](mtp_checkpoint.state, tmp_path)
    cfg = mtp_checkpoint.cfg
    ours = load_params(cfg, SafetensorsSource(str(tmp_path)))
    base = load_params(cfg, SafetensorsSource(mtp_checkpoint.dir))
    assert "mtp" in ours
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_a_head_missing_some_tensors_is_an_error_naming_them(mtp_checkpoint, tmp_path):
    state = {k: v for k, v in mtp_checkpoint.state.items() if k != "mtp.pre_fc_norm_hidden.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightError, match="mtp.pre_fc_norm_hidden.weight"):
        load_params(mtp_checkpoint.cfg, SafetensorsSource(str(tmp_path)))


def test_config_with_mtp_but_no_mtp_tensors_loads_without_the_head(mtp_checkpoint, hf_reference, rel_err, caplog,
                                                                  tmp_path):
    save_file(mtp_checkpoint.main_state, str(tmp_path / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="qwen_jax"):
        engine = create_engine(mtp_checkpoint.config, str(tmp_path), device="cpu", max_num_seqs=2, max_model_len=64,
                               block_size=BLOCK)
    warnings = [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()]
    assert warnings == ["config.json declares 1 MTP layer(s) but the checkpoint has no mtp.* tensors: serving "
                        "without the MTP head"]
    assert not engine.cfg.has_mtp and "mtp" not in engine.params and "mtp" not in engine.cache
    prompt = np.random.default_rng(5).integers(0, 128, 9)
    logits = np.asarray(engine.prefill(["a"], [prompt]))[0]
    assert rel_err(logits, hf_reference(mtp_checkpoint.model).prefill("a", prompt).numpy()) <= FP32_TOL
    # the engine core (LLM, the server's engine) takes the same path
    (tmp_path / "config.json").write_text(json.dumps(mtp_checkpoint.config))
    llm = LLM(str(tmp_path), max_num_seqs=2, max_model_len=64, block_size=BLOCK, num_kv_blocks=8)
    assert not llm.engine.cfg.has_mtp and "mtp" not in llm.engine.replicas[0].runner.cache


# ---- forward -------------------------------------------------------------------------------------------------------
def _torch_head_outputs(ckpt, tokens: np.ndarray, next_token: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """HF's main-model hidden states (after its final norm) of one sequence, and the torch head's output and logits
    over it: position i pairs hidden state i with the embedding of token i + 1 (`next_token` after the last)."""
    model = ckpt.model
    ids = torch.as_tensor(tokens, dtype=torch.long)[None]
    shifted = torch.as_tensor(np.append(tokens[1:], next_token), dtype=torch.long)[None]
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
        positions = torch.arange(len(tokens))[None]
        rope = model.model.rotary_emb(hidden, positions)
        out = ckpt.head(model.model.embed_tokens(shifted), hidden, rope)
        logits = model.lm_head(out)
    return hidden[0].numpy(), out[0].numpy(), logits[0].numpy()


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_5"])
def test_mtp_forward_matches_the_torch_reference_over_a_ragged_batch_in_two_chunks(arch, mtp_checkpoints, rel_err):
    """Two sequences (13 and 6 tokens) through our main model for the head's input hidden states, then the head over
    them in two ragged chunks (9 + 4 and 4 + 2 tokens): the second chunk attends to the head's own KV pages written
    by the first. Logits and outputs match the torch head run over each whole sequence (in the second chunk, run
    with sample_index, the outputs of its sampled rows)."""
    mtp_checkpoint = mtp_checkpoints(arch)
    cfg = mtp_checkpoint.cfg
    assert cfg.mtp_is_moe == (arch == "qwen3_5_moe")
    params = load_params(cfg, SafetensorsSource(mtp_checkpoint.dir))
    ops = ops_for("reference")
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, cfg.vocab_size, 13), rng.integers(0, cfg.vocab_size, 6)]
    nexts = [int(t) for t in rng.integers(0, cfg.vocab_size, 2)]
    tables = [[1, 2], [3]]
    refs = [_torch_head_outputs(mtp_checkpoint, s, n) for s, n in zip(seqs, nexts, strict=True)]

    cache = decoder.init_cache(cfg, num_blocks=6, block_size=BLOCK, num_slots=3)
    batch = ragged([0, 0], [13, 6], [1, 2], tables, num_tokens=24, num_requests=3, table_width=2)
    tokens = np.zeros(24, np.int32)
    tokens[:13], tokens[13:19] = seqs
    _, cache, hidden = decoder.forward(params, cache, jnp.asarray(tokens), batch, cfg, ops, return_hidden=True)
    hidden = np.asarray(hidden)
    assert rel_err(hidden[:13], refs[0][0]) <= FP32_TOL and rel_err(hidden[13:19], refs[1][0]) <= FP32_TOL
    hidden_of = [hidden[:13], hidden[13:19]]
    shifted = [np.append(s[1:], n) for s, n in zip(seqs, nexts, strict=True)]

    step = jax.jit(mtp_forward, static_argnames=("cfg", "ops"))
    got_logits, got_out = [[], []], [[], []]
    for starts, lens, num_tokens, with_index in (([0, 0], [9, 4], 16, False), ([9, 4], [4, 2], 8, True)):
        chunk = ragged(starts, lens, [1, 2], tables, num_tokens=num_tokens, num_requests=3, table_width=2)
        x = np.zeros((num_tokens, cfg.hidden_size), np.float32)
        step_tokens = np.zeros(num_tokens, np.int32)
        rows = [np.arange(lens[0]), lens[0] + np.arange(lens[1])]
        for r in range(2):
            x[rows[r]] = hidden_of[r][starts[r]:starts[r] + lens[r]]
            step_tokens[rows[r]] = seqs[r][starts[r]:starts[r] + lens[r]]
        # what follows each request's last token here: its next prompt token, or the sampled one after the prompt
        following = [np.append(seqs[r], nexts[r])[starts[r] + lens[r]] for r in range(2)]
        ids = next_tokens_in_request(jnp.asarray(step_tokens), chunk, jnp.asarray(following + [7], jnp.int32))
        for r in range(2):
            np.testing.assert_array_equal(np.asarray(ids)[rows[r]], shifted[r][starts[r]:starts[r] + lens[r]])
        assert not np.asarray(ids)[sum(lens):].any()  # padding tokens
        index = jnp.asarray([rows[0][-1], rows[1][-1]], jnp.int32) if with_index else None
        logits, out, new_cache = step(params, cache, jnp.asarray(x), jnp.asarray(ids), chunk, cfg=cfg, ops=ops,
                                      sample_index=index)
        cache = new_cache
        logits, out = np.asarray(logits), np.asarray(out)
        for r in range(2):  # with sample_index only those rows are the head's output (the others skip the MoE)
            got_out[r].append(out[rows[r][-1:]] if with_index else out[rows[r]])
            got_logits[r].append(logits[r][None] if with_index else logits[rows[r]])
    for r, (_, ref_out, ref_logits) in enumerate(refs):
        first, last = got_out[r]  # the first chunk's rows, the second chunk's last (each sequence's last token)
        assert rel_err(first, ref_out[:len(first)]) <= FP32_TOL, f"request {r} head output, first chunk"
        assert rel_err(last, ref_out[-1:]) <= FP32_TOL, f"request {r} head output, second chunk"
        first = got_logits[r][0]
        assert rel_err(first, ref_logits[:len(first)]) <= FP32_TOL, f"request {r} logits, first chunk"
        assert rel_err(got_logits[r][1], ref_logits[-1:]) <= FP32_TOL, f"request {r} logits, second chunk"


def test_mtp_forward_of_a_model_without_the_head_is_an_error(checkpoints):
    cfg = from_hf_dict(checkpoints("qwen3_5_moe").config_for("float32"))
    with pytest.raises(ValueError, match="no MTP head"):
        mtp_forward({}, {}, jnp.zeros((1, cfg.hidden_size)), jnp.zeros(1, jnp.int32),
                    ragged([0], [1], [1], [[1]], 1, 1, 1), cfg, ops_for("reference"))


# ---- the engine ----------------------------------------------------------------------------------------------------
def test_engine_with_the_head_generates_what_it_generates_without_it(mtp_checkpoint, tmp_path):
    """The head is loaded (and its KV pages kept through every step program, prefix-cache restores included) but not
    used yet: greedy outputs equal those of the same weights without it, and dummy weights serve too."""
    without = tmp_path / "without"
    without.mkdir()
    shutil.copy(mtp_checkpoint.dir + "/model.safetensors", without / "model.safetensors")
    (without / "config.json").write_text(json.dumps(dict(mtp_checkpoint.config, mtp_num_hidden_layers=0)))
    args = dict(max_num_seqs=2, max_model_len=64, block_size=BLOCK, num_kv_blocks=16, num_snapshots=4)
    prompt = [int(t) for t in np.random.default_rng(8).integers(0, 128, 19)]
    greedy = SamplingParams(max_tokens=5, temperature=0.0)
    outputs = {}
    for name, directory, extra in (("head", mtp_checkpoint.dir, {}), ("none", str(without), {}),
                                   ("dummy", mtp_checkpoint.dir, {"load_format": "dummy"})):
        llm = LLM(directory, **args, **extra)
        runner = llm.engine.replicas[0].runner
        first, again = (llm.generate(prompt, greedy)[0] for _ in range(2))
        assert again.num_cached_tokens == 16  # a prefix-cache hit: its state snapshot restored into a slot
        outputs[name] = [first.token_ids, again.token_ids]
        has_head = name != "none"
        assert llm.engine.cfg.has_mtp == has_head and ("mtp" in runner.params) == has_head
        assert ("mtp" in runner.cache) == has_head, "a step program dropped the head's KV pages"
        if has_head:
            assert runner.cache["mtp"]["k"].shape == runner.cache["layers"][1]["k"].shape
    assert outputs["head"] == outputs["none"] and outputs["head"][0] == outputs["head"][1]
    assert all(len(tokens) == 5 for tokens in outputs["dummy"])
