"""lm-evaluation-harness against one prefill and one decode instance, as users run it: the
`lm_eval` CLI's `local-completions` (token-id prompts, `echo` + `logprobs` for
loglikelihood, greedy generation) and `local-chat-completions` (generation) on the small
tasks of `lm_eval_tasks/`, scored the same as lm-eval's own `hf` backend on the same
float32 checkpoint: within one example, and sample by sample.

Nothing leaves 127.0.0.1: the tasks' data are local JSONL files, the tokenizer is the
embedded model's folder, and the hub is offline.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from experiments.serving import API_KEY, LOCAL, MODEL, ServeProcess, served
from pdserve.engine.embedded import embedded_model_path

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TASKS = "tests/cluster/lm_eval_tasks"  # the tasks' data_files are relative to the checkout
MC, GEN = "pdserve_mc", "pdserve_gen"
ARGS = (
    *LOCAL, "--num-prefill", "1", "--num-decode", "1", "--dtype", "float32",
    "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
)  # fmt: skip
RUN_TIMEOUT_S = 300
# Loglikelihoods of one choice, pdserve's against torch's: different kernels, same fp32 model.
LOGLIKELIHOOD_TOLERANCE = 1e-3


@dataclass
class Evaluation:
    """What one `lm_eval` run scored: each task's metric and its logged samples."""

    scores: dict[str, float]
    samples: dict[str, list[dict]]

    def loglikelihoods(self, task: str) -> list[list[float]]:
        """Each document's loglikelihood of each choice, in document order."""
        return [[float(r[0][0]) for r in s["resps"]] for s in self.samples[task]]

    def generations(self, task: str) -> list[str]:
        return [s["resps"][0][0] for s in self.samples[task]]


def lm_eval(model: str, model_args: str, tasks: list[str], out: Path, *more: str) -> Evaluation:
    """The `lm_eval` CLI in a child process, offline, bounded in time."""
    env = {
        **os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(out / "hf-home"), "OPENAI_API_KEY": API_KEY, "TOKENIZERS_PARALLELISM": "false",
    }  # fmt: skip
    command = [
        sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
        "--tasks", ",".join(tasks), "--include_path", TASKS, "--output_path", str(out),
        "--log_samples", *more,
    ]  # fmt: skip
    result = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-4000:]}"
    return read_evaluation(out, tasks)


def read_evaluation(out: Path, tasks: list[str]) -> Evaluation:
    (results_path,) = glob.glob(str(out / "*" / "results_*.json"))
    results = json.loads(Path(results_path).read_text())["results"]
    scores = {MC: results[MC]["acc,none"]} if MC in tasks else {}
    if GEN in tasks:
        scores[GEN] = results[GEN]["exact_match,first_word"]
    samples = {}
    for task in tasks:
        (path,) = glob.glob(str(Path(results_path).parent / f"samples_{task}_*.jsonl"))
        lines = Path(path).read_text().splitlines()
        samples[task] = sorted((json.loads(line) for line in lines), key=lambda s: s["doc_id"])
    return Evaluation(scores, samples)


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with served(*ARGS, clean=True) as process:
        yield process


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(embedded_model_path())


@pytest.fixture(scope="module")
def hf(model_path, tmp_path_factory) -> Evaluation:
    """lm-eval's own `hf` backend on the same checkpoint in float32: both tasks."""
    out = tmp_path_factory.mktemp("lm-eval-hf")
    return lm_eval("hf", f"pretrained={model_path},dtype=float32", [MC, GEN], out)


@pytest.fixture(scope="module")
def hf_chat(model_path, tmp_path_factory) -> Evaluation:
    """The same with the model's chat template applied, as chat completions render it."""
    out = tmp_path_factory.mktemp("lm-eval-hf-chat")
    args = f"pretrained={model_path},dtype=float32"
    return lm_eval("hf", args, [GEN], out, "--apply_chat_template")


def assert_generations_agree(ours: Evaluation, theirs: Evaluation) -> None:
    """The same score within one example, and at most one generation that differs (a
    near-tie between two tokens may break the other way under other kernels)."""
    count = len(theirs.samples[GEN])
    assert abs(ours.scores[GEN] - theirs.scores[GEN]) <= 1 / count + 1e-9, (ours, theirs)
    pairs = zip(ours.generations(GEN), theirs.generations(GEN), strict=True)
    differing = [(mine, reference) for mine, reference in pairs if mine != reference]
    assert len(differing) <= 1, differing


def test_local_completions_scores_as_the_hf_backend(server, model_path, hf, tmp_path) -> None:
    args = f"model={MODEL},base_url={server.base_url}/v1/completions,tokenizer={model_path}"
    ours = lm_eval("local-completions", args, [MC, GEN], tmp_path)
    count = len(hf.samples[MC])
    assert abs(ours.scores[MC] - hf.scores[MC]) <= 1 / count + 1e-9, (ours.scores, hf.scores)
    for mine, reference in zip(ours.loglikelihoods(MC), hf.loglikelihoods(MC), strict=True):
        assert mine == pytest.approx(reference, abs=LOGLIKELIHOOD_TOLERANCE)
    assert_generations_agree(ours, hf)


def test_local_chat_completions_scores_as_the_hf_backend(
    server, model_path, hf_chat, tmp_path
) -> None:
    args = f"model={MODEL},base_url={server.base_url}/v1/chat/completions"
    ours = lm_eval("local-chat-completions", args, [GEN], tmp_path, "--apply_chat_template")
    assert_generations_agree(ours, hf_chat)
