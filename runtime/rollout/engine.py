"""Thin adapters over vLLM: the only module of the project that imports vLLM.

The rollout worker talks to a ``RolloutEngine`` (generate a group, abort, pause, resume, update
weights) and never to vLLM, so vLLM's churn (its RL APIs changed three times in a year) stays in
this file. Two engines implement it, chosen by ``EngineSpec.engine``:

- ``InprocEngine`` steps vLLM's ``LLMEngine`` inside the worker process (uniprocess executor).
  One process per instance and no IPC hop per decode step: on a CPU host whose cores are shared
  by the engine and the trainer, this is twice the tokens/s of the multi-process engine for a
  small model, and it sleeps when it has no work (the engine-core busy loop does not exist).
- ``AsyncEngine`` runs ``AsyncLLM``, whose engine core is its own process: on GPUs the scheduling
  overlaps the forward pass, and tensor parallelism needs it.

Weights arrive through ``worker_extension_cls`` (``weight_extension.py``), see ``apply_weights``:
a safetensors file reloaded in place (``async.weight_sync: file``), or a broadcast from trainer
rank 0 over a torch.distributed group, gloo on CPUs and NCCL on GPUs (``collective``, see
``runtime/collective.py``).

Weight versions: the engine labels every output token with the version that sampled it
(``set_weight_version``; outputs carry ``weight_versions`` spans), so a sample that lived through
an in-flight (``keep``) update reports the exact span ``version_min..version_max``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

PauseMode = Literal["keep", "wait", "abort"]
UpdateMode = Literal["boundary", "keep", "inflight"]
PAUSE_MODES: tuple[str, ...] = ("keep", "wait", "abort")
UPDATE_MODES: tuple[str, ...] = ("boundary", "keep", "inflight")
ENGINE_KINDS: tuple[str, ...] = ("inproc", "async")

EXTENSION_CLS = "runtime.rollout.weight_extension.WeightReloadExtension"
_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What one rollout engine needs to start; built from the run config by the worker."""

    model: str
    dtype: str = "float32"
    max_num_seqs: int = 16
    kv_cache_gib: float = 1.0
    seed: int = 0
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    enforce_eager: bool = True
    """CPU runs eagerly (torch.compile costs minutes on 2 cores); GPUs may turn it off."""
    engine: str = "inproc"
    """``inproc`` (``LLMEngine`` in the worker process) or ``async`` (``AsyncLLM``)."""
    prefix_caching: bool = True
    """Off for ``inflight`` weight updates, which keep KV computed by older weights."""
    scheduling_policy: str = "fcfs"
    """vLLM's waiting queue: ``fcfs``, or ``priority`` (a request's ``priority``, lowest
    first)."""


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """Sampling of one group: ``n`` samples of the same prompt."""

    n: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass(slots=True)
class GeneratedSample:
    """One finished completion with its behaviour log-probs and weight-version span."""

    token_ids: np.ndarray
    """int32, the generated tokens only."""
    logprobs: np.ndarray
    """float32, log-prob of each generated token under the sampling distribution."""
    finish_reason: str
    """``stop``, ``length`` or ``abort``."""
    version_min: int
    version_max: int
    finished_at: float


WorkerCall = Callable[..., Awaitable[list[Any]]]
"""``call_workers(method, *args)``: run a worker-extension method on every vLLM worker."""


@dataclass(frozen=True, slots=True)
class WeightSource:
    """Where weight ``version`` comes from: the safetensors file at ``path``, or, with an
    ``address``, the trainer's weight server (``runtime.collective``), which may serve a newer
    version than asked."""

    version: int
    path: str = ""
    address: str = ""
    token: str = ""


COLLECTIVE_TIMEOUT_S = 300.0
"""How long a worker waits for its round, and for each bucket of it."""


async def _load_file(call_workers: WorkerCall, path: str) -> None:
    counts = await call_workers("reload_weights_from", path)
    if not counts or min(counts) == 0:
        raise RuntimeError(f"weights file {path} held no tensors (per worker: {counts})")


async def apply_weights(call_workers: WorkerCall, source: WeightSource) -> int:
    """Load ``source`` on every vLLM worker of an engine (paused); returns the version loaded.

    A collective load that fails (trainer unreachable, a round broken by a dying peer) falls
    back to the file when there is one at that version.
    """
    if not source.address:
        await _load_file(call_workers, source.path)
        return source.version
    want = source.version
    try:
        # Tensor-parallel ranks take their seats independently; should a promotion fall
        # between their rounds, the ones behind fetch again.
        for _ in range(3):
            results = await call_workers(
                "load_weights_collective", source.address, source.token, want,
                COLLECTIVE_TIMEOUT_S,
            )  # fmt: skip
            if not results or min(count for _, count in results) == 0:
                raise RuntimeError(f"the weight round sent no tensors (per worker: {results})")
            versions = {int(version) for version, _ in results}
            if len(versions) == 1:
                return versions.pop()
            want = max(versions)
        raise RuntimeError(f"tensor-parallel ranks loaded different versions: {versions}")
    except Exception as exc:
        if source.path and os.path.isfile(source.path):
            log.warning("collective weight load failed (%s); loading %s", exc, source.path)
            await _load_file(call_workers, source.path)
            return source.version
        raise RuntimeError(f"collective weight load from {source.address} failed: {exc}") from exc


@dataclass(slots=True)
class _Stream:
    """Progress of one in-flight group."""

    n: int
    outputs: dict[int, Any] = field(default_factory=dict)
    finished_at: dict[int, float] = field(default_factory=dict)
    counted: dict[int, int] = field(default_factory=dict)


def _engine_args(spec: EngineSpec) -> dict[str, Any]:
    """The vLLM engine arguments both engines (and ``BareLLM``) share."""
    return {
        "model": spec.model,
        "dtype": spec.dtype,
        "max_num_seqs": spec.max_num_seqs,
        "seed": spec.seed,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "max_model_len": spec.max_model_len,
        "enforce_eager": spec.enforce_eager,
        "kv_cache_memory_bytes": int(spec.kv_cache_gib * _GIB),
        # The sampled token's log-prob under the temperature/top-p distribution, which is
        # what the trainer's importance ratio compares against.
        "logprobs_mode": "processed_logprobs",
        "disable_log_stats": True,
        "enable_prefix_caching": spec.prefix_caching,
        "scheduling_policy": spec.scheduling_policy,
    }


def _sampling_params(sampling: SamplingSpec, output_kind: Any = None) -> SamplingParams:
    extra = {} if output_kind is None else {"output_kind": output_kind}
    return SamplingParams(
        n=sampling.n,
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        logprobs=0,  # only the sampled token's log-prob
        flat_logprobs=True,  # a few flat lists per request instead of a dict per token
        detokenize=False,  # rewards decode with the task's tokenizer; no stop strings
        **extra,
    )


class RolloutEngine(ABC):
    """One vLLM engine with the operations a rollout worker needs.

    Construct with ``await start_engine(spec)`` from the main thread: a multi-process engine
    starts its engine-core process from the calling thread, and a parent-death signal armed in
    that child fires when the *thread* that created it ends.
    """

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.weight_version = 0
        self.tokens_generated = 0
        self._streams: dict[str, _Stream] = {}
        self._children: dict[str, list[str]] = {}
        """A continued group's per-sample requests (see ``generate``), by the group's id."""
        self._paused = False

    # --- what each engine provides -------------------------------------------------------------

    @abstractmethod
    def _outputs(
        self, request_id: str, prompt: dict[str, Any], params: SamplingParams, priority: int
    ) -> AsyncIterator[Any]:
        """The request's cumulative ``RequestOutput`` updates, until it finishes or is aborted."""

    @abstractmethod
    async def _abort(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    async def _pause(self, mode: PauseMode, clear_cache: bool) -> None: ...

    @abstractmethod
    async def _resume(self) -> None: ...

    @abstractmethod
    async def _reset_prefix_cache(self) -> bool:
        """Drop cached KV, preempting running requests (recomputed when they resume)."""

    @abstractmethod
    async def _set_weight_version(self, version: int) -> None: ...

    @abstractmethod
    async def call_workers(self, method: str, *args: Any) -> list[Any]:
        """Run a ``WeightReloadExtension`` method on every vLLM worker."""

    @property
    @abstractmethod
    def errored(self) -> bool: ...

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and its workers (idempotent)."""

    # --- state -------------------------------------------------------------------------------

    @property
    def running_seqs(self) -> int:
        """Sequences submitted and not finished (running or queued inside vLLM)."""
        return sum(s.n - len(s.finished_at) for s in self._streams.values())

    @property
    def paused(self) -> bool:
        return self._paused

    # --- generation --------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingSpec,
        *,
        priority: int = 0,
        prefixes: Sequence[GeneratedSample] | None = None,
    ) -> list[GeneratedSample]:
        """Generate one group and return its ``n`` samples, in index order.

        An aborted request (``abort``, or ``pause("abort")``) still returns: its samples carry
        the tokens made so far and ``finish_reason == "abort"``. ``priority``: lower is
        scheduled sooner, under ``EngineSpec.scheduling_policy == "priority"``.

        ``prefixes`` (one per sample) continue a group that was aborted elsewhere: each
        unfinished sample is its own request, prompt + its tokens, for the ``max_tokens`` it has
        left; a finished one (``finish_reason`` not ``abort``) is returned as it is. Samples
        come back whole: the prefix's tokens, log-probs and ``version_min``, then the new ones.
        """
        if prefixes is None:
            return await self._generate(request_id, prompt_token_ids, sampling, priority)
        if len(prefixes) != sampling.n:
            raise ValueError(f"{len(prefixes)} prefixes for a group of n = {sampling.n}")
        requests: dict[int, tuple[str, list[int], SamplingSpec]] = {}
        for k, prefix in enumerate(prefixes):
            left = sampling.max_tokens - len(prefix.token_ids)
            if prefix.finish_reason == "abort" and left > 0:
                seed = None if sampling.seed is None else sampling.seed + k
                requests[k] = (
                    f"{request_id}.{k}",
                    [*map(int, prompt_token_ids), *map(int, prefix.token_ids)],
                    replace(sampling, n=1, max_tokens=left, seed=seed),
                )
        self._children[request_id] = [rid for rid, _, _ in requests.values()]
        try:
            results = await asyncio.gather(
                *(self._generate(rid, ids, spec, priority) for rid, ids, spec in requests.values())
            )
        finally:
            del self._children[request_id]
        continued = dict(zip(requests, results, strict=True))
        return [
            _continue(prefix, continued[k][0]) if k in continued else _finished(prefix)
            for k, prefix in enumerate(prefixes)
        ]

    async def _generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingSpec,
        priority: int,
    ) -> list[GeneratedSample]:
        # CUMULATIVE: each update carries the child's growing token list by reference, so
        # progress (tokens, per-sample finish time) costs a len() per step.
        params = _sampling_params(sampling, RequestOutputKind.CUMULATIVE)
        prompt = {"prompt_token_ids": list(map(int, prompt_token_ids))}
        start_version = self.weight_version
        stream = _Stream(sampling.n)
        self._streams[request_id] = stream
        try:
            async for output in self._outputs(request_id, prompt, params, priority):
                now = time.time()
                for completion in output.outputs:
                    index = completion.index
                    stream.outputs[index] = completion
                    made = len(completion.token_ids)
                    self.tokens_generated += made - stream.counted.get(index, 0)
                    stream.counted[index] = made
                    if completion.finish_reason is not None:
                        stream.finished_at.setdefault(index, now)
        finally:
            del self._streams[request_id]
        samples = []
        for index in range(sampling.n):
            completion = stream.outputs.get(index)
            finished_at = stream.finished_at.get(index, time.time())
            samples.append(_to_sample(completion, start_version, self.weight_version, finished_at))
        return samples

    async def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests; their ``generate`` calls return with ``finish_reason == "abort"``."""
        ids = [
            rid
            for group in request_ids
            for rid in self._children.get(group, [group])
            if rid in self._streams
        ]
        if ids:
            await self._abort(ids)

    # --- pause, resume, weights --------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> None:
        """Stop scheduling. ``keep`` freezes in-flight requests, ``wait`` lets them finish,
        ``abort`` ends them now. Requests submitted while paused queue until ``resume``."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        # keep: leave the frozen requests' KV alone; the cache is cleared on weight updates.
        await self._pause(mode, clear_cache=mode != "keep")
        self._paused = True

    async def resume(self) -> None:
        await self._resume()
        self._paused = False

    async def update_weights(self, source: WeightSource, mode: UpdateMode) -> float:
        """Load the weights of ``source``; returns the seconds the engine was held.

        ``weight_version`` is then the version loaded: ``source.version``, or a newer one that
        the trainer's weight server had by then.

        ``boundary``: in-flight requests finish on the old weights (pause ``wait``), then the
        reload. ``keep``: in-flight requests freeze (pause ``keep``), the reload happens under
        them, and they continue on the new weights; their KV is dropped so the tokens after the
        update are computed from the new weights only. ``inflight`` (PipelineRL's in-flight
        update): as ``keep``, but the running requests keep their KV, so nothing is recomputed;
        the tokens after the update come from the new weights over a prefix cached by the old
        ones, and the behaviour log-probs record exactly that. It needs an engine without
        prefix caching (``EngineSpec.prefix_caching``), so that no later request reuses KV from
        old weights. Otherwise the prefix cache is reset. Requests submitted meanwhile queue and
        start on the new weights. On an engine the operator paused, the update applies at once
        and the engine stays paused.
        """
        if mode not in UPDATE_MODES:
            raise ValueError(f"update mode {mode!r} is not one of {UPDATE_MODES}")
        if mode == "inflight" and self.spec.prefix_caching:
            raise ValueError("update mode 'inflight' needs an engine without prefix caching")
        held_since = time.perf_counter()
        was_paused = self._paused
        if not was_paused:
            await self._pause("wait" if mode == "boundary" else "keep", clear_cache=False)
        version = await apply_weights(self.call_workers, source)
        # Preempts any frozen request (recomputed on resume), so the reset cannot be refused.
        if self.spec.prefix_caching and not await self._reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
        await self._set_weight_version(version)
        self.weight_version = version
        if not was_paused:
            await self._resume()
        return time.perf_counter() - held_since


class AsyncEngine(RolloutEngine):
    """``AsyncLLM``: the engine core runs in its own process (GPUs, tensor parallelism)."""

    def __init__(self, llm: AsyncLLM, spec: EngineSpec) -> None:
        super().__init__(spec)
        self._llm = llm

    @classmethod
    def create(cls, spec: EngineSpec) -> AsyncEngine:
        args = AsyncEngineArgs(**_engine_args(spec), worker_extension_cls=EXTENSION_CLS)
        return cls(AsyncLLM.from_engine_args(args), spec)

    def _outputs(
        self, request_id: str, prompt: dict[str, Any], params: SamplingParams, priority: int
    ) -> AsyncIterator[Any]:
        return self._llm.generate(prompt, params, request_id=request_id, priority=priority)

    async def _abort(self, request_ids: list[str]) -> None:
        await self._llm.abort(request_ids)

    async def _pause(self, mode: PauseMode, clear_cache: bool) -> None:
        await self._llm.pause_generation(mode=mode, clear_cache=clear_cache)

    async def _resume(self) -> None:
        await self._llm.resume_generation()

    async def _reset_prefix_cache(self) -> bool:
        return await self._llm.reset_prefix_cache(reset_running_requests=True)

    async def _set_weight_version(self, version: int) -> None:
        await self._llm.update_weight_version(str(version))

    async def call_workers(self, method: str, *args: Any) -> list[Any]:
        return await self._llm.collective_rpc(method, args=args)

    @property
    def errored(self) -> bool:
        return bool(self._llm.errored)

    def shutdown(self) -> None:
        self._llm.shutdown()


_FINISHED = object()
"""Ends a request's output queue in ``InprocEngine``."""


class InprocEngine(RolloutEngine):
    """``LLMEngine`` stepped by an asyncio task in this process, with a uniprocess executor.

    One decode step runs at a time on the event loop, between the worker's messages; with no
    request to step (idle, or paused in ``keep``) the task waits on an event and uses no CPU.
    Pausing is ours to do: requests submitted while paused are held here, and a ``keep`` pause
    simply stops stepping.
    """

    def __init__(self, llm: LLMEngine, spec: EngineSpec) -> None:
        super().__init__(spec)
        self._llm = llm
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._held: dict[str, tuple[dict[str, Any], SamplingParams, int]] = {}
        """Requests submitted while paused, in arrival order, added to vLLM on resume."""
        self._accepting = True
        self._stepping = True
        self._work = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._failure: BaseException | None = None
        self._loop_task = asyncio.create_task(self._step_loop(), name="vllm-steps")

    @classmethod
    def create(cls, spec: EngineSpec) -> InprocEngine:
        args = EngineArgs(
            **_engine_args(spec),
            worker_extension_cls=EXTENSION_CLS,
            distributed_executor_backend="uni",
        )
        # LLMEngine puts its engine core in a process of its own unless this is off.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        llm = LLMEngine.from_engine_args(args, enable_multiprocessing=False)
        return cls(llm, spec)

    async def _step_loop(self) -> None:
        llm = self._llm
        try:
            while True:
                if not (self._stepping and llm.has_unfinished_requests()):
                    self._drained.set()
                    self._work.clear()
                    await self._work.wait()
                    continue
                self._drained.clear()
                for output in llm.step():
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
                        if output.finished:
                            queue.put_nowait(_FINISHED)
                # Let the worker read its socket between decode steps.
                await asyncio.sleep(0)
        except Exception as exc:
            log.exception("the vLLM engine failed")
            self._failure = exc
            for queue in self._queues.values():
                queue.put_nowait(_FINISHED)
            self._drained.set()

    def _add(
        self, request_id: str, prompt: dict[str, Any], params: SamplingParams, priority: int
    ) -> None:
        self._llm.add_request(request_id, prompt, params, priority=priority)
        self._drained.clear()  # a "wait" pause from now on waits for this one too
        self._work.set()

    async def _outputs(
        self, request_id: str, prompt: dict[str, Any], params: SamplingParams, priority: int
    ) -> AsyncIterator[Any]:
        if self._failure is not None:
            raise RuntimeError(f"the vLLM engine failed: {self._failure}")
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            if self._accepting:
                self._add(request_id, prompt, params, priority)
            else:
                self._held[request_id] = (prompt, params, priority)
            while (output := await queue.get()) is not _FINISHED:
                yield output
        finally:
            del self._queues[request_id]

    async def _abort(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if self._held.pop(rid, None) is None]
        if live:
            self._llm.abort_request(live)
        for rid in request_ids:
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(_FINISHED)

    async def _pause(self, mode: PauseMode, clear_cache: bool) -> None:
        self._accepting = False
        if mode == "keep":
            self._stepping = False
        elif mode == "abort":
            await self._abort([rid for rid in self._queues if rid not in self._held])
        else:
            self._work.set()
            await self._drained.wait()
        if clear_cache:
            self._llm.reset_prefix_cache()

    async def _resume(self) -> None:
        self._accepting = self._stepping = True
        held, self._held = self._held, {}
        for request_id, (prompt, params, priority) in held.items():
            self._add(request_id, prompt, params, priority)
        self._work.set()

    async def _reset_prefix_cache(self) -> bool:
        return self._llm.reset_prefix_cache(reset_running_requests=True)

    async def _set_weight_version(self, version: int) -> None:
        self._llm.set_weight_version(str(version))

    async def call_workers(self, method: str, *args: Any) -> list[Any]:
        # In a thread, so heartbeats go on while a weight load waits for its round. The engine
        # is paused meanwhile: nothing else touches vLLM until this returns.
        return await asyncio.to_thread(self._llm.collective_rpc, method, args=args)

    @property
    def errored(self) -> bool:
        return self._failure is not None

    def shutdown(self) -> None:
        self._loop_task.cancel()
        self._llm.engine_core.shutdown()


def resolve_engine_kind(configured: str, tensor_parallel_size: int) -> str:
    """``rollout.engine: auto`` -> ``async`` where CUDA is available or an instance spans
    several devices, ``inproc`` otherwise; an explicit choice stands."""
    if configured != "auto":
        return configured
    import torch

    return "async" if tensor_parallel_size > 1 or torch.cuda.is_available() else "inproc"


async def start_engine(spec: EngineSpec, weight_version: int = 0) -> RolloutEngine:
    """Start the engine ``spec.engine`` names, at ``weight_version``."""
    if spec.engine not in ENGINE_KINDS:
        raise ValueError(f"rollout.engine: {spec.engine!r} is not one of {ENGINE_KINDS}")
    kind = InprocEngine if spec.engine == "inproc" else AsyncEngine
    engine = kind.create(spec)
    await engine._set_weight_version(weight_version)
    engine.weight_version = weight_version
    return engine


def _to_sample(
    completion: Any, start_version: int, end_version: int, finished_at: float
) -> GeneratedSample:
    """A vLLM ``CompletionOutput`` (or None: aborted before any token) -> ``GeneratedSample``."""
    if completion is None:
        empty = np.zeros(0, dtype=np.int32)
        return GeneratedSample(
            empty, np.zeros(0, np.float32), "abort", start_version, start_version, 0.0
        )
    token_ids = np.asarray(completion.token_ids, dtype=np.int32)
    logprobs = _sampled_logprobs(completion.logprobs, completion.token_ids)
    spans = completion.weight_versions
    if spans:
        versions = [int(span.version) for span in spans if span.end > span.start]
        low, high = (min(versions), max(versions)) if versions else (start_version,) * 2
    else:
        # No label (no token made, or the engine did not report one): the versions live
        # while the request ran are the honest bounds.
        low, high = start_version, end_version if len(token_ids) else start_version
    reason = completion.finish_reason or "abort"
    return GeneratedSample(token_ids, logprobs, str(reason), low, high, finished_at)


def _finished(prefix: GeneratedSample) -> GeneratedSample:
    """A prefix that needs nothing more: complete, or with no ``max_tokens`` left."""
    reason = prefix.finish_reason if prefix.finish_reason != "abort" else "length"
    return replace(prefix, finish_reason=reason)


def _continue(prefix: GeneratedSample, more: GeneratedSample) -> GeneratedSample:
    """``prefix`` followed by what its continuation generated."""
    if not len(prefix.token_ids):
        return more
    return GeneratedSample(
        token_ids=np.concatenate([prefix.token_ids, more.token_ids]).astype(np.int32),
        logprobs=np.concatenate([prefix.logprobs, more.logprobs]).astype(np.float32),
        finish_reason=more.finish_reason,
        version_min=prefix.version_min,
        version_max=more.version_max if len(more.token_ids) else prefix.version_max,
        finished_at=more.finished_at,
    )


def _sampled_logprobs(logprobs: Any, token_ids: Sequence[int]) -> np.ndarray:
    """The log-prob of each sampled token from vLLM's flat or per-position container."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs although logprobs=0 was requested")
    flat = getattr(logprobs, "logprobs", None)
    if flat is not None and len(flat) == len(token_ids):
        # logprobs=0: exactly one entry per position, the sampled token's.
        return np.asarray(flat, dtype=np.float32)
    return np.asarray(
        [position[token].logprob for position, token in zip(logprobs, token_ids, strict=True)],
        dtype=np.float32,
    )


class BareLLM:
    """Reference engine: plain ``vllm.LLM.generate``, configured like ``RolloutEngine.start``.

    ``generate`` runs one group per prompt and returns the tokens generated. Use it as a context
    manager from a process with an ``if __name__ == "__main__"`` guard.
    """

    def __init__(self, spec: EngineSpec, speculative: Mapping[str, Any] | None = None) -> None:
        from vllm import LLM

        args = _engine_args(spec)
        self._speculative = speculative is not None
        if speculative is not None:
            # vLLM's ``speculative_config``; stats on, so that ``acceptance`` can read them.
            args |= {"speculative_config": dict(speculative), "disable_log_stats": False}
        if spec.engine == "inproc":
            # vllm.LLM reads this when it builds its engine: step the core in this process.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            self._llm = LLM(**args, distributed_executor_backend="uni")
        else:
            self._llm = LLM(**args)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingSpec]) -> int:
        params = [_sampling_params(s) for s in sampling]
        inputs = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
        outputs = self._llm.generate(inputs, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)

    def acceptance(self) -> tuple[int, int]:
        """``(draft tokens proposed, draft tokens accepted)`` so far; (0, 0) without a
        speculative config."""
        drafted = accepted = 0
        if not self._speculative:
            return drafted, accepted
        for metric in self._llm.get_metrics():
            if metric.name == "vllm:spec_decode_num_draft_tokens":
                drafted += int(getattr(metric, "value", 0))
            elif metric.name == "vllm:spec_decode_num_accepted_tokens":
                accepted += int(getattr(metric, "value", 0))
        return drafted, accepted

    def close(self) -> None:
        self._llm.llm_engine.engine_core.shutdown()

    def __enter__(self) -> BareLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
