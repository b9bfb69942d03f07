"""A reverse proxy in front of several llmgw web processes, as an operator would put HAProxy or nginx there.

    python tests/integration/proxy.py --port 8080 http://127.0.0.1:8001 http://127.0.0.1:8002

Round-robin over the upstreams, with the retry policy such a proxy is configured with for llmgw (HAProxy's
`retry-on conn-failure empty-response`, nginx's `proxy_next_upstream error timeout non_idempotent`): a request
whose connection was refused, or closed before a single response byte came back, goes to the next upstream. Once response bytes
have come back the request is never retried; the response, streamed or not, is passed through as it comes.
Prints `proxy: listening` once it accepts connections and one line per retry.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys

import aiohttp
from aiohttp import web

HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection", "host",
       "content-length"}
# refused, or closed before a response byte: ClientOSError is also a keep-alive connection the stopping server
# reset just as a request went out on it (ConnectionResetError while reading the status line)
RETRYABLE = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--give-up-after", type=float, default=30.0, help="seconds of failed tries before a 502")
    parser.add_argument("upstreams", nargs="+")
    args = parser.parse_args()
    upstreams = itertools.cycle(args.upstreams)
    session: aiohttp.ClientSession | None = None

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + args.give_up_after
        while True:
            upstream = next(upstreams)
            try:
                answer = await session.request(request.method, upstream + request.path_qs, data=body, headers=headers,
                                               allow_redirects=False)
            except RETRYABLE as exc:
                print(f"proxy: {request.method} {request.path} to {upstream}: {exc!r}; trying the next", flush=True)
                if loop.time() > deadline:
                    return web.Response(status=502, text=f"no upstream answered: {exc}")
                await asyncio.sleep(0.02)
                continue
            break
        async with answer:
            out = web.StreamResponse(status=answer.status, headers={
                k: v for k, v in answer.headers.items() if k.lower() not in HOP})
            await out.prepare(request)
            try:
                async for chunk in answer.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            except ConnectionResetError:  # the client left (an openai client closes a stream once it has [DONE])
                pass
            return out

    async def run() -> None:
        nonlocal session
        session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None, sock_read=300))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.port).start()
        print("proxy: listening", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
