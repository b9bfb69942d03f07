"""What the websocket consumers' tests share."""

import asyncio


async def ends_by_itself(communicator, timeout: float = 5.0) -> bool:
    """A websocket closes: does its consumer end on its own (not cancelled by the test's timeout)?"""
    await communicator.send_input({"type": "websocket.disconnect", "code": 1000})
    done, _ = await asyncio.wait({communicator.future}, timeout=timeout)
    communicator.stop(exceptions=False)
    return bool(done)
