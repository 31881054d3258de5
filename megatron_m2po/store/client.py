"""Python producer client of ``m2po store serve`` — synchronous and asyncio.

    client = StoreClient("http://127.0.0.1:8765", token=os.environ["M2PO_STORE_TOKEN"])
    v = client.get_version()                 # the trainer's current weight version
    client.put_groups(groups)                # returns after the server committed them

    async with AsyncStoreClient(url, token=tok) as c:
        await c.put_groups(groups)

Retries with exponential backoff (``backoff_s * 2**attempt``, capped at ``backoff_max_s``, with
jitter) on connection errors, timeouts, 5xx and 429 (honouring ``Retry-After``); never on
other 4xx, which mean the request itself is wrong and raise :class:`StoreClientError` with the
server's message. Retrying a put is safe: the server is idempotent by group id, so a group whose
acknowledgement was lost comes back under ``duplicates``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import urllib.error
import urllib.request
from typing import Any, Iterable, Optional

from megatron_m2po.store.codec import BINARY_CONTENT_TYPE, JSON_CONTENT_TYPE, encode_binary, encode_json
from megatron_m2po.store.types import Group

__all__ = ["StoreClient", "AsyncStoreClient", "StoreClientError"]


class StoreClientError(RuntimeError):
    """The server refused a request (4xx) or retries were exhausted."""

    def __init__(self, status: Optional[int], message: str):
        super().__init__(f"store server answered {status}: {message}" if status else message)
        self.status = status
        self.message = message


class _Base:
    def __init__(self, url: str, token: Optional[str] = None, *, encoding: str = "binary", timeout_s: float = 120.0,
                 max_retries: int = 5, backoff_s: float = 0.2, backoff_max_s: float = 10.0,
                 token_env: str = "M2PO_STORE_TOKEN"):
        if encoding not in ("binary", "json"):
            raise ValueError(f"encoding={encoding!r} must be 'binary' or 'json'")
        self.url = url.rstrip("/")
        self.token = token if token is not None else (os.environ.get(token_env) or None)
        self.encoding = encoding
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s

    def _headers(self, ctype: Optional[str] = None) -> dict:
        h = {}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        if ctype:
            h["Content-Type"] = ctype
        return h

    def _encode(self, groups: Iterable[Group]) -> tuple[bytes, str]:
        groups = list(groups)
        if self.encoding == "binary":
            return encode_binary(groups), BINARY_CONTENT_TYPE
        return encode_json(groups), JSON_CONTENT_TYPE

    def _delay(self, attempt: int, retry_after: Optional[str]) -> float:
        d = min(self.backoff_max_s, self.backoff_s * (2 ** attempt)) * random.uniform(0.8, 1.2)
        if retry_after:
            try:
                d = max(d, float(retry_after))
            except ValueError:
                pass
        return d

    @staticmethod
    def _message(body: bytes) -> str:
        try:
            return json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            return body[:500].decode("utf-8", "replace")


class StoreClient(_Base):
    """Blocking client (standard library only)."""

    def _request(self, method: str, path: str, body: Optional[bytes] = None, ctype: Optional[str] = None) -> Any:
        last = ""
        for attempt in range(self.max_retries + 1):
            req = urllib.request.Request(self.url + path, data=body, method=method, headers=self._headers(ctype))
            retry_after = None
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as e:
                data = e.read()
                if e.code < 500 and e.code != 429:
                    raise StoreClientError(e.code, self._message(data)) from None
                last = f"{e.code}: {self._message(data)}"
                retry_after = e.headers.get("Retry-After")
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                last = f"{type(e).__name__}: {e}"
            if attempt < self.max_retries:
                time.sleep(self._delay(attempt, retry_after))
        raise StoreClientError(None, f"{method} {self.url}{path} failed after {self.max_retries + 1} attempts; last: {last}")

    def put_groups(self, groups: Iterable[Group]) -> dict:
        """POST groups; returns ``{"stored": [...], "duplicates": [...], "pending": [...]}`` after commit."""
        body, ctype = self._encode(groups)
        return self._request("POST", "/v1/groups", body, ctype)

    def health(self) -> dict:
        return self._request("GET", "/health")

    def stats(self) -> dict:
        return self._request("GET", "/v1/stats")

    def get_version(self) -> Optional[int]:
        return self._request("GET", "/v1/version")["version"]

    def set_version(self, version: int) -> None:
        self._request("POST", "/v1/version", json.dumps({"version": version}).encode(), JSON_CONTENT_TYPE)


class AsyncStoreClient(_Base):
    """asyncio client on aiohttp; use as ``async with`` or call :meth:`close`."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._session = None

    async def _sess(self):
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def _request(self, method: str, path: str, body: Optional[bytes] = None, ctype: Optional[str] = None) -> Any:
        import aiohttp

        sess = await self._sess()
        last = ""
        for attempt in range(self.max_retries + 1):
            retry_after = None
            try:
                async with sess.request(method, self.url + path, data=body, headers=self._headers(ctype)) as r:
                    data = await r.read()
                    if r.status < 300:
                        return json.loads(data)
                    if r.status < 500 and r.status != 429:
                        raise StoreClientError(r.status, self._message(data))
                    last = f"{r.status}: {self._message(data)}"
                    retry_after = r.headers.get("Retry-After")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                last = f"{type(e).__name__}: {e}"
            if attempt < self.max_retries:
                await asyncio.sleep(self._delay(attempt, retry_after))
        raise StoreClientError(None, f"{method} {self.url}{path} failed after {self.max_retries + 1} attempts; last: {last}")

    async def put_groups(self, groups: Iterable[Group]) -> dict:
        body, ctype = self._encode(groups)
        return await self._request("POST", "/v1/groups", body, ctype)

    async def health(self) -> dict:
        return await self._request("GET", "/health")

    async def stats(self) -> dict:
        return await self._request("GET", "/v1/stats")

    async def get_version(self) -> Optional[int]:
        return (await self._request("GET", "/v1/version"))["version"]

    async def set_version(self, version: int) -> None:
        await self._request("POST", "/v1/version", json.dumps({"version": version}).encode(), JSON_CONTENT_TYPE)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "AsyncStoreClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
