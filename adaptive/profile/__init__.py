"""Calibration profiles: the typed records (:mod:`.records`) and their directory (:mod:`.store`)."""

from adaptive.profile.records import (
                                      DECISIONS,
                                      GLOBAL,
                                      Decision,
                                      DistilledRecord,
                                      DomainRecord,
                                      Interval,
                                      Measurement,
                                      MeasureSettings,
                                      ModelFingerprint,
                                      Prior,
                                      Priors,
                                      Profile,
                                      ProfileError,
                                      RuntimeSettings,
                                      SkipSearch,
                                      StatisticalAcceptance,
                                      VocabChoice,
)
from adaptive.profile.store import (
                                      BIGRAMS,
                                      DISTILLED,
                                      FORMAT,
                                      SCHEMA_VERSION,
                                      VOCAB,
                                      check_writable,
                                      load_profile,
                                      profile_json,
                                      save_profile,
)

__all__ = ["BIGRAMS", "DECISIONS", "DISTILLED", "FORMAT", "GLOBAL", "SCHEMA_VERSION", "VOCAB", "Decision",
           "DistilledRecord", "DomainRecord", "Interval", "MeasureSettings", "Measurement", "ModelFingerprint", "Prior",
           "Priors", "Profile", "ProfileError", "RuntimeSettings", "SkipSearch", "StatisticalAcceptance", "VocabChoice",
           "check_writable", "load_profile", "profile_json", "save_profile"]
