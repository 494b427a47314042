"""The early-exit drafter: its skip set, an untrained exit block is the identity, and sampling
with it is distributed as the target (chi-square). Trained through a profile: ``tests/distill/``."""

import pytest
import torch

from adaptive.drafters.early_exit import EarlyExitDrafter, ExitBlock, early_exit_skip
from adaptive.errors import ConfigError
from adaptive.models import load_model
from tests.conftest import tiny_lm
from tests.helpers.sampling import V, chi2_pvalue, sample_counts, target_joint


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load_model(str(tiny_model_dir), dtype="float32")


def test_early_exit_skip():
    # an exit after 2 of 4 layers skips both sublayers of layers 2 and 3
    assert early_exit_skip(2, 4).to_text() == "attn=2-3;mlp=2-3"
    with pytest.raises(ConfigError):
        early_exit_skip(4, 4)


def test_untrained_block_is_the_identity(lm):
    block = ExitBlock.from_backbone(lm.backbone, 2)
    w = next(block.parameters())
    h = torch.randn(2, 5, block.hidden, device=w.device, dtype=w.dtype)  # the backbone's device (CUDA on a GPU)
    assert torch.equal(block(h), h)


def test_early_exit_sampling_matches_the_target():
    lm = tiny_lm("llama", vocab=V, n_layers=4, init=0.5, seed=7)
    block = ExitBlock.from_backbone(lm.backbone, 2)
    torch.manual_seed(0)
    with torch.no_grad():
        block.down.weight.normal_(0, 0.3)  # a block that changes q, so q != p
    counts = sample_counts(lm, EarlyExitDrafter(2, 4, block))
    assert chi2_pvalue(counts, target_joint(lm)) > 1e-3
