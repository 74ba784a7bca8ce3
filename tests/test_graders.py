"""The built-in graders against slime's: `--rm-type math` (MATH normalisation), `--rm-type f1` (SQuAD / HotpotQA),
`--rm-type deepscaler` (slime/rollout/rm_hub/deepscaler.py) and `--rm-type dapo` (rm_hub/math_dapo_utils.py).

Cases are slime's behaviour, read from its source: slime/rollout/rm_hub/math_utils.py (`grade_answer_verl`,
`mathd_normalize_answer` / `_strip_string`: the comments there name \\frac12, ^\\circ, \\text{…}, " .5", "k = ", sqrt3,
0.5 → \\frac{1}{2}, a/b) and slime/rollout/rm_hub/__init__.py (`async_rm`: "math" grades the boxed answers, "f1"
returns `f1_score(response, label)[0]` of a (f1, precision, recall) triple). THUDM/slime ships no unit tests of these
functions; the boxed-answer cases below are those of a fork's tests/test_math_reward_utils.py (cklxx/slime).
"""
from __future__ import annotations

import pytest

from engine.math_grader import label_answer, last_boxed, normalize
from engine.rewards import (RewardModel, dapo_normalize, dapo_reward, deepscaler_reward, f1_reward, math_reward,
                            squad_normalize)
from engine.samples import Sample

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


# ---- deepscaler, dapo -------------------------------------------------------------------------------------------
def test_deepscaler_grades_the_boxed_answer_after_the_thinking_only():
    """slime's get_deepscaler_rule_based_reward: the solution is what follows the last </think> (else the first
    "###Response"); nothing without either, without a boxed answer there, or against an empty label."""
    assert deepscaler_reward("<think>maybe \\boxed{3}</think>so \\boxed{\\frac12}", "0.5") == 1.0
    assert deepscaler_reward("<think>\\boxed{4}</think>so \\boxed{3}", "4") == 0.0  # the thinking's box is not it
    assert deepscaler_reward("\\boxed{4}", "4") == 0.0  # no </think>: nothing to grade
    assert deepscaler_reward("###Response the answer is \\boxed{4}", "4") == 1.0
    assert deepscaler_reward("<think>x</think>it is 4", "4") == 0.0  # no boxed answer (math would read "4")
    assert deepscaler_reward("<think>x</think>\\boxed{7}", "\\boxed{7}") == 1.0  # a boxed label's content
    assert deepscaler_reward("<think>x</think>\\boxed{7}", "") == 0.0


def test_dapo_reads_the_last_answer_line_and_scores_plus_or_minus_one():
    """DAPO's compute_score: the last "Answer: …" in the response's last 300 characters, normalised, against the
    integer label; 1.0 or -1.0."""
    assert dapo_reward("Let me think.\nAnswer: 34", "34") == 1.0
    assert dapo_reward("Answer: 12\nno wait\nAnswer: 34", 34) == 1.0  # the last one; an int label
    assert dapo_reward("Answer: 35", "34") == -1.0
    assert dapo_reward("the answer is 34", "34") == -1.0  # no "Answer:" line
    assert dapo_reward("Answer: 34" + "." * 300, "34") == -1.0  # outside the last 300 characters
    assert dapo_reward("answer:  $1{,}000$ dollars", "1000") == 1.0  # case, $…$, {,}, units
    assert dapo_reward("Answer: x = 5", "5.0") == 1.0  # after the last "=", the label as an integer
    assert dapo_normalize("\\text{(A)}") == "(A)" and dapo_normalize("\\frac12") == "\\frac{1}{2}"
    assert dapo_reward("Answer: \\frac{1}{2}", "\\frac12") == 1.0  # a label that is no number: its text


def test_the_new_rm_types_score_through_the_reward_model_and_a_rows_metadata():
    """--rm-type deepscaler / dapo reach the reward model, and a row's metadata may name them (slime's
    per-sample rm_type); boxed_ does not apply to them."""
    from engine.rewards import SAMPLE_RM_TYPES, rule_based

    def scored(rm_type, response, label, metadata=None):
        s = Sample(index=0, group_index=0, rollout_id=0, prompt="q", response=response, label=label,
                   metadata=metadata or {})
        RewardModel(rm_type, None).score_group([s])
        return s.reward

    assert scored("deepscaler", "<think>…</think>\\boxed{9}", "9") == 1.0
    assert scored("dapo", "Answer: 9", "9") == 1.0 and scored("dapo", "Answer: 8", "9") == -1.0
    assert scored("exact_match", "Answer: 9", "9", {"rm_type": "dapo"}) == 1.0
    assert {"deepscaler", "dapo"} <= set(SAMPLE_RM_TYPES) and "boxed_dapo" not in SAMPLE_RM_TYPES
    assert rule_based("boxed_deepscaler") is None
