"""The folder a GGUF file is served from: config, tokenizer, chat template and generation
settings written from the GGUF's metadata into the cache, with a marker naming the file.

The weights stay in the GGUF file: `engine/gguf_loader.py` reads them from there, packed.
Everything else (the gateway's tokenizer, `pdserve.LLM`, the ranks' config) reads the folder
as it reads any checkpoint folder. The folder is keyed by the file's path, size and
modification time, written under a temporary name and renamed into place (as the embedded
model's conversion, whose metadata writer it shares).

    folder = prepare_gguf(Path("model.Q4_1.gguf"))   # once per file
    gguf_source(folder)                               # -> the GGUF path, or None
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from pathlib import Path

from pdserve.engine import embedded
from pdserve.engine.gguf_file import GGUFError, GGUFFile

MARKER_FILE = "pdserve-gguf.json"
# Bump when the folder's contents change, so stale folders get rewritten.
VERSION = 1
# The tokenizers built from GGUF metadata (`embedded.build_tokenizer`): (model, pre).
BUILT_TOKENIZERS = (("gpt2", "smollm"),)
# The matrices whose columns a tensor-parallel rank holds a part of.
ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def prepare_gguf(path: Path, cache: Path | None = None) -> Path:
    """The folder serving `path`, written first if needed; GGUFError (one line) for a file
    that cannot be served: an architecture, a tensor type or a tokenizer not built here."""
    source = path.expanduser().resolve()
    stat = source.stat()
    key = hashlib.sha256(f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    target = (cache or embedded.cache_dir()) / "gguf" / key[:16] / source.stem
    if _marker(target) is not None:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{source.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _marker(target) is None:
            embedded.convert_gguf_to_folder(source, target, write_folder)
    return target


def write_folder(source: Path, folder: Path) -> None:
    """Checks the file, then writes the folder's files and the marker."""
    try:
        _write_folder(source, folder)
    except embedded.EmbeddedModelError as exc:  # a missing key, another architecture
        raise GGUFError(str(exc)) from None


def _write_folder(source: Path, folder: Path) -> None:
    file = GGUFFile(source)
    file.check_types()
    meta = file.metadata
    kind = (meta.get("tokenizer.ggml.model", None), meta.get("tokenizer.ggml.pre", None))
    if kind not in BUILT_TOKENIZERS:
        built = ", ".join(f"{m}/{p}" for m, p in BUILT_TOKENIZERS)
        raise GGUFError(
            f"{source}: tokenizer {kind[0]}/{kind[1]} is not built from GGUF metadata here "
            f"(built: {built})"
        )
    embedded.write_model_files(meta, "lm_head.weight" not in file.tensors, folder)
    stat = source.stat()
    marker = {"version": VERSION, "gguf": str(source), "size": stat.st_size}
    embedded.write_json(folder / MARKER_FILE, marker)


def gguf_source(folder: str | Path) -> Path | None:
    """The GGUF file a prepared folder serves, None for any other folder; GGUFError when
    the file is gone or changed since the folder was written."""
    marker = _marker(Path(folder))
    if marker is None:
        return None
    source = Path(marker["gguf"])
    try:
        size = source.stat().st_size
    except OSError:
        raise GGUFError(f"{folder}: its GGUF file {source} is gone") from None
    if size != marker["size"]:
        raise GGUFError(f"{folder}: its GGUF file {source} changed since; serve the file again")
    return source


def _marker(folder: Path) -> dict | None:
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("version") != VERSION:
        return None
    return marker


def check_tp_blocks(folder: str | Path, tp_size: int) -> None:
    """GGUFError (one line) where `tp_size` ranks would split a row-parallel matrix (the
    attention output, the down projection) of a prepared GGUF inside its blocks: each rank
    holds whole blocks of columns (32, a K-quant's super-blocks 256) with their scales.
    Nothing to check for other folders."""
    source = gguf_source(folder)
    if source is None or tp_size == 1:
        return
    file = GGUFFile(source)
    for name, t in file.tensors.items():
        if not name.endswith(ROW_PARALLEL) or not t.packed:
            continue
        columns = t.shape[1] // tp_size
        if columns % t.block:
            raise GGUFError(
                f"{source}: tensor_parallel_size {tp_size} gives each rank {columns} columns "
                f"of {t.gguf_name!r} ({t.type_name}), not whole {t.block}-weight blocks"
            )
