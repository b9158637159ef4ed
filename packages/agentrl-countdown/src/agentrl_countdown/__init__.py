"""Countdown: reach a target number with given numbers and + - * /.

The whole environment is the one class below plus the entry point in this package's
pyproject.toml (`countdown = "agentrl_countdown:CountdownEnv"` in group `agentrl.envs`): that is
all it takes to plug an environment into agentrl.

Puzzles are deterministic: task `countdown-<seed>-<index>` always has the same numbers and
target, on any machine, because the generator is seeded with that string. Every target is built
from the task's own numbers, so every task has a solution.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from fractions import Fraction

from agentrl.envs.base import Action, Observation, State

_TASK_ID = re.compile(r"^countdown-(\d+)-(\d+)$")
# Guards ast.parse against pathological input (deep nesting); a real answer is a few dozen chars.
_MAX_EXPRESSION_CHARS = 256
_MAX_TARGET = 1000
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class CountdownEnv:
    """A verifiable, non-terminal environment: one arithmetic answer per step.

    The answer is read from `Action.text`; terminal-shaped actions (`command`, `keystrokes`) are
    read the same way, so the agent's bash-block and Terminus formats both drive it. A correct
    answer ends the episode; a wrong or invalid one is explained and may be retried until
    `max_attempts` answers were given. `score()` gives reward 1.0 if some answer was valid, used
    each number at most once and equalled the target, else 0.0.
    """

    def __init__(
        self,
        num_tasks: int = 1000,
        seed: int = 0,
        num_numbers: int = 4,
        max_number: int = 25,
        max_attempts: int = 3,
    ):
        for name, value, low in (
            ("num_tasks", num_tasks, 1),
            ("num_numbers", num_numbers, 2),
            ("max_number", max_number, 2),
            ("max_attempts", max_attempts, 1),
            ("seed", seed, 0),
        ):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"CountdownEnv: {name} must be an integer >= {low}, got {value!r}")
        self.num_tasks = num_tasks
        self.seed = seed
        self.num_numbers = num_numbers
        self.max_number = max_number
        self.max_attempts = max_attempts
        self._state = State()
        self._numbers: list[int] = []
        self._target = 0
        self._attempts = 0
        self._solved = False
        self._done = False

    # -- tasks ------------------------------------------------------------------------------

    def task_ids(self) -> list[str]:
        return [f"countdown-{self.seed}-{i}" for i in range(self.num_tasks)]

    def puzzle(self, task_id: str) -> tuple[list[int], int]:
        """(numbers, target) of a task; the same on every call and every machine."""
        numbers, target, _ = self._generate(task_id)
        return numbers, target

    def solution(self, task_id: str) -> str:
        """An expression that solves the task (the oracle, like a task's solve.sh): for tests and
        sanity checks, never shown to the agent."""
        return self._generate(task_id)[2]

    def _generate(self, task_id: str) -> tuple[list[int], int, str]:
        match = _TASK_ID.match(task_id)
        if not match or int(match.group(1)) != self.seed or int(match.group(2)) >= self.num_tasks:
            raise ValueError(
                f"CountdownEnv: unknown task id {task_id!r}; ids are 'countdown-{self.seed}-<index>' "
                f"with index < {self.num_tasks} (see task_ids())"
            )
        rng = random.Random(task_id)
        numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
        # Fold a random subset of the numbers into a positive integer target, so a solution exists.
        chosen = rng.sample(numbers, rng.randint(2, len(numbers)))
        value, expression = chosen[0], str(chosen[0])
        for x in chosen[1:]:
            op = rng.choice("+-*/")
            if op == "*" and value * x <= _MAX_TARGET:
                value *= x
            elif op == "-" and value > x:
                value -= x
            elif op == "/" and value % x == 0 and x > 1:
                value //= x
            else:
                op, value = "+", value + x
            expression = f"({expression} {op} {x})"
        return numbers, value, expression[1:-1]

    # -- episode ----------------------------------------------------------------------------

    async def reset(
        self, task_id: str, *, episode_id: str | None = None, seed: int | None = None
    ) -> Observation:
        """Start a task. `seed` is ignored: the task id alone fixes the puzzle."""
        self._numbers, self._target = self.puzzle(task_id)
        self._attempts = 0
        self._solved = False
        self._done = False
        self._state = State(episode_id=episode_id, step_count=0, task_id=task_id)
        numbers = ", ".join(map(str, self._numbers))
        return Observation(
            text=(
                f"Numbers: {numbers}\nTarget: {self._target}\n"
                "Write one arithmetic expression that equals the target, using + - * / and parentheses. "
                "Each number may be used at most once; not every number must be used. "
                "Your action is the expression alone, e.g. (3 + 5) * 2. "
                f"You have {self.max_attempts} attempt(s)."
            ),
            metadata={"numbers": list(self._numbers), "target": self._target},
        )

    async def step(self, action: Action) -> Observation:
        if self._state.task_id is None:
            raise RuntimeError("CountdownEnv.step called before reset()")
        if self._done:
            raise RuntimeError("CountdownEnv.step called after the episode ended; call reset() first")
        self._state.step_count += 1
        self._attempts += 1
        answer = (action.text or action.command or action.keystrokes or "").strip()
        try:
            value = self.check(answer)
        except ValueError as err:
            feedback, correct = f"Invalid answer: {err}", False
        else:
            correct = value == self._target
            shown = str(value) if value.denominator == 1 else f"{value} (not an integer)"
            feedback = (
                f"Correct: {answer} = {self._target}."
                if correct
                else f"{answer} = {shown}; the target is {self._target}."
            )
        self._solved = self._solved or correct
        self._done = correct or self._attempts >= self.max_attempts
        if not self._done:
            feedback += f" Attempts left: {self.max_attempts - self._attempts}."
        return Observation(text=feedback, done=self._done, metadata={"correct": correct})

    def check(self, expression: str) -> Fraction:
        """Exact value of `expression` over the current numbers; ValueError says what is wrong."""
        if not expression:
            raise ValueError("empty expression")
        if len(expression) > _MAX_EXPRESSION_CHARS:
            raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
        try:
            tree = ast.parse(expression, mode="eval")
        except SyntaxError:
            raise ValueError(f"not an arithmetic expression: {expression!r}") from None
        used: list[int] = []
        value = self._evaluate(tree.body, used)
        over = Counter(used) - Counter(self._numbers)
        if over:
            raise ValueError(
                f"uses {sorted(over.elements())} more often than given (numbers: {self._numbers}, each at most once)"
            )
        return value

    async def score(self) -> Observation:
        if self._state.task_id is None:
            raise RuntimeError("CountdownEnv.score called before reset()")
        self._done = True
        reward = 1.0 if self._solved else 0.0
        return Observation(text=f"reward {reward}", done=True, reward=reward, status="scored")

    @property
    def state(self) -> State:
        return self._state.model_copy(update={"solved": self._solved, "attempts": self._attempts})

    async def close(self) -> None:
        """Nothing to release: the puzzle lives in memory."""
        self._done = True

    @staticmethod
    def _evaluate(node: ast.expr, used: list[int]) -> Fraction:
        """Exact value of an expression tree; appends every number literal it uses to `used`."""
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = CountdownEnv._evaluate(node.left, used), CountdownEnv._evaluate(node.right, used)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            if right == 0:
                raise ValueError("division by zero")
            return left / right
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp):
            raise ValueError("only + - * / are allowed")  # noqa: TRY004 - check() reports every bad answer as ValueError
        raise ValueError(
            f"only the given integers, + - * / and parentheses are allowed (found {ast.unparse(node)!r})"
        )
