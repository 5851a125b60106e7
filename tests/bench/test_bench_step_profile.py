"""qwen_jax.bench.step_profile on a tiny hybrid MoE model with an MTP head on the CPU: the served step of fake decode
rows (several decode steps a program for a small batch, one for a larger, as the engine runs them) and of a prefill
runs one step ahead and is timed; speculative decoding's verify step (step.verify_step on a runner that drafts k) and
that runner's plain step (the head's draft_step after it) are timed per batch and k; each measurement prints as one
JSON line whose first key names it (scripts/device_bench_suite.sh greps those). Its numbers only mean something on a
GPU.
"""

from __future__ import annotations

import json

import pytest

from qwen_jax.bench import step_profile
from qwen_jax.default_model import TEXT_CONFIG

CONFIG = dict(TEXT_CONFIG, vocab_size=300, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
              mtp_num_hidden_layers=1)


def test_step_profile_times_decode_verify_and_prefill_steps_and_each_layer_kind(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    report = step_profile.main(["--config", str(tmp_path / "config.json"), "--batches", "2,9", "--context", "20",
                                "--prefill", "24", "--steps", "2", "--num-scheduler-steps", "3", "--verify", "1,0",
                                "--profile", "4"])
    assert [(row["decode_batch"], row["decode_steps"]) for row in report["decode"]] == [(2, 3), (9, 1)]
    assert all(row["token_ms"] == pytest.approx(row["step_ms"] / row["decode_steps"], abs=1e-3)
               for row in report["decode"])
    assert [(row["verify_batch"], row["draft_tokens"]) for row in report["verify"]] == [(2, 0), (9, 0), (2, 1), (9, 1)]
    for row in report["verify"]:
        # a verify runner compiles its programs up front: the first step can take under 5 ms (0.0 s rounded)
        assert row["step_ms"] > 0 and row["compile_and_first_s"] >= 0 and row["gpu_ms"] >= 0
        assert set(row["host_ms"]) == {"prepare", "issue", "wait"}
        # no kernel events on the CPU: the tables are there, empty
        assert row["profile"]["top_kernels"] == row["profile"]["top_kernel_families"] == []
        # k > 0: the rounds one program runs for that many rows, as the engine runs them (several for a few rows)
        assert row["rounds"] == (6 if row["draft_tokens"] and row["verify_batch"] == 2 else 1)
        if row["draft_tokens"]:
            assert row["round_ms"] == pytest.approx(row["step_ms"] / row["rounds"], abs=1e-3)
    assert [row["prefill_tokens"] for row in report["prefill"]] == [24]
    for row in report["decode"] + report["prefill"]:
        assert row["step_ms"] > 0 and row["compile_and_first_s"] > 0
        assert set(row["host_ms"]) == {"prepare", "issue", "wait"}
    assert all(row["roofline_ms"] >= 0 for row in report["decode"])
    assert report["prefill"][0]["tokens_per_s"] > 0
    assert [row["layer_batch"] for row in report["layers"]] == [2, 9]
    assert all(row["gdn_ms"] > 0 and row["attention_ms"] > 0 for row in report["layers"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [next(iter(line)) for line in lines[:-1]] == ["mesh", "decode_batch", "decode_batch", "prefill_tokens",
                                                         "layer_batch", "layer_batch", *["verify_batch"] * 4]
    assert lines[-1] == report


def test_verify_rows_need_a_config_with_an_mtp_head(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(CONFIG, mtp_num_hidden_layers=0)))
    with pytest.raises(ValueError, match="MTP head"):
        step_profile.main(["--config", str(tmp_path / "config.json"), "--batches", "2", "--verify", "0,1"])
