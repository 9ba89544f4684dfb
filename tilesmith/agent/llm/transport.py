"""HTTP transports that send the agent's model requests to the private proxy, wherever it runs now.

The OpenAI client inside ``ChatOpenAI`` is built once, with a placeholder key. These transports, given
to it as ``http_client``/``http_async_client``, rewrite each request's host and port to the live
proxy and set ``Authorization: Bearer <per-run client key>``; so

* the client key never sits in the chat model object (nothing can serialize it into a trace), and
* a proxy restarted on another port (:meth:`PrivateProxy.ensure_running`) is used without rebuilding
  the agent. A connection refused by a proxy that has just died triggers that restart and one resend of
  the same request — inside the same model invocation, so it never counts against ``max_model_calls``.

Only loopback is ever contacted (``trust_env=False``: ``HTTP(S)_PROXY`` settings do not apply to it).
"""

from __future__ import annotations

import asyncio

import httpx

from tilesmith.agent.llm.proxy import PrivateProxy

PLACEHOLDER_KEY = "tilesmith-private-proxy"
"""What ``ChatOpenAI`` holds as its api key; the transport replaces it on the wire."""


def _retarget(request: httpx.Request, proxy: PrivateProxy) -> None:
    request.url = request.url.copy_with(scheme="http", host="127.0.0.1", port=proxy.port)
    request.headers["Authorization"] = f"Bearer {proxy.client_key}"


class ProxyTransport(httpx.BaseTransport):
    """Synchronous transport to the run's private proxy (see the module docstring)."""

    def __init__(self, proxy: PrivateProxy) -> None:
        self._proxy = proxy
        self._inner = httpx.HTTPTransport(retries=0)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self._proxy.ensure_running()
        _retarget(request, self._proxy)
        try:
            return self._inner.handle_request(request)
        except httpx.ConnectError:
            if self._proxy.alive():
                raise
        self._proxy.ensure_running()  # died under us: restart (once per run) and resend
        _retarget(request, self._proxy)
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()


class AsyncProxyTransport(httpx.AsyncBaseTransport):
    """Asynchronous twin of :class:`ProxyTransport` (proxy (re)starts run in a worker thread)."""

    def __init__(self, proxy: PrivateProxy) -> None:
        self._proxy = proxy
        self._inner = httpx.AsyncHTTPTransport(retries=0)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await asyncio.to_thread(self._proxy.ensure_running)
        _retarget(request, self._proxy)
        try:
            return await self._inner.handle_async_request(request)
        except httpx.ConnectError:
            if self._proxy.alive():
                raise
        await asyncio.to_thread(self._proxy.ensure_running)
        _retarget(request, self._proxy)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def http_clients(proxy: PrivateProxy, timeout_s: float) -> tuple[httpx.Client, httpx.AsyncClient]:
    """A (sync, async) pair of httpx clients bound to ``proxy``; ``timeout_s`` is the read timeout."""
    timeout = httpx.Timeout(timeout_s, connect=5.0)
    return (httpx.Client(transport=ProxyTransport(proxy), timeout=timeout, trust_env=False),
            httpx.AsyncClient(transport=AsyncProxyTransport(proxy), timeout=timeout, trust_env=False))
