"""GSM8K answer extraction: strict ("The answer is N") and flexible (last number), on awkward replies."""

from decimal import Decimal

import pytest

from qwen_jax.bench.gsm8k import (
    chain_of_thought,
    extract_flexible,
    extract_strict,
    normalize_number,
    reference_answer,
    score,
)

CASES = [
    # reply, strict, flexible
    ("She pays 3 * 6 = 18. The answer is 18.", "18", "18"),
    ("The answer is $1,234.50.", "1234.5", "1234.5"),
    ("It drops by 10 degrees. The answer is -10.", "-10", "-10"),
    ("The loss is -$5. The answer is -$5.", "-5", "-5"),
    ("The answer is $-7", "-7", "-7"),
    ("the answer is: 42", "42", "42"),
    ("The answer is 1,000,000.\n", "1000000", "1000000"),
    ("The answer is 18.00.", "18", "18"),
    ("First 5 then 7. The answer is 12. Actually 13.", "12", "13"),
    ("The answer is 3. The answer is 4.", "4", "4"),
    ("So he earns $18 every day.", None, "18"),
    ("That is .5 of it.", None, "0.5"),
    ("Total: 42.\n\nQ: What is 9 + 9?\nA: 18", None, "42"),
    ("The answer is 7<|im_end|> 99", "7", "7"),
    ("The answer is twelve.", None, None),
    ("no number here", None, None),
    ("", None, None),
]


@pytest.mark.parametrize("reply,strict,flexible", CASES)
def test_extraction(reply, strict, flexible):
    assert extract_strict(reply) == (None if strict is None else Decimal(strict))
    assert extract_flexible(reply) == (None if flexible is None else Decimal(flexible))


def test_normalize_number():
    assert normalize_number("$1,234") == 1234
    assert normalize_number("-$3.25") == Decimal("-3.25")
    assert normalize_number("12.") == 12
    assert normalize_number("abc") is None


def test_reference_answers_and_scoring():
    assert reference_answer("Some work <<2*3=6>>6\n#### 1,450,000") == 1450000
    assert reference_answer("#### -10") == -10
    assert score("The answer is 1,450,000.", Decimal(1450000)) == (True, True)
    assert score("She has 1450000 left.", Decimal(1450000)) == (False, True)
    assert score("The answer is 5. Then 6", Decimal(5)) == (True, False)
    with pytest.raises(ValueError):
        reference_answer("#### none")


def test_training_answer_becomes_one_cot_paragraph():
    answer = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 in all.\n#### 72"
    expected = "Natalia sold 48/2 = 24 clips in May. She sold 48+24 = 72 in all. The answer is 72."
    assert chain_of_thought(answer) == expected
