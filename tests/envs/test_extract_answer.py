"""``Task.extract_answer``: the answer maj@k votes on is the one the task's reward reads (a hand-computed table, and
the reward agreeing with it on every row)."""

import pytest

from tokengym.envs.tasks import ArithmeticTask, CalculatorTask, ReverseTask, ToolCallTask

TASKS = {"completion": ArithmeticTask(), "chat": ArithmeticTask(chat=True), "few_shot": ArithmeticTask(few_shot=2),
         "tool_call": ToolCallTask(operators="+*"), "calculator": CalculatorTask(), "reverse": ReverseTask()}

TABLE = [  # (task, completion, the answer by hand, the reference the reward compares with)
    ("completion", "12+7=19\n19+30=49\nA: 49", 49, 49),
    ("completion", "A = 49.", 49, 49),  # the same vote as the row above
    ("completion", "A: +49", 49, 49),
    ("completion", "A: 48\nA: 49", 49, 49),  # the last answer line
    ("completion", "19+30=49\n49", 49, 49),  # no answer line: a last line that is a number
    ("completion", "3-8=-5\nA: -5", -5, -5),
    ("completion", "A: 4 9", None, 49),
    ("completion", "12+7=19", None, 19),
    ("completion", "", None, 1),
    ("chat", "17 + 25 = 42", 42, 42),
    ("chat", "The answer is **42**.", 42, 42),
    ("chat", "so \\boxed{-7}", -7, -7),
    ("chat", "Answer: 1,234 apples", 1234, 1234),
    ("chat", "no digits", None, 3),
    ("few_shot", "42\n", 42, 42),
    ("few_shot", "42", 42, 41),
    ("few_shot", "42\n\n17+3=20", 42, 42),  # a base model goes on past "\n\n" (one Gemma token): the first line answers
    ("few_shot", "\n42", None, 42),
    ("tool_call", '{"expression":"12+7"}', 19, 19),
    ("tool_call", '{"expression":"2*3+4"}', 10, 10),  # the call's value, not its text
    ("tool_call", '{"expression": "12+7"} extra', None, 19),
    ("tool_call", "A: 19", None, 19),
    ("calculator", "<calc>12+7</calc>=19\n<calc>19+30</calc>=49\nA: 49", 49, 49),
    ("reverse", "dcba\n", "dcba", "dcba"),
    ("reverse", " dcb ", "dcb", "dcba"),
    ("reverse", "  \n", None, "dcba"),
]


@pytest.mark.parametrize("task, completion, expected, reference", TABLE)
def test_extract_answer_table_and_the_reward_agrees(task, completion, expected, reference):
    t = TASKS[task]
    got = t.extract_answer(completion)
    assert got == expected and type(got) is type(expected)
    score = t.reward()(["p"], [completion], answer=[reference])[0]
    assert (score == 1.0) == (got == reference)  # correct exactly when the extracted answer is the reference
