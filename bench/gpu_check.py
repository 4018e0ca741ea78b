"""GPU checks of the trainer and the weight path, for a host with CUDA (issue #13; not in CI).

Each check prints ok, failed or skipped (with the reason), and its time:

1. ``trainer step``: the project's ``Trainer`` on CUDA, bf16, one process, a GRPO step on a
   synthetic batch (median of 3).
2. ``export``: the weights to CPU bf16 (``export_weights``), and packed into the weight server's
   pinned buckets (``WeightServer.stage``, what ``async.weight_sync: collective`` does a step).
3. ``nccl``: a collective round, trainer on ``cuda:0`` and a receiver process on ``cuda:1``
   (NCCL wants one GPU per rank, so it needs two); the bytes received are checked.
4. ``ipc``: a CUDA IPC handoff of the packed weights to another process on the same GPU, which
   copies them into its own tensors (the colocated alternative; one GPU is enough).
5. ``vllm``: a vLLM engine on ``cuda:1`` loads the weights through the worker extension over
   NCCL (``load_weights_collective``); its parameter sum must move to the trainer's.

On a host without CUDA it says so and exits 0 having run nothing.

    .venv/bin/python bench/gpu_check.py [--model tiny|100m]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: bench/ is on the path, the repo is not
    sys.path.insert(0, str(REPO))

from weight_sync import MODELS  # noqa: E402  (bench/weight_sync.py: the tiny and 100M configs)

from runtime.config import Config  # noqa: E402

CHECKS = ("trainer step", "export", "nccl", "ipc", "vllm")


@dataclass
class Outcome:
    check: str
    status: str
    """``ok``, ``failed`` or ``skipped``."""
    seconds: float | None = None
    nbytes: int | None = None
    detail: str = ""


def _report(outcomes: Sequence[Outcome]) -> None:
    print(f"{'check':<13} {'status':<8} {'seconds':>8} {'GB/s':>7}  detail")
    for o in outcomes:
        seconds = "" if o.seconds is None else f"{o.seconds:8.3f}"
        rate = "" if not (o.seconds and o.nbytes) else f"{o.nbytes / o.seconds / 1e9:7.2f}"
        print(f"{o.check:<13} {o.status:<8} {seconds:>8} {rate:>7}  {o.detail}")


def _attempt(name: str, check: Callable[[], Outcome]) -> Outcome:
    try:
        return check()
    except Exception as exc:
        traceback.print_exc()
        return Outcome(name, "failed", detail=f"{type(exc).__name__}: {exc}")


# --- receivers, each in a process of its own ---------------------------------------------------


def _nccl_receiver(address: str, token: str, conn: Any) -> None:
    from runtime.collective import Fetch
    from runtime.trainer.weights import checksum

    device = torch.device("cuda:1")
    started = time.perf_counter()
    fetch = Fetch(address, token, 1, device)
    tensors = {name: t.cpu() for name, t in fetch.tensors()}
    conn.send((time.perf_counter() - started, checksum(tensors)))


def _ipc_receiver(queue: Any, conn: Any) -> None:
    buckets = queue.get()  # CUDA tensors: torch.multiprocessing hands over IPC handles
    started = time.perf_counter()
    own = [b.clone() for b in buckets]
    torch.cuda.synchronize()
    conn.send((time.perf_counter() - started, sum(int(b.sum()) for b in own)))


def _vllm_receiver(model_dir: str, address: str, token: str, conn: Any) -> None:
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = "1"
    from vllm import LLM

    from runtime.rollout.engine import EXTENSION_CLS

    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        worker_extension_cls=EXTENSION_CLS,
    )
    before = llm.collective_rpc("weight_checksum")[0]
    started = time.perf_counter()
    ((version, count),) = llm.collective_rpc(
        "load_weights_collective", args=(address, token, 1, 300.0)
    )
    seconds = time.perf_counter() - started
    llm.reset_prefix_cache()
    after = llm.collective_rpc("weight_checksum")[0]
    conn.send((seconds, version, count, before, after))


def _in_process(target: Callable[..., None], *args: Any) -> Any:
    context = mp.get_context("spawn")
    here, there = context.Pipe()
    process = context.Process(target=target, args=(*args, there), daemon=True)
    process.start()
    if not here.poll(600):
        process.kill()
        raise TimeoutError(f"{target.__name__} sent nothing in 600 s")
    result = here.recv()
    process.join(60)
    return result


# --- the checks --------------------------------------------------------------------------------


def run_checks(model: str, scratch: Path) -> list[Outcome]:
    import numpy as np

    from runtime.collective import WeightServer
    from runtime.rundir import RunDir
    from runtime.tasks.tiny_model import build_tiny_model, vocabulary
    from runtime.trainer.synthetic import random_batch
    from runtime.trainer.train import Trainer
    from runtime.trainer.weights import checksum, state_items

    gpus = torch.cuda.device_count()
    model_dir = build_tiny_model(scratch / "model", MODELS[model], seed=0)
    run_dir = RunDir(scratch / "run").create()
    config = Config.model_validate(
        {
            "run": {"run_dir": str(run_dir.root)},
            "model": {"path": str(model_dir), "dtype": "bfloat16"},
            "trainer": {"micro_batch_size": 8, "lr": 1e-4},
            "async": {"weight_sync": "collective"},
        }
    )
    trainer = Trainer(config, run_dir, str(model_dir))
    outcomes: list[Outcome] = []
    rng = np.random.default_rng(0)

    def step() -> Outcome:
        times = []
        for version in range(3):
            batch = random_batch(rng, version=version, vocab_size=len(vocabulary()))
            started = time.perf_counter()
            trainer.step(batch)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        device = trainer.accelerator.device
        return Outcome("trainer step", "ok", statistics.median(times), detail=f"on {device}")

    outcomes.append(_attempt("trainer step", step))
    model_ = trainer.accelerator.unwrap_model(trainer.model)
    server = WeightServer("127.0.0.1", device=torch.device("cuda:0"))
    try:

        def export() -> Outcome:
            started = time.perf_counter()
            tensors = trainer.export_weights()
            export_s = time.perf_counter() - started
            started = time.perf_counter()
            snapshot = server.stage(1, state_items(model_), 256 << 20, dtype=torch.bfloat16)
            server.promote(1)
            stage_s = time.perf_counter() - started
            nbytes = snapshot.nbytes
            detail = f"export_weights {export_s:.3f} s; stage (pinned buckets) {stage_s:.3f} s"
            assert checksum(tensors) == checksum(
                {s.name: s.view(snapshot.buckets[s.bucket]) for s in snapshot.slots}
            ), "the packed snapshot differs from export_weights"
            return Outcome("export", "ok", stage_s, nbytes, detail)

        outcomes.append(_attempt("export", export))
        expected = checksum(trainer.export_weights())
        nbytes = sum(t.numel() * 2 for _, t in state_items(model_))

        def nccl() -> Outcome:
            if gpus < 2:
                return Outcome("nccl", "skipped", detail=f"NCCL needs a GPU per rank; {gpus} here")
            seconds, received = _in_process(_nccl_receiver, server.address, server.token)
            status = "ok" if received == expected else "failed"
            return Outcome("nccl", status, seconds, nbytes, "cuda:0 -> cuda:1, bytes checked")

        outcomes.append(_attempt("nccl", nccl))

        def ipc() -> Outcome:
            buckets = [b.cuda() for b in server._state.served.buckets]  # type: ignore[union-attr]
            context = mp.get_context("spawn")
            queue = context.Queue()
            queue.put(buckets)
            seconds, total = _in_process(_ipc_receiver, queue)
            status = "ok" if total == sum(int(b.sum()) for b in buckets) else "failed"
            return Outcome("ipc", status, seconds, nbytes, "same GPU, CUDA IPC handles + copy")

        outcomes.append(_attempt("ipc", ipc))

        def vllm() -> Outcome:
            try:
                import vllm  # noqa: F401
            except ImportError:
                return Outcome("vllm", "skipped", detail="vllm is not installed")
            if gpus < 2:
                return Outcome("vllm", "skipped", detail=f"NCCL needs a GPU per rank; {gpus} here")
            seconds, version, count, before, after = _in_process(
                _vllm_receiver, str(model_dir), server.address, server.token
            )
            want = sum(float(t.double().sum()) for t in trainer.export_weights().values())
            moved = abs(after - want) <= 1e-3 * max(1.0, abs(want)) and after != before
            detail = (
                f"v{version}, {count} tensors; param sum {before:.4g} -> {after:.4g} ({want:.4g})"
            )
            return Outcome("vllm", "ok" if moved else "failed", seconds, nbytes, detail)

        outcomes.append(_attempt("vllm", vllm))
    finally:
        server.close()
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/gpu_check.py", description=__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
            "nothing was run. Run this on a GPU host to check the trainer and the weight path."
        )
        _report([Outcome(check, "skipped", detail="no CUDA") for check in CHECKS])
        return 0
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        outcomes = run_checks(args.model, Path(scratch))
    print(f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, model {args.model}")
    _report(outcomes)
    return 1 if any(o.status == "failed" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
