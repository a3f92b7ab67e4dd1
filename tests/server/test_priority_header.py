"""A request's priority, as vLLM 0.32 takes it: the body's ``priority``, or the ``X-Vllm-Priority`` header, an
integer, which wins over the body (vLLM's ``OpenAIServing._get_priority``; a header that is not an integer is
ignored). With ``--scheduling-policy priority`` the waiting queue runs lower values first. (With the default fcfs
vLLM 0.32 takes any priority and ignores it, with no error; so does pdpool: tests/server/test_server_completions.py
sends ``priority: 1`` to an fcfs node.)"""

from __future__ import annotations

import asyncio

import httpx
import pytest


@pytest.fixture(scope="module")
def one_at_a_time(launch_server):
    srv = launch_server("--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "96",
                        "--max-num-seqs", "1", "--scheduling-policy", "priority")
    yield srv
    srv.stop()


async def finish_order(server, queued: list[tuple[str, dict, dict]]) -> list[str]:
    """Start a long request, and once its first token is out queue ``queued`` ((name, body fields, headers)), in
    that order; the names in the order their answers finish."""
    done: list[str] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        async def complete(name: str, extra: dict, headers: dict) -> None:
            body = {"model": "demo", "prompt": f"Count to ten ({name}):", "max_tokens": 2, "temperature": 0,
                    "ignore_eos": True, **extra}
            r = await client.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            done.append(name)

        long_body = {"model": "demo", "prompt": "Write a long story.", "max_tokens": 80, "temperature": 0,
                     "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=long_body) as stream:
            lines = stream.aiter_lines()
            while not (await anext(lines)).startswith("data: {"):
                pass
            tasks = []
            for name, extra, headers in queued:
                tasks.append(asyncio.create_task(complete(name, extra, headers)))
                await asyncio.sleep(0.05)   # arrival order: the tie-break
            async for _ in lines:
                pass
            done.append("long")
            await asyncio.gather(*tasks)
    return done


def test_the_header_wins_over_the_body(one_at_a_time):
    order = asyncio.run(finish_order(one_at_a_time, [
        ("header-9", {"priority": 0}, {"X-Vllm-Priority": "9"}),     # the body's 0 is overridden: it waits
        ("body-5", {"priority": 5}, {}),
        ("not-a-number", {"priority": 1}, {"X-Vllm-Priority": "soon"}),   # ignored: the body's 1
    ]))
    assert order == ["long", "not-a-number", "body-5", "header-9"]
