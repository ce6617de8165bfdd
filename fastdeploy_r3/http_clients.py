"""httpx clients for the calls this project's processes make to each other (PD's bootstrap server),
every one built on the one TLS context of its process.

httpx builds a fresh TLS context for each client it creates, loading the CA bundle: 15-30 ms of CPU on a
small machine, paid even for plain-HTTP URLs. A request through prefill/decode disaggregation paid it
three times on its way to the first token (the handoff's long poll, the room's manifest, the CTM's
transfer request); with the shared context a client costs well under a millisecond.
"""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def sync_client(timeout: float | httpx.Timeout | None = 5.0) -> httpx.Client:
    return httpx.Client(timeout=timeout, verify=_tls())


def async_client(timeout: float | httpx.Timeout | None = 5.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=timeout, verify=_tls())
