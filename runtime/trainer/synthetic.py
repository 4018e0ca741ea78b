"""Random trainer batches for tests and step-time measurements (no engine needed)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from runtime.protocol import Batch, Completion, TrainGroup

if TYPE_CHECKING:
    from runtime.config import Config


def random_batch(
    rng: np.random.Generator,
    *,
    version: int = 0,
    groups: int = 8,
    samples: int = 4,
    prompt_len: tuple[int, int] = (8, 16),
    completion_len: tuple[int, int] = (40, 80),
    vocab_size: int = 100,
    low_token: int = 4,
) -> Batch:
    """``groups`` x ``samples`` completions of random token ids with random rewards in [0, 1].

    Lengths are drawn uniformly from the inclusive ranges; behaviour log-probs are plausible
    negative numbers (they only need the right shape and sign). Token ids start at ``low_token``
    to skip a tokenizer's special ids.
    """
    out = []
    for g in range(groups):
        prompt = rng.integers(low_token, vocab_size, rng.integers(prompt_len[0], prompt_len[1] + 1))
        completions = []
        for _ in range(samples):
            n = int(rng.integers(completion_len[0], completion_len[1] + 1))
            completions.append(
                Completion(
                    token_ids=rng.integers(low_token, vocab_size, n).astype(np.int32),
                    logprobs=(-rng.exponential(4.0, n)).astype(np.float32),
                    version_min=version,
                    version_max=version,
                    finish_reason="length",
                    reward=float(rng.random()),
                    finished_at=0.0,
                )
            )
        out.append(
            TrainGroup(
                group_id=version * 1000 + g,
                prompt_id=g,
                prompt_token_ids=prompt.astype(np.int32),
                completions=completions,
            )
        )
    return Batch(version=version, groups=out)


def measure_step_time(
    model_dir: str,
    steps: int = 10,
    groups: int = 8,
    samples: int = 4,
    length: int = 60,
    config: Config | None = None,
) -> list[float]:
    """Seconds per trainer step (loss, backward, optimizer, weight export) on random batches.

    ``config``: the run whose trainer settings (micro-batch size, loss, dtype) to use; the
    defaults otherwise. Its model path and run directory are replaced.
    """
    import tempfile
    import time

    from runtime.config import Config
    from runtime.rundir import RunDir
    from runtime.trainer.train import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        data = config.model_dump(mode="json", by_alias=True) if config is not None else {}
        data.setdefault("model", {})["path"] = model_dir
        data.setdefault("run", {})["run_dir"] = tmp
        config = Config.model_validate(data)
        trainer = Trainer(config, RunDir(tmp).create(), model_dir)
        rng = np.random.default_rng(0)
        spread = max(1, length // 4)
        times = []
        for version in range(steps + 1):
            batch = random_batch(
                rng,
                version=version,
                groups=groups,
                samples=samples,
                completion_len=(length - spread, length + spread),
                vocab_size=trainer.vocab_size,
            )
            started = time.perf_counter()
            trainer.step(batch)
            trainer.publish()
            times.append(time.perf_counter() - started)
        return times[1:]  # the first step pays for lazy initialisation


def main() -> None:
    import argparse
    import statistics

    parser = argparse.ArgumentParser(description="Measure the trainer's step time.")
    parser.add_argument("--model", required=True, help="a HF model directory")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--length", type=int, default=60, help="mean completion tokens")
    args = parser.parse_args()
    times = measure_step_time(args.model, args.steps, args.groups, args.samples, args.length)
    print(
        f"{args.groups} groups x {args.samples} samples x ~{args.length} tokens: "
        f"median {statistics.median(times) * 1000:.0f} ms, min {min(times) * 1000:.0f} ms, "
        f"max {max(times) * 1000:.0f} ms over {len(times)} steps"
    )


if __name__ == "__main__":
    main()
