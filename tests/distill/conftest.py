"""What the distillation tests share: the tiny model (fp32) and a copy of its calibrated profile to write into."""

import shutil

import pytest

from adaptive.models import load_model


@pytest.fixture
def prof(tiny_profile, tmp_path):
    dst = tmp_path / "prof"
    shutil.copytree(tiny_profile, dst)
    return dst


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load_model(str(tiny_model_dir), dtype="float32")
