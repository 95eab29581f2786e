"""Whether the Hugging Face hub can be reached, asked once per process and quickly, so that an offline
machine loads a hub dataset from its local cache at once (or says in one line that it cannot) instead of
waiting through `huggingface_hub`'s retries (five, about 25 s).

    with hub_or_cache() as online:   # online False: datasets and huggingface_hub read the cache only
        datasets.load_dataset(name, split=split)
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from collections.abc import Iterator
from urllib.parse import urlparse

PROBE_TIMEOUT = 3.0  # seconds for one TCP connection to the hub (or the proxy in front of it)
_OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def endpoint() -> str:
    """The hub's address (HF_ENDPOINT, default https://huggingface.co)."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _probe_target() -> tuple[str, int] | None:
    """(host, port) a request to the hub connects to first: its proxy when one is set, else the hub."""
    url = urlparse(endpoint())
    proxy = next(
        (
            os.environ[k]
            for k in (f"{url.scheme}_proxy", f"{url.scheme.upper()}_PROXY", "all_proxy", "ALL_PROXY")
            if os.environ.get(k)
        ),
        None,
    )
    target = urlparse(proxy if "://" in (proxy or "") else f"http://{proxy}") if proxy else url
    if not target.hostname:
        return None
    return target.hostname, target.port or (443 if target.scheme == "https" else 80)


@functools.cache
def hub_reachable() -> bool:
    """One TCP connection to the hub (or its proxy) within PROBE_TIMEOUT; True when it cannot be tried."""
    if any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on") for k in _OFFLINE_ENV):
        return False  # the user said offline: the libraries read the cache alone already
    target = _probe_target()
    if target is None:
        return True
    try:
        with socket.create_connection(target, timeout=PROBE_TIMEOUT):
            return True
    except OSError:  # no route, name not resolved, refused, timed out
        return False


@contextlib.contextmanager
def hub_or_cache() -> Iterator[bool]:
    """Inside: `datasets` and `huggingface_hub` in offline mode (the local cache only) when the hub
    cannot be reached; yields whether it can."""
    online = hub_reachable()
    if online:
        yield True
        return
    import datasets.config  # noqa: PLC0415 - datasets is heavy
    import huggingface_hub.constants as hub  # noqa: PLC0415 - under datasets

    before = (datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield False
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = before
