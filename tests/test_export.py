"""``asp-tui export``: a kept weight version of a run as a Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from asp_tui.cli import main
from runtime.config import ConfigError, validate_config
from runtime.controller.client import write_run_config
from runtime.export import export_version
from runtime.tasks import ensure_model


def _run_with_one_version(
    tmp_path: Path,
) -> tuple[Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A run directory with version 1 published as the trainer does (HF names, one file)."""
    config = validate_config({"task": {"sft_steps": 0}, "run": {"name": "exp"}})
    rd = write_run_config(tmp_path / "run", config)
    base = load_file(str(Path(ensure_model(config)) / "model.safetensors"))
    v1 = {k: (t + 0.5).contiguous() for k, t in base.items()}
    save_file(v1, str(rd.weights_file(1)), metadata={"format": "pt"})
    return rd.root, base, v1


def test_export_any_kept_version_loads_with_from_pretrained(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    run_dir, base, v1 = _run_with_one_version(tmp_path)
    assert main(["export", str(run_dir), str(tmp_path / "latest")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "latest")
    state = model.state_dict()
    assert all(torch.equal(state[k], v1[k]) for k in v1)
    assert (tmp_path / "latest" / "generation_config.json").is_file()
    # Version 0 is the model the run started from.
    export_version(run_dir, tmp_path / "v0", version=0)
    v0 = AutoModelForCausalLM.from_pretrained(tmp_path / "v0").state_dict()
    assert all(torch.equal(v0[k], base[k]) for k in base)


def test_export_refuses_unknown_versions_and_non_runs(tmp_path: Path, capsys) -> None:
    run_dir, _, _ = _run_with_one_version(tmp_path)
    with pytest.raises(ConfigError, match=r"--version: 7 is not kept .*\[0, 1\]"):
        export_version(run_dir, tmp_path / "out", version=7)
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "RUN_DIR:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
