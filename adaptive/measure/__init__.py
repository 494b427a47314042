"""Measuring drafters against plain decoding: timed races with bootstrap intervals (:mod:`.timing`,
:mod:`.interval`), the decision they imply (:mod:`.decision`), a domain's race, decision and
record together (:mod:`.race`), and the statistical drafters' teacher-forced acceptance and
cascade plan (:mod:`.statistical`).

Shared by the offline calibrator and the runtime's online learner (which measures a domain it
discovered in traffic the way calibration measures a calibrated one, through the same
:func:`.race.race_domain` and the profile's :class:`~adaptive.profile.MeasureSettings`); both sit
above this layer.
"""
