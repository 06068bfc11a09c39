"""What `pdserve serve` with no model hands its instances: the embedded model as the
engine config serves it best (its Q4_1 file on CPU, the float32 conversion elsewhere),
and the tensor-parallel check reads those same files. Planning only; nothing starts."""

from __future__ import annotations

from pdserve.cli import build_parser
from pdserve.cluster.deployment import Deployment
from pdserve.cluster.serve import default_model
from pdserve.engine import embedded
from pdserve.engine.gguf_prepare import gguf_source


def plan_of(*argv: str, gpus: list[str] | None = None) -> Deployment:
    return Deployment.from_args(build_parser().parse_args(["serve", *argv]), [0, 1], gpus)


def test_on_cpu_the_default_is_the_q4_1_file() -> None:
    for argv in ([], ["--dtype", "bfloat16"], ["--dtype", "float32"], ["--mode", "colocated"]):
        plan = plan_of(*argv)
        assert plan.model_path is None
        assert gguf_source(default_model(plan)) == embedded.gguf_path()


def test_float16_int8_and_cuda_take_the_float32_conversion() -> None:
    folder = embedded.embedded_model_path()
    assert default_model(plan_of("--dtype", "float16")) == folder
    assert default_model(plan_of("--quantization", "int8")) == folder
    assert default_model(plan_of(gpus=["0"])) == folder


def test_tensor_parallel_plans_on_the_default_files() -> None:
    """Three ranks split the Q4_1 file's rows on whole 32-weight blocks (576 / 3 = 192)."""
    plan = plan_of("--tensor-parallel-size", "3", "--threads-per-instance", "1")
    assert plan.tensor_parallel == {"prefill": 3, "decode": 3, "colocated": 3}
