"""Safe by default: a server reachable beyond this machine needs keys.

`pdserve serve --host H` with H not a loopback address (0.0.0.0, ::, a node's address,
a name that resolves to one) is refused unless both the tenants' keys (`--api-key`,
`--api-keys-file` or PDSERVE_API_KEY) and the admin key (`--admin-api-key` or
PDSERVE_ADMIN_API_KEY) are configured, or `--allow-unauthenticated` says the network
in front of it is trusted. Without keys every route, `/admin/*` included, is open to
whoever reaches the port. Checked first, before the serving stack loads.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
from collections.abc import Mapping

API_KEY_ENV = "PDSERVE_API_KEY"
ADMIN_API_KEY_ENV = "PDSERVE_ADMIN_API_KEY"
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


class ExposureError(ValueError):
    """Binding beyond loopback without keys; the message is one line."""


def is_loopback(host: str) -> bool:
    """Whether `host` binds only this machine's loopback interface. An empty host or a
    wildcard binds every interface; a name counts as loopback only if every address it
    resolves to is one (a name that does not resolve is refused later, at bind)."""
    name = host.strip().strip("[]")
    if not name:
        return False
    if name.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return True
    addresses = {info[4][0] for info in found}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def missing_keys(args: argparse.Namespace, environ: Mapping[str, str]) -> list[str]:
    """The kinds of key not configured, each as the flags and variable that set it."""
    missing = []
    if not (args.api_key or args.api_keys_file or environ.get(API_KEY_ENV)):
        missing.append(f"tenant keys (--api-key, --api-keys-file or {API_KEY_ENV})")
    if not (args.admin_api_key or environ.get(ADMIN_API_KEY_ENV)):
        missing.append(f"an admin key (--admin-api-key or {ADMIN_API_KEY_ENV})")
    return missing


def check_exposure(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> None:
    """Raises ExposureError when `--host` reaches beyond loopback without keys."""
    if args.allow_unauthenticated or is_loopback(args.host):
        return
    missing = missing_keys(args, os.environ if environ is None else environ)
    if missing:
        raise ExposureError(
            f"--host {args.host} is reachable beyond this machine, so it needs "
            f"{' and '.join(missing)}; give them, bind 127.0.0.1, or pass "
            "--allow-unauthenticated behind a trusted network"
        )
