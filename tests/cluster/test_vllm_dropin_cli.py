"""`pdserve` as a drop-in for `vllm serve`: the model as a positional argument, --version,
and defaults in --help. Parsing only; nothing starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import pdserve
from pdserve.cli import build_parser, main
from pdserve.cluster.deployment import Deployment, ServeError


def plan_of(*argv: str) -> Deployment:
    return Deployment.from_args(build_parser().parse_args(["serve", *argv]), cores=[0, 1])


def test_the_model_may_be_given_positionally_as_in_vllm_serve(tmp_path: Path) -> None:
    assert plan_of(str(tmp_path)).model_path == str(tmp_path)
    assert plan_of(str(tmp_path)).served_model_names == [str(tmp_path)]
    assert plan_of("--model", str(tmp_path)).model_path == str(tmp_path)
    assert plan_of(str(tmp_path), "--model", str(tmp_path)).model_path == str(tmp_path)
    assert plan_of().model_path is None  # the embedded model


def test_two_different_models_are_refused(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ServeError, match="two models"):
        plan_of(str(tmp_path), "--model", str(other))


def test_two_different_models_fail_with_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", str(tmp_path), "--model", "/elsewhere"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve serve: error: "), result.stderr


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"pdserve {pdserve.__version__}"


@pytest.mark.parametrize(
    ("flag", "shown"),
    [("--max-num-seqs", "(default: 256)"), ("--kv-cache-memory", "(default: 2GiB)"),
     ("--gpu-memory-utilization", "(default: 0.9)"), ("--port", "(default: 8000)"),
     ("--launcher", "(default: ray)")],
)  # fmt: skip
def test_serve_help_shows_defaults(
    flag: str, shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    listing = text[text.index("positional arguments:") :]  # past the usage line
    after = listing[listing.index(flag) :]
    next_flag = after.find(" --", len(flag))
    assert shown in after[: next_flag if next_flag > 0 else None]


def test_help_shows_no_default_for_unset_or_false_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: False)" not in text
    assert text.count("(default: ") == text.count("default")  # never twice for one flag


def test_plan_help_shows_defaults_too(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: " in text


@pytest.mark.parametrize(
    "command", [["bench", "serve"], ["bench", "sweep"], ["bench", "calibrate"]]
)
def test_bench_help_shows_defaults_too(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: " in text


def test_generation_config_and_tool_flags(tmp_path: Path) -> None:
    assert plan_of("--generation-config", "vllm").engine.generation_config == "vllm"
    (tmp_path / "generation_config.json").write_text("{}")
    plan = plan_of("--generation-config", str(tmp_path))
    assert plan.engine.generation_config == str(tmp_path)
    with pytest.raises(ServeError, match="no generation_config.json"):
        plan_of("--generation-config", str(tmp_path / "missing"))
    with pytest.raises(ServeError, match="needs --tool-call-parser"):
        plan_of("--enable-auto-tool-choice")
    assert plan_of("--enable-auto-tool-choice", "--tool-call-parser", "hermes").args
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])


def test_tensor_parallel_sizes_are_checked_against_the_heads() -> None:
    assert plan_of("-tp", "3").tensor_parallel == {"prefill": 3, "decode": 3, "colocated": 3}
    sizes = plan_of("--decode-tensor-parallel-size", "3").tensor_parallel
    assert sizes["prefill"] == 1 and sizes["decode"] == 3
    with pytest.raises(ServeError, match="3 KV heads and 9 attention heads"):
        plan_of("--tensor-parallel-size", "2")
    with pytest.raises(ServeError, match="--prefill-tensor-parallel-size"):
        plan_of("--prefill-tensor-parallel-size", "2")
    assert plan_of("-pp", "2", "-tp", "3").engine.pipeline_parallel_size == 2
    with pytest.raises(
        ServeError, match=r"--pipeline-parallel-size: .* exceeds the model's \d+ layers"
    ):
        plan_of("-pp", "1000")


def test_int8_tensor_parallel_sizes_keep_whole_scale_groups(tmp_path: Path) -> None:
    """Two heads of 40 split 2 ways, but a rank's 40 columns of the attention output
    would cut an int8 group of 16."""
    config = {
        "architectures": ["LlamaForCausalLM"], "torch_dtype": "float32", "vocab_size": 101,
        "hidden_size": 96, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 40,
        "max_position_embeddings": 64,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert plan_of(str(tmp_path), "-tp", "2").tensor_parallel["colocated"] == 2
    with pytest.raises(ServeError) as refused:
        plan_of(str(tmp_path), "-tp", "2", "--quantization", "int8")
    assert str(refused.value).endswith(
        "tensor-parallel-size: --quantization int8 keeps one scale per 16 inputs, which does "
        "not divide the model's attention output's input width 80 / tensor parallel size "
        "2 = 40"
    )
