"""`pdserve serve FILE.gguf`: the file checked by the driver before anything starts (its
folder prepared from the metadata, a tensor type it does not serve and a tensor-parallel
split inside a block refused in one line). Parsing and planning only; nothing starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from pdserve.cli import build_parser
from pdserve.cluster.deployment import Deployment, ServeError
from pdserve.engine.gguf_prepare import gguf_source
from tests.engine.gguf_files import write_tiny_gguf


def plan_of(*argv: str) -> Deployment:
    return Deployment.from_args(build_parser().parse_args(["serve", *argv]), cores=[0, 1])


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_gguf_file_is_served_from_the_folder_of_its_metadata(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.Q4_0.gguf", GGMLQuantizationType.Q4_0)
    for argv in ([str(path)], ["--model", str(path)]):
        plan = plan_of(*argv, "--tensor-parallel-size", "2")
        assert plan.model_path is not None and gguf_source(plan.model_path) == path.resolve()
        assert Path(plan.model_path).name == "tiny.Q4_0"
        assert plan.served_model_names == [str(path)]


def test_an_unserved_type_is_refused_before_anything_starts(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "mxfp4.gguf", GGMLQuantizationType.Q8_0,
                           {"attn_k.weight": GGMLQuantizationType.MXFP4})  # fmt: skip
    with pytest.raises(ServeError) as refused:
        plan_of(str(path))
    message = str(refused.value)
    assert "tensor 'blk.0.attn_k.weight' is MXFP4, which pdserve does not serve" in message
    assert message.startswith("--model ") and "\n" not in message


def test_quantization_and_cuda_are_refused_for_a_gguf_file(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", GGMLQuantizationType.Q8_0)
    with pytest.raises(ServeError, match="--quantization int8 applies to 16/32-bit checkpoints"):
        plan_of(str(path), "--quantization", "int8")
    with pytest.raises(ServeError, match="GGUF weights are served on CPU, not on cuda"):
        Deployment.from_args(
            build_parser().parse_args(["serve", str(path)]), cores=[0, 1], gpus=["0"]
        )


def test_a_k_quant_file_plans_and_a_split_inside_its_super_blocks_is_refused(
    tmp_path: Path,
) -> None:
    """Q4_K rows of 256 weights: one rank plans; 2 ranks of the output projection's 256
    columns would hold half a super-block each."""
    path = write_tiny_gguf(tmp_path / "tiny.Q4_K.gguf", GGMLQuantizationType.Q4_K,
                           hidden=256, inter=512)  # fmt: skip
    assert gguf_source(plan_of(str(path)).model_path) == path.resolve()
    with pytest.raises(ServeError) as refused:
        plan_of(str(path), "--tensor-parallel-size", "2")
    message = str(refused.value)
    assert "\n" not in message
    assert "tensor_parallel_size 2 gives each rank 128 columns of 'blk.0.attn_output.weight' " \
        "(Q4_K), not whole 256-weight blocks" in message  # fmt: skip
