"""A `cuda` device on a CPU-only torch build, for tests of the GPU half's plumbing.

`FakeTensorMode` makes `cuda` tensors without a device: every op computes its output's
shape, dtype and device as it would on a GPU, and a host tensor meeting a device tensor
raises `FakeTensorDeviceMismatchError`. The Triton kernels take part through their fake
implementations (`kernels/cuda_ops.py`, registered with `torch.library`); torch's own ops
(embedding, matmuls of `kernels.linear` on CUDA, activations, indexing) run unpatched
under the mode. What a CPU build lacks beside that is stood in for here, and nothing else:

- the CUDA device guard, which a CPU build lacks and `copy_`, `to("cuda")` and indexing
  take: c10's own `FakeGuardImpl`, registered for CUDA by a small library built once
  (`load_device_guard`; it stays registered for the rest of the process, which changes
  nothing for code that asks `torch.cuda.is_available()`);
- the CUDA runtime's events and free-memory query (`torch.cuda.Event`,
  `torch.cuda.mem_get_info`);
- torch.distributed: `Collectives` records every tensor handed to a collective and
  refuses one that is not on the device (NCCL takes device tensors only);
- checkpoint reads: the safetensors files are read into real host tensors outside the
  mode (a fake tensor has no memory to read into), then copied into the fake parameters.

Values never exist: sampling and the token broadcast of a pipeline are tested at their
seams (`SamplerSeam`, `SeamStage`), by what is handed to them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from pdserve.engine import loader, parallel, pipeline
from pdserve.engine.pipeline import PipelineStage
from pdserve.kernels import load_triton_kernels

CUDA = torch.device("cuda", 0)
GiB = 1 << 30


GUARD_SOURCE = """
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
"""


@functools.cache
def load_device_guard() -> None:
    """Registers c10's FakeGuardImpl as the CUDA device guard of this process (built
    once per torch version): the guard a CPU build lacks, which `copy_`, `to("cuda")`
    and indexing take before they dispatch. The current device is 0."""
    torch_dir = Path(torch.__file__).parent
    cache = Path.home() / ".cache" / "pdserve" / "tests"
    library = cache / f"fake_cuda_guard-{torch.__version__}.so"
    if not library.exists():
        compiler = shutil.which("c++") or shutil.which("g++")
        if compiler is None:
            pytest.skip("fake CUDA tensors need a C++ compiler for the device guard")
        cache.mkdir(parents=True, exist_ok=True)
        source = cache / "fake_cuda_guard.cc"
        source.write_text(GUARD_SOURCE)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        lib_dir = torch_dir / "lib"
        subprocess.run(
            [compiler, "-O1", "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             f"-I{torch_dir / 'include'}", str(source), "-o", str(partial), f"-L{lib_dir}",
             "-Wl,--no-as-needed", "-lc10", f"-Wl,-rpath,{lib_dir}"],
            check=True, capture_output=True,
        )  # fmt: skip
        os.replace(partial, library)
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)


class FakeEvent:
    """A CUDA event of a device whose copies finish at once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.recorded = 0

    def record(self, stream: Any = None) -> None:
        self.recorded += 1

    def synchronize(self) -> None:
        pass


class OpLog(TorchDispatchMode):
    """The name of every op dispatched beneath the Python level, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@dataclass
class Collectives:
    """Stands for torch.distributed in `engine/parallel.py` and `engine/pipeline.py`."""

    device: torch.device = CUDA
    calls: list[tuple[str, tuple[int, ...], torch.device]] = field(default_factory=list)
    ReduceOp = dist.ReduceOp

    def _take(self, name: str, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.device != self.device:
                raise AssertionError(f"{name} handed a tensor on {t.device}, not {self.device}")
            self.calls.append((name, tuple(t.shape), t.device))

    def all_reduce(self, x: torch.Tensor, op: Any = None, group: Any = None) -> None:
        self._take("all_reduce", x)

    def all_gather(self, parts: list[torch.Tensor], x: torch.Tensor, group: Any = None) -> None:
        self._take("all_gather", x, *parts)

    def isend(self, x: torch.Tensor, dst: int) -> _Done:
        self._take("isend", x)
        return _Done()

    def recv(self, x: torch.Tensor, src: int) -> None:
        self._take("recv", x)

    def broadcast(self, x: torch.Tensor, src: int) -> None:
        self._take("broadcast", x)

    def named(self, name: str) -> list[tuple[int, ...]]:
        return [shape for n, shape, _ in self.calls if n == name]


class _Done:
    def wait(self) -> None:
        pass


@dataclass(frozen=True)
class SeamStage(PipelineStage):
    """A pipeline stage whose value-carrying collectives (the token broadcast, the block
    count's minimum) check the device they are handed instead of reading values; its
    sends and receives are the real ones, over `Collectives`."""

    devices_handed: list[torch.device] = field(default_factory=list, compare=False)

    def share_tokens(self, tokens: list[int], count: int, device: torch.device) -> list[int]:
        self.devices_handed.append(torch.empty(0, device=device).device)
        return tokens if self.is_last else [0] * count

    def agree_min(self, value: int, device: torch.device) -> int:
        self.devices_handed.append(torch.empty(0, device=device).device)
        return value


class SamplerSeam:
    """Stands for the sampler (its tokens need values): checks the logits handed to it
    and answers `token` for every row."""

    def __init__(self, vocab_size: int, token: int = 7) -> None:
        self.vocab_size = vocab_size
        self.token = token
        self.handed: list[tuple[tuple[int, ...], torch.dtype, torch.device]] = []

    def sample(self, logits: torch.Tensor, requests: list[Any]) -> tuple[list[int], list[None]]:
        self.handed.append((tuple(logits.shape), logits.dtype, logits.device))
        expected = (len(requests), self.vocab_size)
        if tuple(logits.shape) != expected or logits.dtype != torch.float32:
            raise AssertionError(f"logits {tuple(logits.shape)} {logits.dtype}, want {expected}")
        if logits.device != CUDA:
            raise AssertionError(f"logits on {logits.device}, not on the device")
        return [self.token] * len(requests), [None] * len(requests)


def _host_reads(read: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """`read`'s tensors read from the files outside the fake mode: real host tensors."""

    def reads(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with unset_fake_temporarily():
            items = read(*args, **kwargs)
        while True:
            with unset_fake_temporarily():
                item = next(items, None)
            if item is None:
                return
            yield item

    return reads


@dataclass
class FakeCuda:
    mode: FakeTensorMode
    collectives: Collectives
    ops: OpLog


@contextmanager
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    """Everything inside runs as on a CUDA device, with fake tensors."""
    load_triton_kernels()  # imported before the mode: the CUDA path's ops registered
    collectives = Collectives()
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GiB, 80 * GiB))
    monkeypatch.setattr(parallel, "dist", collectives)
    monkeypatch.setattr(pipeline, "dist", collectives)
    monkeypatch.setattr(loader, "iter_weights", _host_reads(loader.iter_weights))
    load_device_guard()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    ops = OpLog()
    with mode, ops:
        yield FakeCuda(mode, collectives, ops)
