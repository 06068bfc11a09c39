"""Which room of pdserve may import what, checked by reading the source (ast; nothing is imported).

Every top-level folder of the repository listed in `ROOMS` installs as `pdserve.<room>`
(`pdserve/` itself is the public face and the CLI). `experiments/` and `tests/` are not
product code: they are not read here, and product code may not import them.

`import_violations(root)` returns one line per import that breaks a rule of the table below,
"path:line: room X imports Y (rule; rule)"; `size_violations(root)` lists modules and
functions that grew too long (kept apart: it is a different kind of finding).
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

# The folders that are product code, in the order of the layers (lowest first).
ROOMS = (
    "common",
    "scheduler",
    "text",
    "kernels",
    "engine",
    "kvtransfer",
    "prefill",
    "decode",
    "instance",
    "gateway",
    "cluster",
    "bench",
    "eval",
    "planner",
    "pdserve",
)
PUBLIC_API = "pdserve"  # the package itself: `import pdserve`, `from pdserve import LLM`
NOT_PRODUCT = ("experiments", "tests")  # top-level folders that are not installed


@dataclass(frozen=True)
class Forbidden:
    """Modules (and everything under them) that some rooms may not import at all."""

    rule: str
    rooms: tuple[str, ...]
    modules: tuple[str, ...]


# ---- The rule table -------------------------------------------------------------------------
# A room may import itself plus these rooms.
ALLOWED_ROOMS: dict[str, tuple[str, ...]] = {
    "common": (),  # the leaf: what every room shares, importing no other room
    "scheduler": ("common",),
    "text": ("common",),
    "kernels": ("common",),
    "engine": ("common", "kernels", "scheduler", "text"),
    "kvtransfer": ("common", "scheduler"),
    "prefill": ("common", "scheduler", "kvtransfer", "engine"),
    "decode": ("common", "scheduler", "kvtransfer", "engine"),
    "instance": ("common", "scheduler", "kvtransfer", "engine", "prefill", "decode", "text"),
    "gateway": ("common", "scheduler", "text", "planner"),  # the SLO policy's latency model
    "cluster": ("common", "gateway", "instance", "scheduler", "engine", "text", "kvtransfer"),
    "bench": ("common",),
    "eval": ("bench", "common"),
    "planner": ("bench", "common"),
    "pdserve": ROOMS,
}
# Planner's engine calibration times the engine through the public API; importing it at
# module level would load torch with the planner, so only inside a function.
PUBLIC_API_INSIDE_FUNCTIONS = ("planner",)
TORCH_FREE_ROOMS = ("common", "scheduler", "gateway", "text", "bench", "eval", "planner")
FORBIDDEN = (
    Forbidden("Ray only in cluster/", tuple(r for r in ROOMS if r != "cluster"), ("ray",)),
    Forbidden(
        "no torch in the torch-free rooms",
        TORCH_FREE_ROOMS,
        ("torch", "triton", "pdserve.engine", "pdserve.kernels"),  # engine and kernels load torch
    ),
    Forbidden(
        "engine knows no transport and no serving",
        ("engine",),
        (
            "zmq",
            "ray",
            "pdserve.kvtransfer",
            "pdserve.instance",
            "pdserve.prefill",
            "pdserve.decode",
            "pdserve.gateway",
            "pdserve.cluster",
        ),
    ),
    Forbidden("product code never imports experiments/ or tests/", ROOMS, NOT_PRODUCT),
)
# Classes here may not inherit from a class defined in another room (compose instead).
OWN_BASES_ROOMS = ("prefill", "decode", "instance")
# Sizes: Triton kernel bodies are long by nature (one GPU program each), and C is not read.
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
TRITON_KERNEL_FILES = "kernels/triton_*.py"
TRITON_JIT = ("triton.jit", "jit")
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Module:
    path: Path  # relative to the repository root
    name: str  # e.g. pdserve.scheduler.step_scheduler
    room: str


@dataclass(frozen=True)
class Import:
    module: Module
    line: int
    target: str  # the module imported, absolute
    in_function: bool


def product_modules(root: Path) -> list[Module]:
    """Every .py file of every room folder that exists under root."""
    modules = []
    for room in ROOMS:
        folder = root / room
        for path in sorted(folder.rglob("*.py")) if folder.is_dir() else ():
            rel = path.relative_to(folder)
            if "__pycache__" in rel.parts or any(p.startswith(".") for p in rel.parts):
                continue
            parts = [p for p in rel.with_suffix("").parts if p != "__init__"]
            prefix = ["pdserve"] if room == "pdserve" else ["pdserve", room]
            modules.append(Module(path.relative_to(root), ".".join(prefix + parts), room))
    return modules


def rooms_in_pyproject(root: Path) -> set[str]:
    """The folders pyproject.toml maps into the installed pdserve package."""
    with open(root / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return set(mapping.values())


def room_of(module_name: str) -> str | None:
    """The room a module belongs to; None for stdlib and third-party modules."""
    parts = module_name.split(".")
    if parts[0] != "pdserve":
        return None
    if len(parts) > 1 and parts[1] in ALLOWED_ROOMS and parts[1] != "pdserve":
        return parts[1]
    return "pdserve"  # the package itself and its own modules (pdserve.cli)


@cache
def _parse(path: Path, mtime_ns: int, size: int) -> ast.Module:
    return ast.parse(path.read_bytes(), filename=str(path))


def _tree(root: Path, module: Module) -> ast.Module:
    # Keyed by mtime and size too: the tree is edited while the checker runs in one process.
    path = (root / module.path).resolve()
    stat = path.stat()
    return _parse(path, stat.st_mtime_ns, stat.st_size)


def _package_of(module: Module) -> str:
    if module.path.name == "__init__.py":
        return module.name
    return module.name.rpartition(".")[0]


def _from_base(module: Module, node: ast.ImportFrom) -> str:
    """The absolute module of `from ... import`, relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    package = _package_of(module).split(".")
    base = ".".join(package[: len(package) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def _targets(module: Module, node: ast.stmt, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = _from_base(module, node)
    # `from pdserve import engine` imports the room pdserve.engine, not just the package.
    targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    return list(dict.fromkeys(targets))


def _walk(node: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Every node below node, and whether it sits inside a function body."""
    for child in ast.iter_child_nodes(node):
        yield child, in_function
        inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
        yield from _walk(child, inner)


def module_imports(root: Path, module: Module, known: set[str]) -> list[Import]:
    """All imports of a module: in functions and under `if TYPE_CHECKING:` too."""
    imports = []
    for node, in_function in _walk(_tree(root, module)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            for target in _targets(module, node, known):
                imports.append(Import(module, node.lineno, target, in_function))
    return imports


def _under(target: str, modules: tuple[str, ...]) -> bool:
    return any(target == m or target.startswith(m + ".") for m in modules)


def broken_rules(imp: Import) -> list[str]:
    """The rules of the table one import breaks."""
    room = imp.module.room
    broken = [f.rule for f in FORBIDDEN if room in f.rooms and _under(imp.target, f.modules)]
    target_room = room_of(imp.target)
    if target_room is None or target_room == room or target_room in ALLOWED_ROOMS[room]:
        return broken
    public_api_allowed = imp.target == PUBLIC_API and room in PUBLIC_API_INSIDE_FUNCTIONS
    if public_api_allowed and imp.in_function:
        return broken
    allowed = ", ".join(ALLOWED_ROOMS[room]) or "no other room"
    if room in PUBLIC_API_INSIDE_FUNCTIONS:
        allowed += f", and {PUBLIC_API} itself inside a function"
    broken.append(f"{room} may import {allowed}")
    return broken


def _line(module: Module, line: int, target: str, rules: list[str]) -> str:
    return f"{module.path}:{line}: room {module.room} imports {target} ({'; '.join(rules)})"


def import_violations(root: Path) -> list[str]:
    """Every import (and class base) of the product code under root that breaks a rule."""
    root = root.resolve()
    modules = product_modules(root)
    known = {m.name for m in modules}
    found = []
    for module in modules:
        for imp in module_imports(root, module, known):
            rules = broken_rules(imp)
            if rules:
                found.append((module.path, imp.line, _line(module, imp.line, imp.target, rules)))
    found += base_class_violations(root, modules)
    return [text for _, _, text in sorted(found)]


# ---- Base classes ---------------------------------------------------------------------------


def _bindings(root: Path, module: Module, known: set[str]) -> dict[str, str]:
    """Local name -> absolute dotted name, for the names a module binds by importing."""
    names: dict[str, str] = {}
    for node in ast.walk(_tree(root, module)):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:  # `import a.b as c` binds c to a.b
                    names[a.asname] = a.name
                else:  # `import a.b` binds a
                    head = a.name.partition(".")[0]
                    names[head] = head
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, node)
            for a in node.names:
                names[a.asname or a.name] = f"{base}.{a.name}"
    return names


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Subscript):  # Generic[T], Base[int]
        return _dotted(node.value)
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        value = _dotted(node.value)
        return f"{value}.{node.attr}" if value else None
    return None


def _defining_module(root: Path, qualname: str, by_name: dict[str, Module]) -> str:
    """Follow re-exports (`from pdserve.x import Base` in pdserve.y) to the defining module."""
    for _ in range(20):  # a cycle of re-exports would otherwise loop
        module_name, _, name = qualname.rpartition(".")
        module = by_name.get(module_name)
        if module is None:
            return module_name
        tree = _tree(root, module)
        if any(isinstance(n, ast.ClassDef) and n.name == name for n in tree.body):
            return module_name
        imported = _bindings(root, module, set(by_name)).get(name)
        if imported is None:
            return module_name
        qualname = imported
    return qualname


def base_class_violations(root: Path, modules: list[Module]) -> list[tuple[Path, int, str]]:
    by_name = {m.name: m for m in modules}
    found = []
    for module in (m for m in modules if m.room in OWN_BASES_ROOMS):
        names = _bindings(root, module, set(by_name))
        for cls in (n for n in ast.walk(_tree(root, module)) if isinstance(n, ast.ClassDef)):
            for base in cls.bases:
                dotted = _dotted(base)
                head, _, rest = (dotted or "").partition(".")
                if head not in names:
                    continue  # defined in this module, or a builtin
                qualname = names[head] + (f".{rest}" if rest else "")
                base_room = room_of(_defining_module(root, qualname, by_name))
                if base_room is None or base_room == module.room:
                    continue
                rule = f"class {cls.name} inherits from a class of room {base_room}"
                found.append((module.path, cls.lineno, _line(module, cls.lineno, qualname, [rule])))
    return found


# ---- Sizes ----------------------------------------------------------------------------------


def _is_triton_kernel(module: Module, node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    if not module.path.match(TRITON_KERNEL_FILES):
        return False
    decorators = (d.func if isinstance(d, ast.Call) else d for d in node.decorator_list)
    return any(_dotted(d) in TRITON_JIT for d in decorators)


def size_violations(root: Path) -> list[str]:
    """Modules over MAX_MODULE_LINES lines and functions over MAX_FUNCTION_LINES lines."""
    root = root.resolve()
    found: list[tuple[Path, int, str]] = []
    for module in product_modules(root):
        lines = len((root / module.path).read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            text = f"{module.path}:1: module has {lines} lines (limit {MAX_MODULE_LINES})"
            found.append((module.path, 1, text))
        for node in ast.walk(_tree(root, module)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES and not _is_triton_kernel(module, node):
                text = (
                    f"{module.path}:{node.lineno}: function {node.name} has {length} lines "
                    f"(limit {MAX_FUNCTION_LINES})"
                )
                found.append((module.path, node.lineno, text))
    return [text for _, _, text in sorted(found)]
