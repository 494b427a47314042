"""MeasureSettings: the typed measurement settings calibration records and the runtime reads, each
default in one place, parsed once when a profile is loaded."""

import json
import shutil

import pytest

from adaptive.calibrate import CalibrationSettings
from adaptive.errors import ConfigError
from adaptive.profile import MeasureSettings, ProfileError, RuntimeSettings, load_profile, save_profile


def test_defaults_and_calibration_takes_them():
    assert MeasureSettings() == MeasureSettings(
        anchors_per_domain=10, confirm_prompts=6, confirm_tokens=64, block_tokens=16, min_blocks=6,
        interval_level=0.9, min_gain=0.02, acceptance_floor=0.2, bigram_min_count=2, cascade_lenience=1.0, seed=0)
    assert CalibrationSettings().measure == MeasureSettings()
    q = CalibrationSettings.quick(seed=3)
    assert q.measure == MeasureSettings(anchors_per_domain=6, confirm_prompts=4, confirm_tokens=48, min_blocks=4,
                                        seed=3)
    assert CalibrationSettings().runtime == RuntimeSettings() == RuntimeSettings(None, 8, 12, 8)
    assert CalibrationSettings(chat=False, max_draft_len=5).runtime == RuntimeSettings(chat=False, max_draft_len=5)


def test_values_are_checked_naming_the_field():
    with pytest.raises(ConfigError, match="block-tokens must be a positive integer, got 0") as e:
        MeasureSettings(block_tokens=0)
    assert e.value.key == "block_tokens"
    with pytest.raises(ConfigError, match=r"block-tokens \(64\) must be below confirm-tokens \(64\)"):
        MeasureSettings(block_tokens=64)
    with pytest.raises(ConfigError, match="interval-level") as e:
        MeasureSettings(interval_level=1.0)
    assert e.value.key == "interval_level"
    with pytest.raises(ConfigError, match="cascade-lenience"):
        CalibrationSettings(cascade_lenience=0.5)  # the calibration's own check is the record's


def test_split_takes_its_keys_and_leaves_the_others():
    s, rest = MeasureSettings.split({"block_tokens": 8, "trials": 30, "seconds": 1.5})
    assert s == MeasureSettings(block_tokens=8) and rest == {"trials": 30, "seconds": 1.5}
    with pytest.raises(ValueError, match=r"settings\.min_blocks: expected an integer, got '6'"):
        MeasureSettings.split({"min_blocks": "6"})


@pytest.fixture
def prof(tiny_profile, tmp_path):
    dst = tmp_path / "p"
    shutil.copytree(tiny_profile, dst)
    return dst


def _edit_settings(path, **changes):
    pj = path / "profile.json"
    data = json.loads(pj.read_text())
    for k, v in changes.items():
        if v is None:
            del data["settings"][k]
        else:
            data["settings"][k] = v
    pj.write_text(json.dumps(data))
    return pj


def test_a_profile_keeps_its_settings_keys(prof, tmp_path):
    p = load_profile(prof)
    # tests/conftest.py's tiny_settings, as recorded
    assert p.settings == MeasureSettings(anchors_per_domain=2, confirm_prompts=2, confirm_tokens=12, block_tokens=4,
                                         min_blocks=2, acceptance_floor=0.0)
    assert p.calibration["trials"] == 6 and p.calibration["backend"] == "loky" and "block_tokens" not in p.calibration
    written = json.loads((prof / "profile.json").read_text())["settings"]
    run = {"jobs", "backend", "seconds", "others_share", "pooling"}
    assert set(written) == set(CalibrationSettings().to_dict()) | run
    again = json.loads((save_profile(p, tmp_path / "copy") / "profile.json").read_text())["settings"]
    assert again == written


def test_a_profile_without_a_key_takes_its_default(prof):
    _edit_settings(prof, cascade_lenience=None, anchors_per_domain=None)  # as if written before they existed
    p = load_profile(prof)
    assert p.settings.cascade_lenience == 1.0 and p.settings.anchors_per_domain == 10
    assert p.settings.block_tokens == 4  # the others as recorded


def test_a_malformed_setting_names_the_file_and_key(prof):
    pj = _edit_settings(prof, block_tokens="sixteen")
    with pytest.raises(ProfileError, match=r"profile\.json: settings\.block_tokens: expected an integer, got 'six"):
        load_profile(prof)
    _edit_settings(prof, block_tokens=4, min_gain=1.5)
    with pytest.raises(ProfileError, match=r"settings\.min_gain: min-gain must be in \[0, 1\), got 1.5") as e:
        load_profile(prof)
    assert str(pj) in str(e.value)
    data = json.loads(pj.read_text())
    data["settings"] = [1, 2]
    pj.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="settings: expected an object, got list"):
        load_profile(prof)
