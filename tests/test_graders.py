"""The built-in graders against slime's: `--rm-type math` (MATH normalisation), `--rm-type f1` (SQuAD / HotpotQA).

Cases are slime's behaviour, read from its source: slime/rollout/rm_hub/math_utils.py (`grade_answer_verl`,
`mathd_normalize_answer` / `_strip_string`: the comments there name \\frac12, ^\\circ, \\text{…}, " .5", "k = ", sqrt3,
0.5 → \\frac{1}{2}, a/b) and slime/rollout/rm_hub/__init__.py (`async_rm`: "math" grades the boxed answers, "f1"
returns `f1_score(response, label)[0]` of a (f1, precision, recall) triple). THUDM/slime ships no unit tests of these
functions; the boxed-answer cases below are those of a fork's tests/test_math_reward_utils.py (cklxx/slime).
"""
from __future__ import annotations

import pytest

from engine.math_grader import label_answer, last_boxed, normalize
from engine.rewards import f1_reward, math_reward, squad_normalize

# (response, label): slime scores 1 — and so does rollflow
SLIME_EQUAL = [
    ("so \\boxed{\\frac12}", "\\frac{1}{2}"),  # \frac12 → \frac{1}{2}
    ("\\boxed{\\frac12}", "1/2"),  # a/b → \frac{a}{b}
    ("\\boxed{0.5}", "\\frac{1}{2}"),  # 0.5 → \frac{1}{2}
    ("\\boxed{45^\\circ}", "45"),  # degrees
    ("\\boxed{45^{\\circ}}", "45"),
    ("\\boxed{\\text{Evelyn}}", "Evelyn"),  # an enclosing \text{}
    ("\\boxed{5}", "\\boxed{5}"),  # a boxed label is read like the response
    ("the answer: \\boxed{\\sqrt3}", "\\sqrt{3}"),  # sqrt3 → sqrt{3}
    ("\\boxed{5 \\text{ cm}}", "5"),  # a unit after "\text{ "
    ("\\boxed{\\$10}", "10"),  # dollars
    ("\\boxed{50\\%}", "50"),  # percent
    ("\\boxed{.5}", "0.5"),  # a leading "."
    ("\\boxed{x = 3}", "3"),  # a short left-hand side
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)"),  # \left, \right, spaces
    ("\\boxed{\\dfrac{3}{4}}", "\\tfrac34"),
    ("Reasoning steps...\nAnswer: \\boxed{25}", "25"),  # cklxx/slime tests/test_math_reward_utils.py
    ("Answer: \\boxed{0}", 0),  # (a zero ground truth, given as an int)
]

# slime scores 0 — and so does rollflow
SLIME_UNEQUAL = [
    ("\\boxed{\\frac{1}{3}}", "1/2"),
    ("\\boxed{46}", "45^\\circ"),
    ("\\boxed{\\text{Eve}}", "Evelyn"),
    ("\\boxed{7}", "\\boxed{8}"),
]


@pytest.mark.parametrize("response,label", SLIME_EQUAL)
def test_math_scores_what_slime_scores_correct(response, label):
    assert math_reward(response, label) == 1.0


@pytest.mark.parametrize("response,label", SLIME_UNEQUAL)
def test_math_scores_what_slime_scores_wrong(response, label):
    assert math_reward(response, label) == 0.0


def test_where_rollflow_is_deliberately_more_lenient_than_slime():
    # slime grades only boxed answers (0 here); rollflow falls back on the response's last number
    assert math_reward("the total is 42.", "42") == 1.0
    # slime keeps unreduced fractions apart (2/4 ≠ 1/2 in grade_answer_sympy); rollflow's sympy check does not
    assert math_reward("\\boxed{2/4}", "1/2") == 1.0


def test_the_normalisation_steps():
    assert normalize("\\frac1{72}") == "\\frac{1}{72}" and normalize("\\frac{72}1") == "\\frac{72}1"
    assert normalize("\\dfrac{1}{2}") == normalize("1/2") == normalize("0.5") == "\\frac{1}{2}"
    assert normalize("k = \\sqrt2") == "\\sqrt{2}" and normalize("xyz = 3") == "xyz=3"  # ≤ 2 characters only
    assert normalize("{.5}") == "{0.5}" and normalize("3/04") == "3/04"  # not a plain a/b
    assert last_boxed("\\boxed{a} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}" and last_boxed("none") is None
    assert last_boxed("\\fbox{7}") == "7" and last_boxed("\\boxed{unclosed") is None
    assert label_answer("The answer is \\boxed{12}.") == "12" and label_answer(12) == "12"


# ---- F1 --------------------------------------------------------------------------------------------------------
def test_f1_normalises_like_squad_and_returns_precision_and_recall():
    assert squad_normalize("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"
    # pred "eiffel tower" vs gold "eiffel tower in paris": P = 2/2, R = 2/4 → F1 = 2·1·0.5/1.5 = 2/3
    got = f1_reward("The Eiffel Tower.", "the Eiffel tower in Paris")
    assert got == {"score": pytest.approx(2 / 3), "precision": 1.0, "recall": 0.5}
    assert f1_reward("An apple", "apple") == {"score": 1.0, "precision": 1.0, "recall": 1.0}  # article dropped


def test_f1_yes_no_answers_score_only_when_they_match():
    assert f1_reward("yes", "no")["score"] == 0.0
    assert f1_reward("Yes.", "yes")["score"] == 1.0
    assert f1_reward("yes it is", "yes")["score"] == 0.0  # HotpotQA: a yes/no label needs exactly yes/no
    assert f1_reward("", "the cat")["score"] == 0.0
