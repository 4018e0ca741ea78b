"""File against collective weight sync on this machine's CPUs (issue #13).

The bench process plays trainer rank 0; each worker is a process of its own that holds a model's
tensors and copies every received tensor into them (what vLLM's ``reload_weights`` does, minus
vLLM's own bookkeeping, which costs both paths alike). One sync, timed from the trainer's side:

- ``file``: ``publish_weights`` (safetensors to a temp file, fsync, rename), then every worker
  reads the file and copies it in (``async.weight_sync: file``);
- ``collective``: ``WeightServer.stage`` (pack into buckets) and ``promote``, then every worker
  takes a seat in a round and copies each bucket's tensors in as they arrive (gloo, loopback).

``memcpy`` is one ``copy_`` of a buffer of the same bytes within one process (torch's threads),
run between the syncs: the bound for any transport that must move the bytes at least once.
Columns: ``trainer s`` (publish or stage), ``workers s`` (from the trainer's word until every
worker holds the weights), ``s/sync`` (both), and each as a multiple of the memcpy. Models: the
tests' tiny Llama and a Llama of about 100M parameters built from a config with random weights
(nothing is downloaded).

    nice .venv/bin/python bench/weight_sync.py [--models tiny,100m] [--workers 1,2]
        [--repeats 5] [--bucket-mb 64]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: bench/ is on the path, the repo is not
    sys.path.insert(0, str(REPO))

from runtime.collective import Fetch, WeightServer  # noqa: E402
from runtime.config import TinyModelConfig  # noqa: E402
from runtime.rundir import RunDir  # noqa: E402
from runtime.trainer.weights import load_weights, publish_weights, state_items  # noqa: E402

MODELS = {
    "tiny": TinyModelConfig(),
    # 14 layers of hidden 768 / MLP 2048 with 12 heads: 99M parameters (the character vocabulary
    # keeps the embedding small, so nearly all of it is in the layers, as in a real model).
    "100m": TinyModelConfig(
        hidden_size=768, intermediate_size=2048, num_layers=14, num_heads=12, num_kv_heads=12
    ),
}


def build(name: str) -> dict[str, torch.Tensor]:
    """The model's tensors (float32, random), as the trainer would publish them."""
    from transformers import LlamaForCausalLM

    from runtime.tasks.tiny_model import llama_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config(MODELS[name]))
    return {n: t.contiguous() for n, t in state_items(model)}


def _worker(name: str, conn: Connection) -> None:
    """A stand-in rollout worker: its own copy of the model, filled by each sync."""
    torch.set_num_threads(1)
    params = {n: torch.empty_like(t) for n, t in build(name).items()}
    conn.send("ready")
    while (job := conn.recv()) is not None:
        method, version, where, token = job
        with torch.no_grad():
            if method == "file":
                for tensor_name, tensor in load_weights(where).items():
                    params[tensor_name].copy_(tensor)
                loaded = version
            else:
                fetch = Fetch(where, token, version, torch.device("cpu"))
                for tensor_name, tensor in fetch.tensors():
                    params[tensor_name].copy_(tensor)
                loaded = fetch.version
        conn.send(loaded)


def memcpy_s(src: torch.Tensor, dst: torch.Tensor) -> float:
    """One ``copy_`` of ``src`` into ``dst`` (both touched before)."""
    started = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - started


def run(
    name: str, workers: int, repeats: int, bucket_mb: int, scratch: Path
) -> dict[str, float | str]:
    tensors = build(name)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    context = mp.get_context("spawn")
    pipes, processes = [], []
    for _ in range(workers):
        here, there = context.Pipe()
        process = context.Process(target=_worker, args=(name, there), daemon=True)
        process.start()
        pipes.append(here)
        processes.append(process)
    for pipe in pipes:
        assert pipe.recv() == "ready"
    run_dir = RunDir(scratch / f"{name}-{workers}").create()
    server = WeightServer("127.0.0.1", gather_s=0.01)
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    times: dict[str, list[float]] = {"memcpy": []}
    version = 0
    try:
        for _ in range(repeats):
            # Interleaved, so that each method and the memcpy see about the same machine.
            times["memcpy"].append(memcpy_s(src, dst))
            for method in ("file", "collective"):
                version += 1
                started = time.perf_counter()
                if method == "file":
                    path = publish_weights(tensors, run_dir, version, keep=1)
                    job = ("file", version, str(path), "")
                else:
                    server.stage(version, tensors.items(), bucket_mb << 20)
                    server.promote(version)
                    job = ("collective", version, server.address, server.token)
                published = time.perf_counter()
                for pipe in pipes:
                    pipe.send(job)
                loaded = [pipe.recv() for pipe in pipes]
                ended = time.perf_counter()
                assert loaded == [version] * workers, loaded
                times.setdefault(f"{method}_trainer", []).append(published - started)
                times.setdefault(f"{method}_workers", []).append(ended - published)
                times.setdefault(method, []).append(ended - started)
    finally:
        for pipe in pipes:
            pipe.send(None)
        for process in processes:
            process.join(30)
        server.close()
    row: dict[str, float | str] = {
        "model": name,
        "params_m": sum(t.numel() for t in tensors.values()) / 1e6,
        "mb": nbytes / 1e6,
        "workers": workers,
    }
    for key, values in times.items():
        row[key] = statistics.median(values)
    return row


def print_table(rows: Sequence[dict[str, float | str]]) -> None:
    header = (
        f"{'model':>6} {'params':>7} {'MB':>6} {'workers':>7} {'method':>10} {'trainer s':>9} "
        f"{'workers s':>9} {'s/sync':>7} {'GB/s':>6} {'memcpy s':>8} {'memcpy GB/s':>11} "
        f"{'x memcpy':>8} {'workers x':>9}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        nbytes = float(row["mb"]) * 1e6
        copy_s = float(row["memcpy"])
        for method in ("file", "collective"):
            total = float(row[method])
            held = float(row[f"{method}_workers"])
            print(
                f"{row['model']:>6} {float(row['params_m']):>6.1f}M {float(row['mb']):>6.1f} "
                f"{row['workers']:>7} {method:>10} {float(row[f'{method}_trainer']):>9.3f} "
                f"{held:>9.3f} {total:>7.3f} {nbytes / total / 1e9:>6.2f} {copy_s:>8.4f} "
                f"{nbytes / copy_s / 1e9:>11.2f} {total / copy_s:>8.1f} {held / copy_s:>9.1f}"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/weight_sync.py", description=__doc__)
    parser.add_argument("--models", default="tiny,100m", help="comma list of: tiny, 100m")
    parser.add_argument("--workers", default="1,2", help="comma list of worker counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=64)
    args = parser.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: {unknown} not among {sorted(MODELS)}")
    try:
        counts = [int(n) for n in args.workers.split(",")]
    except ValueError:
        parser.error(f"--workers: {args.workers!r} is not a comma list of integers")
    if args.repeats < 1 or args.bucket_mb < 1 or min(counts) < 1:
        parser.error("--repeats, --bucket-mb and --workers must be at least 1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="weight-sync-bench-") as scratch:
        for name in models:
            for workers in counts:
                rows.append(run(name, workers, args.repeats, args.bucket_mb, Path(scratch)))
    print(
        f"one sync = trainer publishes + every worker has the weights; median of {args.repeats}; "
        f"torch threads {torch.get_num_threads()}; collective = gloo over loopback, "
        f"{args.bucket_mb} MB buckets"
    )
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
