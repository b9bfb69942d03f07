"""An agent with several control planes (`--server A,B`): dialled in order, the next when one does not answer."""

import asyncio
import socket
import time

import pytest

from agents.agent import Agent, agent_url, agent_urls
from ground.facts import gather
from tests.agents.test_agent import TOKEN, FakeServer, receive

pytestmark = pytest.mark.integration  # real websocket servers on loopback


def test_agent_urls_of_several_control_planes():
    assert agent_urls("http://10.0.0.1:8000, https://b.example.com/llmgw/,http://10.0.0.1:8000") == [
        "ws://10.0.0.1:8000/ws/agent/", "wss://b.example.com/llmgw/ws/agent/"]
    with pytest.raises(ValueError, match="not a server URL"):
        agent_urls("http://10.0.0.1:8000,10.0.0.2:8000")
    with pytest.raises(ValueError, match="no server URL"):
        agent_urls(" , ")


def test_an_agent_with_two_servers_dials_the_next_when_one_does_not_answer(tmp_path):
    """Two control planes: the first listed is dialled first; when it goes away (its process killed), the agent is
    on the other within a second, without waiting out a backoff; a dead first URL costs no time either."""

    async def scenario():
        first, second = FakeServer(), FakeServer()
        url_a, url_b = await first.start(), await second.start()
        facts = gather(gpus=[], engines={"command": ""})
        agent = Agent(f"{url_a},{url_b}", TOKEN, tmp_path / "state", facts)
        task = asyncio.create_task(agent.run())
        ws = await asyncio.wait_for(first.streams.get(), 10)
        await receive(ws, "hello")
        assert second.streams.empty()

        first.server.close()  # its connections closed, and nothing listens there any more
        started = time.monotonic()
        ws = await asyncio.wait_for(second.streams.get(), 10)
        await receive(ws, "hello")
        assert time.monotonic() - started < 2.5
        assert agent.url == agent_url(url_b)
        task.cancel()
        await asyncio.wait([task])
        await agent.engines.close()

        with socket.socket() as unused:  # a port nothing listens on
            unused.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{unused.getsockname()[1]}"
        started = time.monotonic()
        agent = Agent(f"{dead},{url_b}", TOKEN, tmp_path / "state", facts)
        task = asyncio.create_task(agent.run())
        ws = await asyncio.wait_for(second.streams.get(), 10)
        await receive(ws, "hello")
        assert time.monotonic() - started < 2.5
        task.cancel()
        await asyncio.wait([task])
        await agent.engines.close()
        second.server.close()

    asyncio.run(scenario())
