"""The rooms keep to their import rules (tests/pdserve/import_rules.py has the table).

The checker only reads source, so the synthetic trees below prove it can fail; the
torch-free rooms are also imported for real, with torch made unimportable.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.pdserve import import_rules

REPO = Path(__file__).resolve().parents[2]


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """A repository-shaped tree: each file's folders become packages."""
    for rel, source in files.items():
        path = root / rel
        for folder in path.relative_to(root).parents:
            if folder != Path("."):
                (root / folder).mkdir(exist_ok=True)
                (root / folder / "__init__.py").touch()
        path.write_text(textwrap.dedent(source))
    return root


def test_the_tree_keeps_the_import_rules() -> None:
    violations = import_rules.import_violations(REPO)
    print("\n".join(violations))
    assert violations == []


def test_every_installed_folder_has_rules() -> None:
    # A room mapped in pyproject.toml but missing from the table would escape every rule.
    assert import_rules.rooms_in_pyproject(REPO) == set(import_rules.ROOMS)
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert packages - set(import_rules.ROOMS) - set(import_rules.NOT_PRODUCT) == set()


BROKEN = {
    "torch in scheduler": (
        {"scheduler/x.py": "import torch\n"},
        "scheduler/x.py:1: room scheduler imports torch (no torch",
    ),
    "kvtransfer in engine": (
        {"engine/y.py": "from pdserve.kvtransfer import z\n", "kvtransfer/z.py": ""},
        "engine/y.py:1: room engine imports pdserve.kvtransfer.z (engine knows no transport",
    ),
    "relative import out of engine": (
        {"engine/y.py": "from .. import kvtransfer\n", "kvtransfer/z.py": ""},
        "engine/y.py:1: room engine imports pdserve.kvtransfer (",
    ),
    "zmq in engine": (
        {"engine/y.py": "def f():\n    import zmq\n"},
        "engine/y.py:2: room engine imports zmq (engine knows no transport",
    ),
    "ray in gateway": (
        {"gateway/a.py": "import ray\n"},
        "gateway/a.py:1: room gateway imports ray (Ray only in cluster/)",
    ),
    "torch for type checking only": (
        {"gateway/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"},
        "gateway/a.py:3: room gateway imports torch (",
    ),
    "engine in bench, inside a function": (
        {"bench/b.py": "def f():\n    from pdserve.engine import llm\n", "engine/llm.py": ""},
        "bench/b.py:2: room bench imports pdserve.engine.llm (no torch",
    ),
    "planner imports the public API at module level": (
        {"planner/p.py": "from pdserve import LLM\n", "pdserve/__init__.py": ""},
        "planner/p.py:1: room planner imports pdserve (planner may import bench, common, and "
        "pdserve",
    ),
    "planner imports the CLI": (
        {"planner/p.py": "def f():\n    from pdserve import cli\n", "pdserve/cli.py": ""},
        "planner/p.py:2: room planner imports pdserve.cli (",
    ),
    "cluster imports bench": (
        {"cluster/c.py": "from pdserve.bench import runner\n", "bench/runner.py": ""},
        "cluster/c.py:1: room cluster imports pdserve.bench.runner (cluster may import",
    ),
    "scheduler imports text": (
        {"scheduler/s.py": "import pdserve.text.tokenizer\n", "text/tokenizer.py": ""},
        "scheduler/s.py:1: room scheduler imports pdserve.text.tokenizer (scheduler may import "
        "common)",
    ),
    "the leaf imports another room": (
        {"common/c.py": "from pdserve.scheduler import s\n", "scheduler/s.py": ""},
        "common/c.py:1: room common imports pdserve.scheduler.s (common may import no other room)",
    ),
    "product module imports experiments": (
        {"cluster/c.py": "import experiments.foo\n"},
        "cluster/c.py:1: room cluster imports experiments.foo (product code never imports",
    ),
    "public face imports tests": (
        {"pdserve/cli.py": "from tests.pdserve import helpers\n"},
        "pdserve/cli.py:1: room pdserve imports tests.pdserve (product code never imports",
    ),
    "prefill inherits from instance": (
        {
            "prefill/r.py": "from pdserve.instance.loop import Runtime\n\n\n"
            "class R(Runtime): ...\n",
            "instance/loop.py": "class Runtime: ...\n",
        },
        "prefill/r.py:4: room prefill imports pdserve.instance.loop.Runtime (class R inherits "
        "from a class of room instance)",
    ),
    "decode inherits from a re-exported class of instance": (
        {
            "decode/d.py": "from pdserve.decode import base\n\n\nclass D(base.Runtime): ...\n",
            "decode/base.py": "from pdserve.instance.loop import Runtime  # noqa\n",
            "instance/loop.py": "class Runtime: ...\n",
        },
        "decode/d.py:4: room decode imports pdserve.decode.base.Runtime (class D inherits from "
        "a class of room instance)",
    ),
    "instance inherits from kvtransfer": (
        {
            "instance/i.py": "import pdserve.kvtransfer.x as kx\n\n\nclass I(kx.Side[int]): ...\n",
            "kvtransfer/x.py": "class Side: ...\n",
        },
        "instance/i.py:4: room instance imports pdserve.kvtransfer.x.Side (class I inherits",
    ),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_a_broken_rule_is_reported(tmp_path: Path, case: str) -> None:
    files, expected = BROKEN[case]
    violations = import_rules.import_violations(write_tree(tmp_path, files))
    assert any(v.startswith(expected) for v in violations), violations


def test_allowed_imports_are_not_reported(tmp_path: Path) -> None:
    files = {
        "pdserve/__init__.py": "",
        "pdserve/cli.py": "from pdserve.planner import cli\nfrom pdserve.cluster import serve\n",
        "planner/cli.py": "def calibrate():\n    from pdserve import LLM\n",
        "planner/sim/x.py": "from ...bench import runner\nimport numpy\n",
        "bench/runner.py": "import httpx\n",
        "cluster/serve.py": "import ray\nfrom pdserve.gateway import app\n"
        "from pdserve.engine import e\n",
        "gateway/app.py": "import zmq\nfrom pdserve.scheduler import s\n"
        "from pdserve.text import t\n",
        "engine/e.py": "import torch\nfrom pdserve.kernels import k\nfrom . import e\n",
        "kernels/k.py": "import triton\n",
        "prefill/p.py": (
            "import msgspec\nfrom pdserve.kvtransfer import x\n"
            "from pdserve.prefill.q import Q\n\n\n"
            "class P(Q): ...\nclass M(msgspec.Struct): ...\nclass E(ValueError): ...\n"
        ),
        "prefill/q.py": "class Q: ...\n",
        "instance/i.py": "from pdserve.prefill import p\nfrom pdserve.decode import d\n",
        "decode/d.py": "from pdserve.engine import e\n",
        "kvtransfer/x.py": "from pdserve.scheduler import s\nfrom pdserve.common import c\n",
        "scheduler/s.py": "from pdserve.common import c\n",
        "common/c.py": "import msgspec\n",
        "text/t.py": "",
    }
    assert import_rules.import_violations(write_tree(tmp_path, files)) == []


def test_tests_and_experiments_are_not_read(tmp_path: Path) -> None:
    files = {"experiments/e.py": "import torch, ray\n", "tests/t.py": "import ray\n"}
    assert import_rules.import_violations(write_tree(tmp_path, files)) == []


# Imports every module of one room with torch and triton unimportable; prints the failures.
IMPORT_ROOM = """
import importlib, pathlib, sys
sys.modules["torch"] = None
sys.modules["triton"] = None
root, room = pathlib.Path(sys.argv[1]), sys.argv[2]
failures = []
for path in sorted((root / room).rglob("*.py")):
    parts = [p for p in path.relative_to(root / room).with_suffix("").parts if p != "__init__"]
    name = ".".join(["pdserve", room, *parts])
    try:
        module = importlib.import_module(name)
    except BaseException as exc:
        failures.append(f"{name}: {type(exc).__name__}: {exc}")
        continue
    if pathlib.Path(module.__file__).resolve() != path.resolve():
        failures.append(f"{name}: imported from {module.__file__}, not this checkout")
print("\\n".join(failures))
sys.exit(1 if failures else 0)
"""


@pytest.mark.parametrize("room", import_rules.TORCH_FREE_ROOMS)
def test_torch_free_room_imports_without_torch(room: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ROOM, str(REPO), room],
        cwd=REPO,  # the checkout's pdserve comes first on sys.path
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_without_torch_can_fail() -> None:
    # The same script on the engine room, which needs torch, must report it.
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ROOM, str(REPO), "engine"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "pdserve.engine.kv_cache: ModuleNotFoundError" in result.stdout, result.stdout


def test_modules_and_functions_stay_short() -> None:
    oversized = import_rules.size_violations(REPO)
    print("\n".join(oversized))
    assert oversized == []


def test_the_size_check_can_fail(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    jit = f"import triton\n\n\n@triton.jit\ndef kernel():\n{body}"
    files = {
        "scheduler/long.py": "x = 1\n" * 401,
        "gateway/f.py": f"def handler():\n{body}",
        "kernels/triton_k.py": jit,  # a Triton kernel body may be long
        "kernels/other.py": jit,  # but only in kernels/triton_*.py
    }
    oversized = import_rules.size_violations(write_tree(tmp_path, files))
    assert oversized == [
        "gateway/f.py:1: function handler has 81 lines (limit 80)",
        "kernels/other.py:5: function kernel has 81 lines (limit 80)",
        "scheduler/long.py:1: module has 401 lines (limit 400)",
    ]
