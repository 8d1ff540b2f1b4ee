"""The proxy's HTTP client to its upstreams: httpx's transport, without httpx's client.

The proxy forwards every model call, so what its client does per request is added to every
call. `httpx.AsyncClient` parses and merges the URL, runs auth and redirect handling and keeps
a cookie jar on every request: about 0.3 ms a call on the dev VM, for features the proxy must
not use (a shared cookie jar would carry one agent's upstream cookies into every later call,
and the agent's own client follows its redirects). The transport under it,
`httpx.AsyncHTTPTransport`, keeps what matters: one pool of keep-alive connections per proxy
(no TCP, TLS or DNS work per call once a connection is open), timeouts, and httpx's `Response`,
which decodes gzip, deflate, brotli or zstd as the upstream chose.

The environment's proxy variables (`HTTPS_PROXY`, `HTTP_PROXY`, `ALL_PROXY`, `NO_PROXY`), which
the client honoured, still apply: each upstream origin gets a proxied transport when
`urllib.request` says its host is not bypassed, decided once per origin.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Sequence

import httpx

# URLs parsed once: an agent calls the same few endpoints again and again.
_URL_CACHE_SIZE = 256
# What the client asked upstream for, as httpx's client did (the agent's own accept-encoding is
# not forwarded: it gets the decoded bytes the tape records).
ACCEPT_ENCODING = ("accept-encoding", "gzip, deflate")


class UpstreamClient:
    def __init__(self, timeout: httpx.Timeout) -> None:
        self._timeout = timeout.as_dict()
        self._direct = httpx.AsyncHTTPTransport(http2=False)
        # {(scheme, host, port): transport}: a proxied one, or the direct one.
        self._routes: dict[tuple[str, str, int | None], httpx.AsyncHTTPTransport] = {}
        self._proxied: list[httpx.AsyncHTTPTransport] = []
        self._urls: dict[str, httpx.URL] = {}

    def request(
        self, method: str, url: str, headers: Sequence[tuple[str, str]], content: bytes
    ) -> httpx.Request:
        parsed = self._urls.get(url)
        if parsed is None:
            parsed = httpx.URL(url)
            if len(self._urls) >= _URL_CACHE_SIZE:
                self._urls.clear()
            self._urls[url] = parsed
        headers = [*headers, ACCEPT_ENCODING]
        request = httpx.Request(method, parsed, headers=headers, content=content)
        request.extensions["timeout"] = self._timeout
        return request

    async def send(self, request: httpx.Request) -> httpx.Response:
        """The response with its body unread (`aiter_bytes`, `aread`; then `aclose`)."""
        response = await self._transport(request.url).handle_async_request(request)
        response.request = request
        return response

    def _transport(self, url: httpx.URL) -> httpx.AsyncHTTPTransport:
        key = (url.scheme, url.host, url.port)
        transport = self._routes.get(key)
        if transport is None:
            transport = self._routes[key] = self._route(url)
        return transport

    def _route(self, url: httpx.URL) -> httpx.AsyncHTTPTransport:
        proxies = urllib.request.getproxies()
        proxy = proxies.get(url.scheme) or proxies.get("all")
        if not proxy or urllib.request.proxy_bypass(url.host):
            return self._direct
        transport = httpx.AsyncHTTPTransport(
            http2=False, proxy=proxy if "://" in proxy else f"http://{proxy}"
        )
        self._proxied.append(transport)
        return transport

    async def aclose(self) -> None:
        for transport in (self._direct, *self._proxied):
            await transport.aclose()
