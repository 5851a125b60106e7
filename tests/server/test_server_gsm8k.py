"""The GSM8K evaluator's plumbing end to end against the real server on the built-in random model: every question
is asked and answered without error, replies are cut at the stop strings, and the accuracies are computed.
The score itself is meaningless on random weights; only the path is checked.
"""

from qwen_jax.bench import gsm8k


def test_gsm8k_evaluator_runs_against_the_built_in_model(server, shared_data):
    result = gsm8k.evaluate(server.url, "qwen-jax-test", limit=2, shots=1, max_tokens=16, concurrency=2,
                            timeout_s=120.0, test_path=str(shared_data / "gsm8k" / "test.jsonl"),
                            train_path=str(shared_data / "gsm8k" / "train.jsonl"))
    assert result["num_questions"] == 2
    assert result["errors"] == 0, [r["error"] for r in result["records"]]
    assert 0.0 <= result["flexible_accuracy"] <= 1.0 and 0.0 <= result["strict_accuracy"] <= 1.0
    for record in result["records"]:
        assert "Q:" not in record["reply"] and "<|im_end|>" not in record["reply"]
        assert record["gold"].lstrip("-").replace(".", "").isdigit()
