"""Does one huge request stall the others? Largest gap of a streamed completion while a big prompt arrives.

    mtpspec serve --device cpu --port 8131 &
    python benchmarks/probe_server_stall.py --url http://127.0.0.1:8131 --prompt-mb 10

Streams one completion alone (``--max-tokens`` tokens, ``ignore_eos``) for the baseline, then again
while a ``--prompt-mb`` MB text prompt is posted 1 s in and ``GET /health`` 2 s in. Prints the
stream's largest gap between chunks (s) and its total, the big request's status and seconds, and
the health check's status and seconds. CPU host figures: the server's process only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx


async def _stream(client: httpx.AsyncClient, url: str, max_tokens: int):
    gaps, last = [], time.perf_counter()
    t0 = last
    body = {"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data"):
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
    return round(max(gaps[1:]), 3), round(time.perf_counter() - t0, 2)


async def _big(client: httpx.AsyncClient, url: str, payload: bytes):
    await asyncio.sleep(1.0)
    t = time.perf_counter()
    r = await client.post(url + "/v1/completions", content=payload, headers={"content-type": "application/json"})
    return r.status_code, round(time.perf_counter() - t, 2)


async def _health(client: httpx.AsyncClient, url: str):
    await asyncio.sleep(2.0)
    t = time.perf_counter()
    r = await client.get(url + "/health")
    return r.status_code, round(time.perf_counter() - t, 3)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8131")
    ap.add_argument("--prompt-mb", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=600)
    args = ap.parse_args()
    payload = json.dumps({"prompt": "word " * int(args.prompt_mb * 2 ** 20 / 5), "max_tokens": 2}).encode()
    async with httpx.AsyncClient(timeout=600) as client:
        gap, total = await _stream(client, args.url, args.max_tokens)
        print(f"alone: stream's largest gap {gap} s, total {total} s")
        (gap, total), big, health = await asyncio.gather(_stream(client, args.url, args.max_tokens),
                                                         _big(client, args.url, payload), _health(client, args.url))
        print(f"with a {args.prompt_mb} MB prompt: stream's largest gap {gap} s, total {total} s; big request "
              f"{big[0]} after {big[1]} s; /health {health[0]} after {health[1]} s")


if __name__ == "__main__":
    asyncio.run(main())
