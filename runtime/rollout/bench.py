"""Rollout worker overhead: the worker process (zmq, groups, rewards) against bare ``LLM.generate``.

``compare_worker_to_bare_llm(config)`` runs the same groups (same prompts, n, max_tokens, seeds)
twice, one engine at a time: through a real ``runtime.rollout.worker`` process driven by a
stand-in controller ROUTER, and through plain ``vllm.LLM.generate``. Both are warmed up and
timed from the first request to the last finished group. ``bench/throughput.py`` calls it;
``python -m runtime.rollout.bench --config configs/tiny.yaml`` prints it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from runtime.config import Config, load_config
from runtime.protocol import Encoder, FrameGuard, Generate, GroupAborted, GroupDone, WorkerHello
from runtime.rundir import Endpoints, RunDir


@dataclass(frozen=True)
class Throughput:
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


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
            "worker_tokens": self.worker.tokens,
            "worker_tokens_per_s": self.worker.tokens_per_s,
            "bare_llm_tokens": self.bare_llm.tokens,
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


def worker_throughput(
    config: Config, prompts: list[tuple[int, list[int]]], seed: int = 1234, timeout_s: float = 600
) -> tuple[Throughput, float]:
    """Run every prompt as one group through a worker process; ``(throughput, startup s)``."""
    n, max_tokens = config.rollout.sampling.n, config.rollout.sampling.max_tokens
    with tempfile.TemporaryDirectory(prefix="asp-rollout-bench-") as tmp:
        run_dir = RunDir(tmp).create()
        run_dir.config.write_text(_one_instance(config, run_dir.root).to_yaml())
        context = zmq.Context()
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        run_dir.write_endpoints(
            Endpoints(
                rollout=f"tcp://127.0.0.1:{port}",
                trainer="tcp://127.0.0.1:1",
                telemetry="tcp://127.0.0.1:2",
                control="tcp://127.0.0.1:3",
                controller_pid=os.getpid(),
                run_name=config.run.name,
            )
        )
        encoder, guard = Encoder(), FrameGuard("bench")
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.rollout.worker", "--run-dir", tmp, "--instance-id", "0"]
        )
        try:

            def wait(kind: tuple[type, ...], deadline: float) -> Any:
                while time.perf_counter() < deadline:
                    if proc.poll() is not None:
                        raise RuntimeError(f"worker exited {proc.returncode}; see {tmp}/logs")
                    if router.poll(200):
                        message = guard.decode(router.recv_multipart()[1:])
                        if isinstance(message, kind):
                            return message
                raise TimeoutError(f"no {[k.__name__ for k in kind]} from the worker in time")

            def run(batch: list[tuple[int, list[int]]], first_group: int) -> int:
                for offset, (prompt_id, ids) in enumerate(batch):
                    group_id = first_group + offset
                    message = Generate(
                        group_id=group_id,
                        prompt_id=prompt_id,
                        prompt_token_ids=np.asarray(ids, dtype=np.int32),
                        n=n,
                        max_tokens=max_tokens,
                        seed=seed + group_id * 4_099,
                    )
                    router.send_multipart([b"instance-0", *encoder.encode(message)])
                tokens, deadline = 0, time.perf_counter() + timeout_s
                for _ in batch:
                    done = wait((GroupDone, GroupAborted), deadline)
                    if isinstance(done, GroupAborted):
                        raise RuntimeError(f"group {done.group_id} aborted: {done.reason}")
                    tokens += sum(len(c.token_ids) for c in done.completions)
                return tokens

            wait((WorkerHello,), time.perf_counter() + timeout_s)
            startup_s = time.perf_counter() - started
            run(prompts[:4], first_group=1_000_000)  # warm-up, as for the bare engine
            began = time.perf_counter()
            tokens = run(prompts, first_group=0)
            return Throughput(tokens, time.perf_counter() - began), startup_s
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            router.close()
            context.term()


def bare_llm_throughput(
    config: Config, prompts: list[tuple[int, list[int]]], seed: int = 1234
) -> Throughput:
    """The same groups through plain ``vllm.LLM.generate`` in this process."""
    from runtime.rollout.engine import EngineSpec, SamplingSpec, bare_llm_tokens_per_s
    from runtime.tasks import ensure_model

    sampling = config.rollout.sampling
    spec = EngineSpec(
        model=ensure_model(config),
        dtype=config.model.dtype,
        max_num_seqs=config.rollout.max_num_seqs_of(0),
        kv_cache_gib=config.rollout.kv_cache_gib,
        seed=config.run.seed,
    )
    specs = [
        SamplingSpec(
            n=sampling.n,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=seed + group_id * 4_099,
        )
        for group_id in range(len(prompts))
    ]
    tokens, seconds = bare_llm_tokens_per_s(spec, [ids for _, ids in prompts], specs)
    return Throughput(tokens, seconds)


def compare_worker_to_bare_llm(config: Config, groups: int = 64) -> Comparison:
    """Worker vs bare ``LLM.generate`` on the same ``groups`` groups (one engine at a time)."""
    prompts = bench_prompts(config, groups)
    worker, startup_s = worker_throughput(config, prompts)
    bare = bare_llm_throughput(config, prompts)
    return Comparison(worker=worker, bare_llm=bare, worker_startup_s=startup_s, groups=groups)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.rollout.bench", description=__doc__)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--groups", type=int, default=64)
    args = parser.parse_args(argv)
    result = compare_worker_to_bare_llm(load_config(args.config, args.set), args.groups)
    print(f"groups {result.groups}, worker start-up {result.worker_startup_s:.1f} s")
    for name, row in (("worker", result.worker), ("bare LLM", result.bare_llm)):
        print(f"  {name:<10s} {row.tokens:>8d} tokens  {row.tokens_per_s:8.0f} tok/s")
    print(f"  overhead    {100 * result.overhead:+.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
