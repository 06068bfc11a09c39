"""An engine whose KV cache cannot hold one request of max_model_len refuses to start,
in one line naming the numbers and the flags that fix it (a fake executor; no model)."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.step_plan import WorkerInfo
from tests.instance.test_step_loop import FakeExecutor  # 64 blocks of 4, max_model_len 256


class SmallCache(FakeExecutor):
    def __init__(self, num_blocks: int) -> None:
        super().__init__()
        self.num_blocks = num_blocks

    def load(self) -> WorkerInfo:
        info = super().load()
        return msgspec.structs.replace(
            info, kv=msgspec.structs.replace(info.kv, num_blocks=self.num_blocks)
        )


def test_a_cache_of_exactly_one_full_request_starts() -> None:
    engine = EngineCore(EngineConfig.from_kwargs(block_size=4), SmallCache(64))
    assert engine.info.kv.num_blocks * 4 == engine.max_model_len


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [({}, "--kv-cache-memory"), ({"device": "cuda"}, "--gpu-memory-utilization"),
     ({"num_kv_blocks": 63}, "num_kv_blocks")],
)  # fmt: skip
def test_a_cache_short_of_one_full_request_is_refused(kwargs: dict, flag: str) -> None:
    config = EngineConfig.from_kwargs(block_size=4, **kwargs)
    with pytest.raises(ValueError) as error:
        EngineCore(config, SmallCache(63))
    message = str(error.value)
    assert "\n" not in message
    assert "63 blocks x 4 = 252 tokens" in message and "max_model_len 256" in message
    assert flag in message and "--max-model-len" in message
