"""The same engine on CUDA: skipped without a GPU."""

import pytest
import torch

from adaptive.drafters.layerskip import LayerSkipDrafter
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.engine.skip import SkipSet
from adaptive.models import LoadedModel
from tests.conftest import char_tokenizer, tiny_model

pytestmark = pytest.mark.cuda


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_equality_on_cuda():
    model = tiny_model("llama", n_layers=6)
    cpu = Engine(LoadedModel(model, char_tokenizer(), "t", "-", torch.device("cpu"), torch.float32))
    prompt = list(range(3, 20))
    cfg = GenerationConfig(max_new_tokens=30, draft_len=4, ignore_eos=True)
    ref = cpu.generate(prompt, cfg).token_ids
    gpu_model = tiny_model("llama", n_layers=6).cuda()
    gpu = Engine(LoadedModel(gpu_model, char_tokenizer(), "t", "-", torch.device("cuda"), torch.float32))
    gpu_ar = gpu.generate(prompt, cfg).token_ids
    assert gpu_ar == ref  # same weights (same seed), fp32: the CUDA path decodes as the CPU one
    assert gpu.generate(prompt, cfg, drafter=LayerSkipDrafter(SkipSet(attn=(1, 3)), 6)).token_ids == ref


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sampling_runs_on_cuda():
    model = tiny_model("qwen2", n_layers=4).cuda()
    eng = Engine(LoadedModel(model, char_tokenizer(), "t", "-", torch.device("cuda"), torch.float32))
    r = eng.generate([3, 4, 5], GenerationConfig(max_new_tokens=16, temperature=0.8, seed=1, ignore_eos=True),
                     drafter=LayerSkipDrafter(SkipSet(mlp=(1,)), 4))
    assert len(r.token_ids) == 16
