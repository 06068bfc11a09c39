"""Hands the deployment secret to Ray actors as a private file on their node.

Ray's state API (`ray list actors --detail`) shows every actor's `runtime_env` to anyone
who may list actors, so the secret never goes there: actors get
`PDSERVE_DEPLOYMENT_SECRET_FILE`, a path, and read the file (0600, in a 0700 folder) on
their own node. The operator's file is used when the environment names one (on a
cluster of several nodes it must be at that path on every node); otherwise the secret
this process holds is written once to a file of its own, removed when it exits, which
serves the nodes of this machine (a Ray cluster started here, or local nodes).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile

from pdserve.common.wire_auth import SECRET_FILE_ENV, ensure_secret, read_secret_file

_written: dict[str, str] = {}  # the file written for each secret this process held


def secret_file() -> str:
    """The path of a 0600 file holding this deployment's secret (written at most once)."""
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        read_secret_file(path)  # refuses a missing, empty or too open file here, at once
        return path
    secret = ensure_secret()
    if secret in _written:
        return _written[secret]
    folder = tempfile.mkdtemp(prefix="pdserve-secret-")  # 0700
    path = os.path.join(folder, "deployment.secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    atexit.register(_remove, folder)
    _written[secret] = path
    return path


def secret_runtime_env() -> dict[str, dict[str, str]]:
    """An actor's `runtime_env`: where the secret's file is, never the secret."""
    return {"env_vars": {SECRET_FILE_ENV: secret_file()}}


def _remove(folder: str) -> None:
    with contextlib.suppress(OSError):
        shutil.rmtree(folder)
