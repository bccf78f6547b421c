"""Run the example task offline with inspect's mock model and print what the sandbox did.

    python examples/inspect_eval/run.py                # the local backend (local.toml)
    python examples/inspect_eval/run.py docker.toml    # another config file next to task.py

Exit status 0 when the sample scored correct.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from inspect_ai import eval as inspect_eval

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from task import dsh_bash_hello  # noqa: E402 - the task file next to this script


def main(argv: list[str]) -> int:
    config = argv[0] if argv else "local.toml"
    with tempfile.TemporaryDirectory(prefix="dsh-bash-inspect-logs-") as log_dir:
        [log] = inspect_eval(
            dsh_bash_hello(config=str(HERE / config)),
            model="mockllm/model",
            log_dir=log_dir,
            display="none",
        )
        if log.status != "success" or not log.samples:
            print(f"eval {log.status}: {log.error.message if log.error else 'no samples'}")
            return 1
        sample = log.samples[0]
    score = next(iter(sample.scores.values())) if sample.scores else None
    print(f"sandbox: dsh-bash with {config}")
    print(f"sandbox output: {sample.metadata.get('sandbox_output')!r}")
    print(f"score: {score.value if score else None}")
    return 0 if score is not None and score.value == "C" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
