"""Phase 2's continuations: a domain's prompts continued together equal each one continued alone,
on torch (fp32) and on llama.cpp, whose sequences share one context (prompts join as room allows)."""

import pytest
import torch

from adaptive.calibrate.prepare import continue_together
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.models import LoadedModel
from tests.conftest import tiny_lm

PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 13], [5], [9, 9, 2, 4]]  # different lengths: ragged rows


def test_continuations_decoded_together_equal_each_alone():
    engine = Engine(tiny_lm())
    cfg = GenerationConfig(max_new_tokens=9)
    alone = [engine.generate(p, cfg).token_ids for p in PROMPTS]
    done = []
    conts, pooled = continue_together(engine, PROMPTS, cfg, True, on_done=lambda: done.append(1))
    assert conts == alone and len(done) == len(PROMPTS)
    assert all(len(c) == 9 for c in conts)  # the tiny model has no EOS in reach: each runs to max_new_tokens
    # each prompt's embedding is its own prefill's, as the runtime routes on
    for p, v in zip(PROMPTS, pooled):
        assert torch.equal(v, engine.start(p, cfg, pool=True).pooled)
    # at most two at a time: the same continuations
    assert continue_together(engine, PROMPTS, cfg, False, max_together=2)[0] == alone


def test_on_llama_cpp_prompts_join_as_the_shared_context_allows(tiny_gguf):
    pytest.importorskip("llama_cpp")
    from adaptive.engine.llamacpp import LlamaCppBackbone

    path, lm = tiny_gguf
    # 256 cells shared by all sequences: four prompts of 60-63 tokens and 8 cached new tokens each
    # (278) cannot all be live at once; all four started together filled the cache (the bug this guards)
    cpp = LlamaCppBackbone(path, threads=1, context=256, sequences=4)
    model = LoadedModel(None, lm.tokenizer, "tiny", str(path), torch.device("cpu"), torch.float32, engine="llama.cpp")
    model.__dict__["backbone"] = cpp  # the backbone above, not one of the default context
    engine = Engine(model)
    cfg = GenerationConfig(max_new_tokens=9)
    prompts = [[(7 * i + j) % 40 + 3 for i in range(60 + j)] for j in range(4)]
    conts, _ = continue_together(engine, prompts, cfg, False)
    assert conts == [engine.generate(p, cfg).token_ids for p in prompts]
