"""One instance as a plain process (the local launcher's children):

    python -m pdserve.instance.main colocated-0 --spec '{"instance_id": ..., ...}'

Prints `PDSERVE-READY <InstanceInfo JSON>` on stdout once the weights are loaded (or
`PDSERVE-FAILED <reason>` and exits 1), then steps until SIGTERM or SIGINT. With
PDSERVE_PARENT_PID set it also ends when that process dies, so an instance never
outlives its launcher.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys

import msgspec

READY_PREFIX = "PDSERVE-READY "
FAILED_PREFIX = "PDSERVE-FAILED "
_PR_SET_PDEATHSIG = 1


def follow_parent() -> None:
    """Linux: get SIGTERM when the launcher dies, even by SIGKILL."""
    parent = os.environ.get("PDSERVE_PARENT_PID")
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        return
    if os.getppid() != int(parent):  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def set_title(role: str, instance_id: str) -> None:
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(f"pdserve::{role.capitalize()}Instance {instance_id}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.instance.main")
    parser.add_argument("instance_id", help="shown in ps; must match the spec")
    parser.add_argument("--spec", required=True, help="InstanceSpec as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("PDSERVE_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s {args.instance_id} %(levelname)s %(name)s: %(message)s",
    )
    follow_parent()
    # Imported here so a bad spec fails fast, before torch loads.
    from pdserve.instance.spec import InstanceSpec

    try:
        spec = msgspec.json.decode(args.spec, type=InstanceSpec)
    except msgspec.DecodeError as exc:
        print(f"{FAILED_PREFIX}bad instance spec: {exc}", flush=True)
        return 1
    set_title(spec.role, spec.instance_id)
    loop = None
    try:
        from pdserve.instance.loop import StepLoop

        loop = StepLoop(spec)
        loop.on_role = lambda role: set_title(role, spec.instance_id)
        info = loop.load()
    except Exception as exc:  # whatever stops the load becomes one line for the launcher
        print(f"{FAILED_PREFIX}{type(exc).__name__}: {' '.join(str(exc).split())}", flush=True)
        if loop is not None:
            loop.close()
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: loop.stop())
    print(READY_PREFIX + msgspec.json.encode(info).decode(), flush=True)
    ended = loop.run()
    if ended is not None:
        print(f"{FAILED_PREFIX}{' '.join(ended.split())}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
