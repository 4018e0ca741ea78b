"""Methods mixed into every vLLM worker (``worker_extension_cls``), called via ``collective_rpc``.

This module runs inside vLLM's worker processes, not in the rollout worker itself, so it imports
only torch, safetensors and ``runtime.collective`` (torch only). vLLM resolves
``runtime.rollout.weight_extension.WeightReloadExtension`` by name and adds it to the bases of
its worker class; ``self`` is then the vLLM worker, with ``self.model_runner`` and
``self.device``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class WeightReloadExtension:
    """In-place weight reload: from a safetensors file, or from the trainer's broadcast."""

    model_runner: object
    device: torch.device

    def reload_weights_from(self, path: str) -> int:
        """Load every tensor of the safetensors file at ``path`` into the running model.

        The names are Hugging Face checkpoint names; vLLM's ``reload_weights`` maps them onto its
        fused layers (qkv, gate_up). Returns the number of tensors read, so the caller can check
        that the file was not empty.
        """
        count = 0

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            from safetensors import safe_open

            with safe_open(path, framework="pt", device=str(self.device)) as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    count += 1
                    yield name, handle.get_tensor(name)

        # Worker.reload_weights enters vLLM's config context, which the loaders need.
        self.reload_weights(weights_iterator=tensors())  # type: ignore[attr-defined]
        return count

    def load_weights_collective(
        self, address: str, token: str, want: int, timeout_s: float
    ) -> tuple[int, int]:
        """Take a seat in the trainer's next weight round (``runtime.collective``) and load what
        it broadcasts, bucket by bucket. Returns ``(version loaded, tensors read)``."""
        from runtime.collective import Fetch

        fetch = Fetch(address, token, want, self.device, timeout_s=timeout_s)
        received = fetch.tensors()
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in received:
                count += 1
                yield item

        try:
            self.reload_weights(weights_iterator=counted())  # type: ignore[attr-defined]
        finally:
            received.close()  # receives whatever the loader left, so the round can finish
        return fetch.version, count

    def weight_checksum(self) -> float:
        """Sum of every parameter, as float64: a cheap probe that a reload changed the model."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with torch.no_grad():
            return float(sum(p.detach().double().sum().item() for p in model.parameters()))
