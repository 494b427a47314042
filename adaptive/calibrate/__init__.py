"""Offline calibration: prompts per domain in, a profile out (:func:`calibrate`)."""

from adaptive.calibrate.runner import calibrate
from adaptive.calibrate.settings import BACKENDS, CalibrationError, CalibrationSettings

__all__ = ["BACKENDS", "CalibrationError", "CalibrationSettings", "calibrate"]
