"""scripts/kernel_parity.py: on a tiny hybrid Qwen3.5-MoE in float32 (random weights, the Pallas kernels interpreted
on the CPU) the gpu engine agrees with the reference step for step, far below the error a wiped recurrent state
gives; its report tells near-tie flips from real errors.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from support import load_script

from qwen_jax.default_model import TEXT_CONFIG

STEPS = 5
PROMPT_LENS = [40, 9]  # 40 tokens: the prefill spans two 32-token GDN chunks of the prefill kernel

kernel_parity = load_script("kernel_parity")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, dict]:
    """(the report main returns, the JSON it wrote) for a 2-layer (GDN + attention) MoE model. Weights of std 0.1,
    not the dummy 0.02: at hidden size 64 the layers then move the logits about as much as at the real model's 2,048
    (with 0.02, wiping the GDN state moved them by 1e-4 only, so no state bug could show)."""
    model = tmp_path_factory.mktemp("tiny_hybrid_moe")
    config = dict(TEXT_CONFIG, vocab_size=300, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    (model / "config.json").write_text(json.dumps(config))
    out = model / "parity.json"
    report = kernel_parity.main(["--model", str(model), "--steps", str(STEPS), "--prompts", "2",
                                 "--prompt-lens", ",".join(map(str, PROMPT_LENS)), "--dtype", "float32",
                                 "--init-scale", "0.1", "--out", str(out)])
    return report, json.loads(out.read_text())


def test_teacher_forced_gpu_logits_match_the_reference_at_every_step(run):
    tf = run[0]["teacher_forced"]
    assert tf["steps_compared"] == len(PROMPT_LENS) * (STEPS + 1)
    assert tf["top1_agreement"] == 1.0 and tf["disagreements"] == 0
    assert 0 < tf["max_rel_err"] < 1e-4  # different code (not the reference twice), float32-close
    assert tf["max_lsm_diff"] < 1e-4
    assert max(tf["prefill"]["rel_err"]) < 1e-4 and all(tf["prefill"]["top1_agree"])
    assert tf["reference_rerun_top1_matches"] and tf["reference_rerun_max_margin_diff"] == 0.0
    assert [len(row) for row in tf["per_step"]["rel_err"]] == [STEPS + 1] * len(PROMPT_LENS)
    assert tf["rel_err_first_window"]["steps"] == [1, STEPS]


def test_kernel_errors_sit_far_below_what_a_lost_context_or_state_gives(run):
    report = run[0]
    controls = report["controls"]
    assert min(controls["context"]["rel_diff"]) > 0.1
    assert max(controls["gdn_state_wiped"]["rel_diff"]) > 100 * report["teacher_forced"]["max_rel_err"]
    nudge = controls["embedding_one_ulp"]  # float32: one ulp of the embeddings moves the logits by ~1e-7
    assert nudge["steps"] == STEPS and nudge["top1_agreement"] == 1.0 and 0 < max(nudge["prefill_rel_diff"]) < 1e-5


def test_free_running_gpu_tokens_equal_the_reference_tokens(run):
    report = run[0]
    free = report["free_running"]
    assert free["identical"] == [True, True] and free["first_divergence_step"] == [None, None]
    tokens = np.array(report["reference"]["tokens"])
    assert tokens.shape == (len(PROMPT_LENS), STEPS + 1)
    assert report["gpu"]["tokens"] == report["reference"]["tokens"]
    assert report["prompt_lens"] == PROMPT_LENS
    assert report["reference"]["ms_per_decode_step"] > 0 and report["gpu"]["ms_per_decode_step"] > 0


def test_the_json_written_is_the_report_returned(run):
    assert run[1] == json.loads(json.dumps(run[0]))


def test_report_tells_a_near_tie_flip_from_a_wrong_top1_and_shows_error_growth():
    """Synthetic logits over 70 decode steps: the gpu's error grows with the step; at step 10 it flips a near-tie
    (reference margin 0.001), at step 50 it picks a token the reference ranks about 10 logits below its top-1."""
    rng = np.random.default_rng(0)
    steps, vocab = 70, 50
    ref = rng.normal(size=(steps + 1, 1, vocab)).astype(np.float32)
    ref[:, 0, 0], ref[:, 0, 1] = 10.0, 9.0
    ref[10, 0, 1] = 9.999
    gpu = ref + 1e-4 * (1 + np.arange(steps + 1))[:, None, None] * rng.normal(size=ref.shape).astype(np.float32)
    gpu[10, 0, 1] = gpu[10, 0, 0] + 0.002
    gpu[50, 0, 2] = 11.0
    per_step = [jax.device_get(kernel_parity._compare(r, g)) for r, g in zip(ref, gpu)]
    stats = {k: np.stack([s[k] for s in per_step], 1) for k in per_step[0]}
    tf = kernel_parity._teacher_forced_report(stats, stats["ref_top1"], stats["ref_margin"])
    assert tf["disagreements"] == 2
    # step 50's large error does not raise the noise level that excuses it: only step 10 is a near-tie
    assert tf["lsm_noise"] < 0.1 < tf["max_lsm_diff"]
    assert tf["disagreements_with_ref_margin_below_noise"] == tf["disagreements_with_ref_deficit_below_noise"] == 1
    flips = {d["step"]: d for d in tf["disagreement_list"]}
    assert flips[10]["ref_margin"] == pytest.approx(0.001, abs=1e-4)
    assert flips[50]["ref_deficit"] == pytest.approx(10.0 - ref[50, 0, 2], abs=1e-4)
    assert tf["agreement_where_ref_margin_above_noise"] < 1.0
    assert [w["steps"] for w in tf["rel_err_windows"]] == [[1, 32], [33, 64], [65, 70]]
    assert tf["rel_err_last_window"]["mean"] > 3 * tf["rel_err_first_window"]["mean"]
