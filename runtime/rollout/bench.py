"""Rollout worker overhead: the worker process (zmq, groups, rewards) against bare ``LLM.generate``.

``compare_worker_to_bare_llm(config)`` runs the same groups (same prompts, n, max_tokens, seeds)
through a real ``runtime.rollout.worker`` process, driven by a stand-in controller ROUTER, and
through plain ``vllm.LLM.generate`` in this process. Both engines are loaded and warmed up, then
they take turns, one timed pass at a time, so that they never compete for cores and a shared
machine's drift hits both alike. The median pass of each counts. ``bench/throughput.py`` calls
it; ``python -m runtime.rollout.bench --config configs/tiny.yaml`` prints it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from runtime.config import Config, load_config
from runtime.protocol import Encoder, FrameGuard, Generate, GroupAborted, GroupDone, WorkerHello
from runtime.rundir import RunDir
from runtime.transport import bind_standin

if TYPE_CHECKING:  # vLLM is imported only when a bare engine is built
    from runtime.rollout.engine import BareLLM, SamplingSpec

PASSES = 5
"""Timed passes over the same groups per path."""


@dataclass(frozen=True)
class Throughput:
    """Tokens generated and seconds taken by each timed pass over the same groups."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    @property
    def rates(self) -> list[float]:
        return [t / s for t, s in zip(self.tokens, self.seconds, strict=True) if s > 0]

    @property
    def tokens_per_s(self) -> float:
        """The median pass's rate."""
        rates = self.rates
        return float(np.median(rates)) if rates else 0.0


@dataclass(frozen=True)
class Comparison:
    worker: Throughput
    bare_llm: Throughput
    worker_startup_s: float
    groups: int

    @property
    def overhead(self) -> float:
        """Fraction of bare throughput the worker loses (negative: the worker was faster)."""
        return 1.0 - self.worker.tokens_per_s / self.bare_llm.tokens_per_s

    def as_dict(self) -> dict[str, float]:
        return {
            "groups": self.groups,
            "passes": len(self.worker.seconds),
            "worker_tokens_per_pass": self.worker.tokens[0],
            "worker_tokens_per_s": self.worker.tokens_per_s,
            "bare_llm_tokens_per_pass": self.bare_llm.tokens[0],
            "bare_llm_tokens_per_s": self.bare_llm.tokens_per_s,
            "overhead": self.overhead,
            "worker_startup_s": self.worker_startup_s,
        }


def bench_prompts(config: Config, groups: int) -> list[tuple[int, list[int]]]:
    """``(prompt_id, token ids)`` of the first ``groups`` task prompts (cycled)."""
    from runtime.tasks import build_task, encode_prompt, ensure_model, load_tokenizer

    tokenizer = load_tokenizer(ensure_model(config))
    prompts = list(build_task(config).prompts)
    chosen = [prompts[i % len(prompts)] for i in range(groups)]
    return [(p.prompt_id, encode_prompt(tokenizer, p)) for p in chosen]


def _one_instance(config: Config, run_dir: Path) -> Config:
    data = config.model_dump(mode="json", by_alias=True)
    data["rollout"]["instances"] = [config.rollout.instance_list()[0].model_dump(mode="json")]
    data["run"]["run_dir"] = str(run_dir)
    return Config.model_validate(data)


def _group_seed(seed: int, position: int) -> int:
    return seed + position * 4_099


class WorkerPath:
    """A real worker process on a one-instance copy of ``config``, fed groups by a ROUTER."""

    def __init__(self, config: Config, seed: int = 1234, timeout_s: float = 600) -> None:
        self._n, self._max_tokens = config.rollout.sampling.n, config.rollout.sampling.max_tokens
        self._seed, self._timeout_s = seed, timeout_s
        self._next_group = 0
        self._tmp = tempfile.TemporaryDirectory(prefix="asp-rollout-bench-")
        run_dir = RunDir(self._tmp.name).create()
        run_dir.config.write_text(_one_instance(config, run_dir.root).to_yaml())
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        bind_standin(self._router, run_dir, config.run.name)
        self._encoder, self._guard = Encoder(), FrameGuard("bench")
        started = time.perf_counter()
        command = [sys.executable, "-m", "runtime.rollout.worker", "--run-dir", self._tmp.name]
        self._proc = subprocess.Popen([*command, "--instance-id", "0"])
        try:
            self._wait((WorkerHello,), time.perf_counter() + timeout_s)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - started

    def generate(self, prompts: list[tuple[int, list[int]]]) -> int:
        """Send every prompt as one group and wait for all of them; the tokens generated."""
        for position, (prompt_id, ids) in enumerate(prompts):
            # Fresh group ids every call; seeds follow the prompt's position, as for the bare
            # engine, so every pass samples the same tokens.
            message = Generate(
                group_id=self._next_group,
                prompt_id=prompt_id,
                prompt_token_ids=np.asarray(ids, dtype=np.int32),
                n=self._n,
                max_tokens=self._max_tokens,
                seed=_group_seed(self._seed, position),
            )
            self._next_group += 1
            self._router.send_multipart([b"instance-0", *self._encoder.encode(message)])
        tokens, deadline = 0, time.perf_counter() + self._timeout_s
        for _ in prompts:
            done = self._wait((GroupDone, GroupAborted), deadline)
            if isinstance(done, GroupAborted):
                raise RuntimeError(f"group {done.group_id} aborted: {done.reason}")
            tokens += sum(len(c.token_ids) for c in done.completions)
        return tokens

    def _wait(self, kind: tuple[type, ...], deadline: float) -> Any:
        while time.perf_counter() < deadline:
            if self._proc.poll() is not None:
                logs = Path(self._tmp.name) / "logs"
                raise RuntimeError(f"worker exited {self._proc.returncode}; see {logs}")
            if self._router.poll(200):
                message = self._guard.decode(self._router.recv_multipart()[1:])
                if isinstance(message, kind):
                    return message
        raise TimeoutError(f"no {[k.__name__ for k in kind]} from the worker in time")

    def close(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._router.close()
        self._context.term()
        self._tmp.cleanup()

    def __enter__(self) -> WorkerPath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bare_llm(
    config: Config, groups: int, seed: int, speculative: Mapping[str, Any] | None = None
) -> tuple[BareLLM, list[SamplingSpec]]:
    """A bare engine configured like instance 0 (plus vLLM's ``speculative_config``, if given),
    and the sampling of each of ``groups`` groups."""
    from runtime.rollout.engine import BareLLM, EngineSpec, SamplingSpec, resolve_engine_kind
    from runtime.tasks import ensure_model

    sampling = config.rollout.sampling
    spec = EngineSpec(
        model=ensure_model(config),
        dtype=config.model.dtype,
        max_num_seqs=config.rollout.max_num_seqs_of(0),
        kv_cache_gib=config.rollout.kv_cache_gib,
        seed=config.run.seed,
        engine=resolve_engine_kind(config.rollout.engine, 1),
    )
    specs = [
        SamplingSpec(
            n=sampling.n,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=_group_seed(seed, position),
        )
        for position in range(groups)
    ]
    return BareLLM(spec, speculative), specs


def compare_worker_to_bare_llm(
    config: Config, groups: int = 64, passes: int = PASSES, seed: int = 1234
) -> Comparison:
    """Worker vs bare ``LLM.generate`` on the same ``groups`` groups, in alternating passes."""
    if passes < 1:
        raise ValueError(f"passes: {passes} is not allowed; at least 1")
    prompts = bench_prompts(config, groups)
    token_ids = [ids for _, ids in prompts]
    with WorkerPath(config, seed) as worker:
        bare, specs = bare_llm(config, groups, seed)
        with bare:
            worker.generate(prompts[:4])  # warm-up
            bare.generate(token_ids[:4], specs[:4])
            worker_pass = Timed(lambda: worker.generate(prompts))
            bare_pass = Timed(lambda: bare.generate(token_ids, specs))
            for number in range(passes):
                # Alternate who goes first, so neither always runs right after the other.
                first, second = (
                    (worker_pass, bare_pass) if number % 2 == 0 else (bare_pass, worker_pass)
                )
                first.run()
                second.run()
    return Comparison(
        worker=worker_pass.throughput(),
        bare_llm=bare_pass.throughput(),
        worker_startup_s=worker.startup_s,
        groups=groups,
    )


class Timed:
    """Times each call of a pass that returns the tokens it generated."""

    def __init__(self, one_pass: Callable[[], int]) -> None:
        self._one_pass = one_pass
        self._tokens: list[int] = []
        self._seconds: list[float] = []

    def run(self) -> None:
        began = time.perf_counter()
        self._tokens.append(self._one_pass())
        self._seconds.append(time.perf_counter() - began)

    def throughput(self) -> Throughput:
        return Throughput(tuple(self._tokens), tuple(self._seconds))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.rollout.bench", description=__doc__)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--passes", type=int, default=PASSES)
    args = parser.parse_args(argv)
    if args.passes < 1:
        parser.error(f"--passes: {args.passes} is not allowed; at least 1")
    config = load_config(args.config, args.set)
    result = compare_worker_to_bare_llm(config, args.groups, args.passes)
    print(f"groups {result.groups}, worker start-up {result.worker_startup_s:.1f} s")
    for name, row in (("worker", result.worker), ("bare LLM", result.bare_llm)):
        rates = ", ".join(f"{r:.0f}" for r in row.rates)
        print(
            f"  {name:<10s} {row.tokens[0]:>8d} tokens/pass  median {row.tokens_per_s:8.0f} tok/s"
        )
        print(f"  {'':<10s} passes: {rates} tok/s")
    print(f"  overhead    {100 * result.overhead:+.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
