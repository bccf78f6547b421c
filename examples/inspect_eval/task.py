"""A tiny inspect_ai task whose solver and scorer work in a dsh-bash sandbox.

    inspect eval examples/inspect_eval/task.py --model mockllm/model
    inspect eval examples/inspect_eval/task.py --model mockllm/model -T config=docker.toml

The task names only the sandbox type and a config file: the same task runs on the local, Docker or
SSH backend, whichever the file describes. Nothing imports dsh_bash_inspect: inspect finds the
provider through its entry point once ``dsh-bash[inspect]`` is installed.
"""

from __future__ import annotations

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Scorer, Target, accuracy, scorer
from inspect_ai.solver import Generate, Solver, TaskState, solver
from inspect_ai.util import sandbox


@solver
def work_in_sandbox() -> Solver:
    """Write a file, then run a command that reads it: what an agent's tools do."""

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        await sandbox().write_file("notes/greeting.txt", "hello from the sandbox\n")
        command = "wc -l < notes/greeting.txt; tr a-z A-Z < notes/greeting.txt"
        result = await sandbox().exec(["bash", "-c", command])
        state.metadata["sandbox_output"] = result.stdout
        state.metadata["sandbox_returncode"] = result.returncode
        return state

    return solve


@scorer(metrics=[accuracy()])
def file_in_sandbox() -> Scorer:
    """Correct when the solver's command saw the file it wrote, in the same sandbox."""

    async def score(state: TaskState, target: Target) -> Score:
        written = await sandbox().read_file("notes/greeting.txt")
        output = str(state.metadata.get("sandbox_output", ""))
        ok = written == "hello from the sandbox\n" and target.text in output
        return Score(value=CORRECT if ok else INCORRECT, answer=output, explanation=f"file: {written!r}")

    return score


@task
def dsh_bash_hello(config: str = "local.toml") -> Task:
    return Task(
        dataset=[Sample(input="Shout the greeting.", target="HELLO FROM THE SANDBOX")],
        # No generate(): the mock model is never asked (its token counting would fetch an encoding
        # from the network), so the eval runs offline.
        solver=work_in_sandbox(),
        scorer=file_in_sandbox(),
        sandbox=("dsh-bash", config),
    )
