"""Phase 2's continuations: a domain's prompts continued together equal each one continued alone (fp32)."""

from adaptive.calibrate.prepare import continue_together
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from tests.conftest import tiny_lm


def test_continuations_decoded_together_equal_each_alone():
    lm = tiny_lm()
    engine = Engine(lm)
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 13], [5], [9, 9, 2, 4]]  # different lengths: ragged rows
    cfg = GenerationConfig(max_new_tokens=9)
    alone = [engine.generate(p, cfg).token_ids for p in prompts]
    done = []
    together = continue_together(engine, [engine.start(p, cfg) for p in prompts], on_done=lambda: done.append(1))
    assert together == alone and len(done) == len(prompts)
    assert all(len(c) == 9 for c in together)  # the tiny model has no EOS in reach: each runs to max_new_tokens
