"""scripts/train_mtp_model.py on a tiny model on the CPU: the losses fall, the checkpoint holds the main model and the
MTP head under the real checkpoint's names, HF and the engine's loader read it, and `--eval` counts drafts.

Two training examples in one batch, so every step sees the same tokens and the loss curve is comparable step to step.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support import load_script, shared_data
from transformers import Qwen3_5MoeForCausalLM

from qwen_jax.config import from_hf_dict
from qwen_jax.weights import load_params, open_checkpoint

STEPS = 6

# One full-attention Qwen3.5-MoE decoder layer, as `model.layers.3.*` and `mtp.layers.0.*` name it in the real
# checkpoint (transformers 5's fused expert tensors).
DECODER_LAYER = {
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.shared_expert_gate.weight",
    "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight", "mlp.shared_expert.down_proj.weight",
}
MTP_NAMES = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
             "mtp.norm.weight"} | {f"mtp.layers.0.{name}" for name in DECODER_LAYER}

script = load_script("train_mtp_model")
DATA = ["--tokenizer", str(shared_data("qwen3_5_tokenizer")), "--gsm8k", str(shared_data("gsm8k"))]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple:
    """(trained model, trained head, report, checkpoint dir) of a 6-step tiny run."""
    out = tmp_path_factory.mktemp("tiny_mtp") / "checkpoint"
    args = script.parse_args(["--tiny", "--out", str(out), "--steps", str(STEPS), "--batch-size", "2",
                              "--train-examples", "2", "--max-len", "64", "--heldout", "2", "--eval-every", "3",
                              *DATA])
    model, head, report = script.train(args)
    script.save_checkpoint(model, head, out, Path(args.tokenizer), report)
    return model, head, report, out


def test_training_lowers_both_losses_on_the_repeated_batch(trained):
    curve = trained[2]["curve"]
    assert [point["step"] for point in curve] == list(range(STEPS))
    assert curve[-1]["main"] < curve[0]["main"] - 0.1
    assert curve[-1]["mtp"] < curve[0]["mtp"] - 0.1
    heldout = trained[2]["heldout"]
    assert [point["step"] for point in heldout] == [2, 5]
    assert all(0 <= point["mtp_top1"] <= 1 and point["mtp_loss"] > 0 for point in heldout)


def test_checkpoint_names_every_tensor_as_the_real_checkpoint_does(trained):
    out = trained[3]
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        dtypes = {f.get_slice(name).get_dtype() for name in names}
    main_layer = {name for name in names if name.startswith("model.layers.1.")}  # the tiny model's attention layer
    assert {name.removeprefix("model.layers.1.") for name in main_layer} == DECODER_LAYER
    assert {name for name in names if name.startswith("mtp.")} == MTP_NAMES  # embedding and LM head are shared
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= names
    assert any(name.startswith("model.layers.0.linear_attn.") for name in names)
    assert dtypes == {"BF16"}
    config = json.loads((out / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1 and config["torch_dtype"] == "bfloat16"
    assert config["architectures"] == ["Qwen3_5MoeForCausalLM"] and config["tie_word_embeddings"] is False
    assert config["layer_types"] == ["linear_attention", "full_attention"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [248046, 248044]
    assert (out / "tokenizer.json").exists() and (out / "chat_template.jinja").exists()


def test_hf_loads_the_main_model_with_the_trained_logits_and_the_head_with_its_drafts(trained):
    model, head, _, out = trained
    loaded, loaded_head = script.load_checkpoint(out, torch.device("cpu"))
    trained_bf16 = copy.deepcopy(model).to(torch.bfloat16).eval()
    trained_head_bf16 = copy.deepcopy(head).to(torch.bfloat16).eval()
    ids = torch.tensor([[248045, 882, 198, 3838, 374, 220, 17, 10, 18, 30, 248046, 198]])
    with torch.no_grad():
        expected = trained_bf16(input_ids=ids).logits
        assert torch.equal(loaded(input_ids=ids).logits, expected)
        assert torch.equal(Qwen3_5MoeForCausalLM.from_pretrained(out, dtype=torch.bfloat16)(input_ids=ids).logits,
                           expected)
        hidden = trained_bf16.model(input_ids=ids).last_hidden_state
        drafts = trained_head_bf16(trained_bf16, hidden[:, :-1], ids[:, 1:])
        assert torch.equal(loaded_head(loaded, hidden[:, :-1], ids[:, 1:]), drafts)
        # The head is causal: changing the last token moves no earlier draft.
        changed = ids.clone()
        changed[0, -1] = 17
        moved = trained_head_bf16(trained_bf16, hidden[:, :-1], changed[:, 1:])
        assert torch.equal(moved[:, :-1], drafts[:, :-1]) and not torch.equal(moved[:, -1], drafts[:, -1])


def test_the_engine_loader_reads_the_main_model(trained):
    config, source = open_checkpoint(str(trained[3]))
    cfg = from_hf_dict(config)
    assert cfg.num_experts == 4 and cfg.layer_types == ("linear_attention", "full_attention")
    params = load_params(cfg, source)
    assert params["embed"].shape == (script.VOCAB_SIZE, 32)


def test_eval_counts_one_draft_per_output_token_after_the_first(trained):
    report = script.main(["--eval", str(trained[3]), "--eval-prompts", "2", "--max-new-tokens", "6", *DATA])
    assert report["prompts"] == 2
    assert report["drafted"] == sum(p["output_tokens"] - 1 for p in report["per_prompt"])
    assert report["drafted"] == sum(p["drafted"] for p in report["per_position"])
    assert 0 <= report["accepted"] <= report["drafted"]
    assert report["acceptance_length_k1"] == 1 + report["accepted"] / report["drafted"]
