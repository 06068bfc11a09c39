"""Runs lm-evaluation-harness's `simple_evaluate` on the tasks of `lm_eval_tasks/`, in a
child process of the test (offline, bounded in time, its torch apart from pytest's):

    python -m tests.cluster.lm_eval_run SPEC_JSON OUT_JSON

SPEC_JSON: {"model": "local-completions", "model_args": "k=v,...", "batch_size": 16,
"device": "cpu" | null, "runs": [{"tasks": [...], "apply_chat_template": bool}, ...]}.
The model is made once and evaluated once per run; OUT_JSON gets, per run, lm-eval's
`results` and each task's samples (`doc_id`, `resps`), in document order.

The CLI (`lm_eval --include_path ...`) would index the ~14,000 task files lm-eval ships
before it reads ours, for ~10 s a run: the task manager here reads only ours.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"


def evaluate(spec: dict[str, Any]) -> list[dict[str, Any]]:
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    more = {"batch_size": spec["batch_size"], "device": spec.get("device")}
    model = get_model(spec["model"]).create_from_arg_string(spec["model_args"], more)
    tasks = TaskManager(include_path=str(TASKS), include_defaults=False)
    found = []
    for run in spec["runs"]:
        result = simple_evaluate(
            model=model, tasks=run["tasks"], task_manager=tasks, log_samples=True,
            apply_chat_template=run["apply_chat_template"], bootstrap_iters=0,
        )  # fmt: skip
        assert result is not None  # None only on ranks other than 0
        samples = {
            task: sorted(
                ({"doc_id": s["doc_id"], "resps": s["resps"]} for s in logged),
                key=lambda s: s["doc_id"],
            )
            for task, logged in result["samples"].items()
        }
        found.append({"results": result["results"], "samples": samples})
    return found


def main() -> None:
    spec_path, out_path = sys.argv[1:]
    found = evaluate(json.loads(Path(spec_path).read_text()))
    Path(out_path).write_text(json.dumps(found, default=float))  # numpy scalars as floats


if __name__ == "__main__":
    main()
