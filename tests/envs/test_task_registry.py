"""The one task table: bundled ids unchanged, a task registered here is reachable everywhere, duplicates refused."""

import gymnasium as gym
import pytest

import tokengym.envs
from tokengym.envs import ENV_GUIDE, ENV_IDS, TokenVectorEnv, register_envs, resolve_task
from tokengym.envs.tasks import TASK_SPECS, TASKS, ArithmeticTask, Task, register_task, unregister_task

BUNDLED = {  # id -> task name, in the order `tokengym envs` lists them
    "tokengym/Arithmetic-v0": "arithmetic",
    "tokengym/Reverse-v0": "reverse",
    "tokengym/Dataset-v0": "dataset",
    "tokengym/Target-v0": "target",
    "tokengym/ReasoningGym-v0": "reasoning_gym",
    "tokengym/Calculator-v0": "calculator",
    "tokengym/GuessNumber-v0": "guess_number",
    "tokengym/ToolCall-v0": "tool_call",
}
CLASSES = {"arithmetic": "ArithmeticTask", "reverse": "ReverseTask", "dataset": "DatasetTask", "target": "TargetTask",
           "reasoning_gym": "ReasoningGymTask", "calculator": "CalculatorTask", "guess_number": "GuessNumberTask",
           "tool_call": "ToolCallTask"}


class EchoTask(Task):
    """Say 'hi' to every prompt."""

    name = "echo_test"
    max_prompt_chars = 8

    def sample(self, rng):
        return {"prompt": f"p{int(rng.integers(10))}\n", "answer": "hi"}

    def reward(self):
        return lambda prompts, completions, **_: [float(c == "hi") for c in completions]


@pytest.fixture
def echo():
    """EchoTask registered as ``echo_test`` (id ``tokengym/EchoTest-v0``) for one test, then removed again."""
    register_task("echo_test", EchoTask, description="say hi", prompt_format="completion: hi", models="any",
                  kwargs={"max_new_tokens": 3})
    try:
        yield "tokengym/EchoTest-v0"
    finally:
        if "echo_test" in TASK_SPECS:
            unregister_task("echo_test")


def test_bundled_ids_names_and_order_are_todays():
    assert list(ENV_IDS) == list(BUNDLED) == list(ENV_GUIDE)
    assert {env_id: name for env_id, (name, _) in ENV_IDS.items()} == BUNDLED
    assert {k for k in gym.registry if k.startswith("tokengym/")} == set(BUNDLED)
    for env_id, name in BUNDLED.items():
        spec = gym.spec(env_id)
        assert spec.kwargs == {"task": name}
        assert (spec.entry_point, spec.vector_entry_point) == ("tokengym.envs.token_env:TokenEnv",
                                                               "tokengym.envs.vector_env:TokenVectorEnv")
        assert TASK_SPECS[name].cls.__name__ == CLASSES[name]
        if TASK_SPECS[name].kind != "data":  # the data tasks need data= or name=
            assert type(resolve_task(name)) is TASK_SPECS[name].cls
    assert all(all(ENV_GUIDE[k]) and ENV_IDS[k][1] for k in BUNDLED)  # every id has its guide lines


def test_a_registered_task_is_reachable_by_make_make_vec_and_resolve_task(echo):
    assert echo in ENV_IDS and ENV_IDS[echo] == ("echo_test", "say hi") and ENV_GUIDE[echo] == ("completion: hi", "any")
    assert "echo_test" in TASKS  # a procedural task by default
    env = gym.make(echo)
    assert isinstance(env.unwrapped.venv.task, EchoTask)
    assert env.unwrapped.venv.max_new_tokens == 3  # the id's default kwargs reach the env
    assert gym.make(echo, max_new_tokens=5).unwrapped.venv.max_new_tokens == 5  # and make's own win
    obs, _ = env.reset(seed=0)
    for ch in "hi":
        obs, reward, terminated, truncated, info = env.step(env.unwrapped.tokenizer.convert_tokens_to_ids(ch))
    obs, reward, terminated, truncated, info = env.step(env.unwrapped.tokenizer.eos_token_id)
    assert terminated and reward == 1.0
    venv = gym.make_vec(echo, num_envs=4, vectorization_mode="vector_entry_point", group_size=2)
    assert isinstance(venv, TokenVectorEnv) and isinstance(venv.task, EchoTask) and venv.max_new_tokens == 3
    assert isinstance(resolve_task("echo_test"), EchoTask)
    tokengym.envs.check_vector_env(venv)


def test_unregister_removes_every_view(echo):
    unregister_task("echo_test")
    assert echo not in gym.registry and echo not in ENV_IDS and "echo_test" not in TASKS
    with pytest.raises(ValueError, match="unknown task 'echo_test'"):
        resolve_task("echo_test")
    with pytest.raises(ValueError, match="no task named 'echo_test'"):
        unregister_task("echo_test")


def test_the_decorator_form_registers_and_returns_the_class():
    try:
        @register_task("echo_deco", description="say hi", kind="toy", env_id="tokengym/EchoDecorated-v1")
        class Deco(EchoTask):
            pass

        assert TASK_SPECS["echo_deco"].cls is Deco and TASK_SPECS["echo_deco"].env_id == "tokengym/EchoDecorated-v1"
        assert "tokengym/EchoDecorated-v1" in gym.registry and "echo_deco" not in TASKS  # toys are not TASKS
    finally:
        unregister_task("echo_deco")


@pytest.mark.parametrize("kw, error", [
    ({"name": "arithmetic"}, "task name 'arithmetic' is already registered (by ArithmeticTask)"),
    ({"name": "echo2", "env_id": "tokengym/Reverse-v0"}, "env id 'tokengym/Reverse-v0' is already registered"),
    ({"name": "reverse", "env_id": "tokengym/Other-v0"}, "task name 'reverse' is already registered"),
])
def test_a_duplicate_name_or_id_fails_in_one_line_and_changes_nothing(kw, error):
    before = (dict(TASK_SPECS), {k: gym.spec(k) for k in BUNDLED})
    with pytest.raises(ValueError) as e:
        register_task(cls=EchoTask, description="x", **kw)
    assert error in str(e.value) and "\n" not in str(e.value)
    assert (dict(TASK_SPECS), {k: gym.spec(k) for k in BUNDLED}) == before
    assert "tokengym/Other-v0" not in gym.registry


def test_bad_registrations_name_the_problem():
    with pytest.raises(TypeError, match="'plain': <class 'object'> is not a subclass of tokengym.envs.Task"):
        register_task("plain", object, description="x")
    with pytest.raises(ValueError, match="kind must be one of"):
        register_task("echo3", EchoTask, description="x", kind="nope")
    with pytest.raises(ValueError, match="non-empty string"):
        register_task("", EchoTask, description="x")
    assert not {"plain", "echo3", ""} & set(TASK_SPECS)


def test_register_envs_restores_a_missing_id():
    spec = gym.registry.pop("tokengym/Target-v0")
    try:
        register_envs()
        assert gym.spec("tokengym/Target-v0").kwargs == spec.kwargs == {"task": "target"}
    finally:
        gym.registry.setdefault("tokengym/Target-v0", spec)


def test_tasks_is_the_procedural_part_of_the_table():
    assert TASKS["arithmetic"] is ArithmeticTask
    assert set(TASKS) == {n for n, s in TASK_SPECS.items() if s.kind == "procedural"} == {
        "arithmetic", "reverse", "calculator", "guess_number", "tool_call"}


def test_register_task_bare_or_without_a_description_takes_defaults():
    """``@register_task`` on a class (name from the class, description its docstring's first line), and a name
    without ``description=``, register instead of failing with a TypeError at import."""
    try:
        @register_task
        class SortLettersTask(EchoTask):
            """Sort the letters.

            More text that is not the description."""

            name = "task"  # Task's default: the class name gives the task's name

        @register_task("echo_named")
        class Named(EchoTask):
            pass  # no docstring of its own: EchoTask's is not this class's description

        assert TASK_SPECS["sort_letters"].cls is SortLettersTask
        assert ENV_IDS["tokengym/SortLetters-v0"] == ("sort_letters", "Sort the letters.")
        assert TASK_SPECS["echo_named"].cls is Named
        assert TASK_SPECS["echo_named"].description == f"Named from {__name__}"
        assert register_task(cls=EchoTask, name="echo_kw", description="x") is EchoTask  # keywords still work
    finally:
        for name in ("sort_letters", "echo_named", "echo_kw"):
            if name in TASK_SPECS:
                unregister_task(name)


def test_register_task_bare_takes_the_classs_own_name():
    try:
        @register_task()
        class Whatever(EchoTask):
            """Echo again."""

            name = "echo_own"

        assert TASK_SPECS["echo_own"].env_id == "tokengym/EchoOwn-v0" and TASK_SPECS["echo_own"].description == "Echo again."
    finally:
        if "echo_own" in TASK_SPECS:
            unregister_task("echo_own")
