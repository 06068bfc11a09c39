"""lm-evaluation-harness against one prefill and one decode instance and against one
colocated instance, as users run it:
`local-completions` (token-id prompts, `echo` + `logprobs` + `max_tokens: 1` for
loglikelihood, greedy generation) and `local-chat-completions` (generation) on the small
tasks of `lm_eval_tasks/`, scored as lm-eval's own `hf` backend scores the same float32
checkpoint: within one example, and sample by sample.

Nothing leaves 127.0.0.1: the tasks' data are local JSONL files, the tokenizer is the
embedded model's folder, and the hub is offline. lm-eval runs in child processes
(`lm_eval_run.py`); the `hf` reference runs while the server starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from experiments.serving import API_KEY, LOCAL, MODEL, ServeProcess, served
from pdserve.engine.embedded import embedded_model_path

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]  # the tasks' data_files are relative to it
MC, GEN = "pdserve_mc", "pdserve_gen"
COMMON = (*LOCAL, "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "1024")
LAYOUTS = {
    "1P+1D": (*COMMON, "--num-prefill", "1", "--num-decode", "1"),
    "colocated": (*COMMON, "--mode", "colocated", "--num-colocated", "1"),
}
RUN_TIMEOUT_S = 300
FILES = ("spec.json", "out.json")  # what a child reads, what it writes
# Loglikelihoods of one choice, pdserve's against torch's: other kernels, the same fp32 model.
LOGLIKELIHOOD_TOLERANCE = 1e-3


@dataclass
class Evaluation:
    """What one lm-eval run scored: lm-eval's results and each task's samples."""

    results: dict[str, dict[str, Any]]
    samples: dict[str, list[dict[str, Any]]]

    def score(self, task: str) -> float:
        return self.results[task]["acc,none" if task == MC else "exact_match,first_word"]

    def loglikelihoods(self, task: str) -> list[list[float]]:
        """Each document's loglikelihood of each choice, in document order."""
        return [[r[0][0] for r in s["resps"]] for s in self.samples[task]]

    def generations(self, task: str) -> list[str]:
        return [s["resps"][0][0] for s in self.samples[task]]


class LmEval:
    """One child process evaluating one model on `runs` (tasks, chat template or not)."""

    def __init__(self, out: Path, model: str, model_args: str, runs: list[tuple[list[str], bool]],
                 batch_size: int = 1, device: str | None = None) -> None:  # fmt: skip
        spec = {
            "model": model, "model_args": model_args, "batch_size": batch_size, "device": device,
            "runs": [{"tasks": t, "apply_chat_template": chat} for t, chat in runs],
        }  # fmt: skip
        (out / "spec.json").write_text(json.dumps(spec))
        self.out = out
        env = {
            **os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_HOME": str(out / "hf-home"), "OPENAI_API_KEY": API_KEY,
            "OMP_NUM_THREADS": "1",  # the servers' instances have the other core
        }  # fmt: skip
        with (out / "stderr.log").open("w") as stderr:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.cluster.lm_eval_run", *(str(out / n) for n in FILES)],
                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
            )  # fmt: skip

    def evaluations(self) -> list[Evaluation]:
        try:
            code = self.process.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            code = -1
        stderr = (self.out / "stderr.log").read_text()[-4000:]
        assert code == 0, f"lm-eval exited with {code}:\n{stderr}"
        found = json.loads((self.out / "out.json").read_text())
        return [Evaluation(e["results"], e["samples"]) for e in found]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(embedded_model_path())


@pytest.fixture(scope="module")
def hf(model_path, tmp_path_factory) -> Iterator[LmEval]:
    """lm-eval's own `hf` backend on the same checkpoint in float32, on the CPU: both
    tasks, then the generation task in the model's chat template."""
    runs = [([MC, GEN], False), ([GEN], True)]
    out = tmp_path_factory.mktemp("lm-eval-hf")
    evaluation = LmEval(out, "hf", f"pretrained={model_path},dtype=float32", runs, 16, "cpu")
    yield evaluation
    evaluation.stop()


@pytest.fixture(scope="module")
def reference(hf) -> list[Evaluation]:
    return hf.evaluations()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request, hf) -> Iterator[ServeProcess]:  # after `hf`, so the two start together
    with served(*LAYOUTS[request.param], clean=True) as process:
        yield process


def assert_generations_agree(ours: Evaluation, theirs: Evaluation) -> None:
    """The same score within one example, and at most one generation that differs (a
    near-tie between two tokens may break the other way under other kernels)."""
    count = len(theirs.samples[GEN])
    scores = (ours.score(GEN), theirs.score(GEN))
    assert abs(scores[0] - scores[1]) <= 1 / count + 1e-9, scores
    pairs = zip(ours.generations(GEN), theirs.generations(GEN), strict=True)
    differing = [(mine, reference) for mine, reference in pairs if mine != reference]
    assert len(differing) <= 1, differing


def test_local_completions_scores_as_the_hf_backend(
    server, model_path, reference, tmp_path
) -> None:
    args = f"model={MODEL},base_url={server.base_url}/v1/completions,tokenizer={model_path}"
    (ours,) = LmEval(tmp_path, "local-completions", args, [([MC, GEN], False)], 16).evaluations()
    theirs = reference[0]
    count = len(theirs.samples[MC])
    scores = (ours.score(MC), theirs.score(MC))
    assert abs(scores[0] - scores[1]) <= 1 / count + 1e-9, scores
    for mine, expected in zip(ours.loglikelihoods(MC), theirs.loglikelihoods(MC), strict=True):
        assert mine == pytest.approx(expected, abs=LOGLIKELIHOOD_TOLERANCE)
    assert_generations_agree(ours, theirs)


def test_local_chat_completions_scores_as_the_hf_backend(server, reference, tmp_path) -> None:
    url = f"{server.base_url}/v1/chat/completions"
    args = f"model={MODEL},base_url={url},num_concurrent=4"
    (ours,) = LmEval(tmp_path, "local-chat-completions", args, [([GEN], True)]).evaluations()
    assert_generations_agree(ours, reference[1])
