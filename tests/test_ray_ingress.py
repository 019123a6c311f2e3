"""The cluster ingress's calls to the engine deployment, without a Ray cluster: a fake
handle records what Ray Serve would read when each call is made.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("prefixcache.serve.ray_app", reason="the `cluster` extra (ray[serve]) is not installed")

from ray.serve import context as serve_context  # noqa: E402

from prefixcache.engine.engine import GenerationRequest  # noqa: E402
from prefixcache.serve.ray_ingress import RoutedEngine, RoutedStream  # noqa: E402
from prefixcache.serve.ray_replica import EngineCall  # noqa: E402


class SilentCall:
    """A call's stream that never yields (a replica that has not admitted it yet)."""

    def __init__(self) -> None:
        self.cancelled = False

    def __anext__(self):
        return asyncio.get_running_loop().create_future()  # never set

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """`replicas.options(stream=True).generate.remote(call)`, recording the internal
    request id Ray Serve would give each call (read from the request context as it does)."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.calls: list[SilentCall] = []
        self.generate = self

    def options(self, **_: object) -> FakeHandle:
        return self

    def remote(self, call: EngineCall) -> SilentCall:
        self.ids.append(serve_context._get_serve_request_context()._internal_request_id)
        self.calls.append(SilentCall())
        return self.calls[-1]


def call(request_id: str) -> EngineCall:
    return EngineCall(GenerationRequest(prompt=[1, 2, 3], max_tokens=2, request_id=request_id), "abc")


def test_every_call_of_one_http_request_gets_its_own_internal_request_id():
    handle = FakeHandle()
    engine = RoutedEngine(handle, tokenizer=None, stall_timeout_s=5.0)  # type: ignore[arg-type]
    serve_context._set_request_context(request_id="client-id", _internal_request_id="parent")
    try:
        for i in range(3):  # a request's n choices
            engine._call(call(f"{i}_cmpl-x"))
        # Ray Serve's router finds a pending call by this id: shared, all but one would wait forever
        assert len(set(handle.ids)) == 3 and "parent" not in handle.ids
        context = serve_context._get_serve_request_context()
        assert (context._internal_request_id, context.request_id) == ("parent", "client-id")  # restored
    finally:
        serve_context._unset_request_context()


def test_a_call_whose_admission_is_no_longer_awaited_is_cancelled():
    handle = FakeHandle()
    engine = RoutedEngine(handle, tokenizer=None, stall_timeout_s=60.0)  # type: ignore[arg-type]
    stream = RoutedStream(engine, call("0_cmpl-y"))

    async def client_leaves() -> None:
        task = asyncio.create_task(stream.start())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(client_leaves())
    assert [c.cancelled for c in handle.calls] == [True]  # the replica aborts it; nothing runs unread
