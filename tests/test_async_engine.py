"""The engine thread: a failing step is contained, the loop keeps serving."""
from __future__ import annotations

import asyncio

import pytest

from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.engine.processor import EngineRequest
from chunkserve.sampling_params import SamplingParams
from chunkserve.frontend.async_engine import AsyncEngine, RequestFailedError

POISON = 4242  # a prompt token that makes the (patched) runner raise


def test_a_failing_step_fails_its_requests_not_the_engine(tiny_model_dir):
    engine = LLMEngine.from_kwargs(model=tiny_model_dir, dtype="float32", max_model_len=256)
    real_execute = engine.executor.execute

    def execute(out):  # type: ignore[no-untyped-def]
        if any(POISON in s.token_ids for s in out.scheduled):
            raise RuntimeError("kernel exploded")
        return real_execute(out)

    engine.executor.execute = execute  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    async def collect(ae: AsyncEngine, rid: str, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in ae.generate(engine.processor.process_inputs(rid, prompt, params)):
            tokens = out.outputs[0].token_ids
        return tokens

    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            with pytest.raises(RequestFailedError, match="kernel exploded"):
                await asyncio.wait_for(collect(ae, "bad", [10, POISON, 11]), 60)
            assert ae.is_healthy
            # The loop carries on: later requests are served, and nothing is left allocated.
            good = await asyncio.wait_for(collect(ae, "good", [10, 12, 11]), 60)
            assert len(good) == 5
            assert engine.scheduler.kv.stats().num_used_blocks == 0
            assert not engine.has_unfinished_requests()
        finally:
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())


def test_admission_tickets_and_fail_all(tiny_model_dir):
    """Reserved places count as queued until sent; fail_all (the end of the shutdown grace
    period) ends every in-flight request with ShuttingDownError, frees it, refuses new ones."""
    from chunkserve.frontend.async_engine import ShuttingDownError

    engine = LLMEngine.from_kwargs(model=tiny_model_dir, dtype="float32", max_model_len=256)
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    def process(rid: str, prompt: list[int]) -> EngineRequest:
        return engine.processor.process_inputs(rid, prompt, long)

    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            ticket = ae.reserve(3)
            assert ae.num_queued == 3
            stream = ae.generate(process("a", [10, 11, 12]), ticket=ticket)
            first = await asyncio.wait_for(stream.__anext__(), 60)  # one place used
            assert len(first.outputs[0].token_ids) >= 1
            ticket.release()  # the two never sent
            assert ae.num_queued <= 1  # "a" counts until the engine publishes it as running
            ae.fail_all("the server is shutting down")
            with pytest.raises(ShuttingDownError):
                async for _ in stream:
                    pass
            with pytest.raises(ShuttingDownError):
                await ae.generate(process("b", [10])).__anext__()
            for _ in range(100):  # the engine thread publishes after applying the command
                if ae.num_queued == 0:
                    break
                await asyncio.sleep(0.01)
            assert ae.num_queued == 0
            assert not engine.has_unfinished_requests()
            assert engine.scheduler.kv.stats().num_used_blocks == 0
        finally:
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())


def test_the_loop_runs_on_the_thread_that_built_the_engine(tiny_model_dir):
    """One OpenMP pool per process (engine/compute_thread.py): the server builds the engine on
    its compute thread, and every step then runs on that same thread."""
    import threading

    from chunkserve.engine.compute_thread import ComputeThread

    compute = ComputeThread()
    built_on, stepped_on = compute.call(threading.get_ident), set()
    engine = compute.call(lambda: LLMEngine.from_kwargs(
        model=tiny_model_dir, dtype="float32", max_model_len=256))
    real_step = engine.step

    def step():  # type: ignore[no-untyped-def]
        stepped_on.add(threading.get_ident())
        return real_step()

    engine.step = step  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        ae = AsyncEngine(engine, compute=compute)
        ae.start()
        try:
            async for out in ae.generate(engine.processor.process_inputs("r", [10, 11], params)):
                pass
            assert out.finished and ae.is_healthy
        finally:
            await asyncio.to_thread(ae.shutdown)
        assert not ae.is_healthy

    asyncio.run(main())
    assert stepped_on == {built_on}
