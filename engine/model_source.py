"""Where a model's files are: a checkpoint folder, a GGUF file (`engine/gguf_prepare.py`),
or a Hugging Face id resolved through `huggingface_hub` (its cache,
`HF_HOME`/`HF_HUB_CACHE`, `HF_HUB_OFFLINE`, a revision, a download folder), as `vllm
serve MODEL` does. Resolved once by the driver (`pdserve serve`, the offline `LLM`), so
instances and the gateway get a local folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What a served checkpoint needs: config, weights, tokenizer and chat template.
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model"]
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class ModelNotFound(ValueError):
    """The model is neither a folder nor a resolvable Hugging Face id (one line)."""


def resolve_model(name: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The local folder holding `name`'s checkpoint; for a GGUF file, the folder prepared
    from its metadata (`engine/gguf_prepare.py`: its weights stay in the file)."""
    if name.lower().endswith(".gguf") and Path(name).expanduser().is_file():
        if revision is not None:
            raise ModelNotFound(f"--revision {revision} applies to a Hugging Face id, not {name}")
        from pdserve.engine.gguf_prepare import prepare_gguf

        return prepare_gguf(Path(name))
    folder = Path(name).expanduser()
    if folder.is_dir():
        if revision is not None:
            raise ModelNotFound(f"--revision {revision} applies to a Hugging Face id, not {name}")
        return folder
    if not _REPO_ID.match(name):
        raise ModelNotFound(f"{name}: no such checkpoint folder (nor a Hugging Face id org/name)")
    return _from_hub(name, revision, download_dir)


def _from_hub(repo_id: str, revision: str | None, download_dir: str | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    cache = download_dir or constants.HF_HUB_CACHE
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "") in ("1", "true")
    where = f"in the Hugging Face cache {cache}" + (" (HF_HUB_OFFLINE is set)" if offline else "")
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir,
            local_files_only=offline,
            allow_patterns=CHECKPOINT_FILES,
        )
    except (LocalEntryNotFoundError, HfHubHTTPError, HFValidationError, OSError) as exc:
        kind = type(exc).__name__
        at = f" at revision {revision}" if revision else ""
        raise ModelNotFound(
            f"{repo_id}: no such checkpoint folder, and the Hugging Face model{at} is not "
            f"{where} nor reachable ({kind})"
        ) from None
    return Path(folder)
