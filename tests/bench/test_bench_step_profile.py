"""qwen_jax.bench.step_profile on a tiny hybrid MoE model on the CPU: the served step of fake decode rows (several
decode steps a program for a small batch, one for a larger, as the engine runs them), of speculative verify rows
(several query tokens a decoding row) and of a prefill runs one step
ahead and is timed, and each measurement prints as one JSON line whose first key names it
(scripts/device_final_check.sh greps those). Its numbers only mean something on a GPU.
"""

from __future__ import annotations

import json

import pytest

from qwen_jax.bench import step_profile
from qwen_jax.default_model import TEXT_CONFIG


def test_step_profile_times_decode_and_prefill_steps_and_each_layer_kind(tmp_path, capsys):
    config = dict(TEXT_CONFIG, vocab_size=300, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    report = step_profile.main(["--config", str(tmp_path / "config.json"), "--batches", "2,9", "--context", "20",
                                "--prefill", "24", "--steps", "2", "--num-scheduler-steps", "3", "--verify", "0,2"])
    assert [(row["decode_batch"], row["decode_steps"]) for row in report["decode"]] == [(2, 3), (9, 1)]
    assert all(row["token_ms"] == pytest.approx(row["step_ms"] / row["decode_steps"], abs=1e-3)
               for row in report["decode"])
    assert [(row["verify_batch"], row["draft_tokens"]) for row in report["verify"]] == [(2, 0), (2, 2), (9, 0), (9, 2)]
    assert all(row["step_ms"] > 0 and row["gpu_ms"] >= 0 for row in report["verify"])
    assert [row["prefill_tokens"] for row in report["prefill"]] == [24]
    for row in report["decode"] + report["prefill"]:
        assert row["step_ms"] > 0 and row["compile_and_first_s"] > 0
        assert set(row["host_ms"]) == {"prepare", "issue", "wait"}
    assert all(row["roofline_ms"] >= 0 for row in report["decode"])
    assert report["prefill"][0]["tokens_per_s"] > 0
    assert [row["layer_batch"] for row in report["layers"]] == [2, 9]
    assert all(row["gdn_ms"] > 0 and row["attention_ms"] > 0 for row in report["layers"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [next(iter(line)) for line in lines[:-1]] == ["mesh", "decode_batch", "decode_batch", *["verify_batch"] * 4,
                                                         "prefill_tokens", "layer_batch", "layer_batch"]
    assert lines[-1] == report
