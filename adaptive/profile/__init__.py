"""Calibration profiles: the typed records (:mod:`.records`) and their directory (:mod:`.store`)."""

from adaptive.profile.engines import (
                                      ENGINES_FILE,
                                      TRAINING_ENGINE,
                                      EngineSet,
                                      is_two_engine,
                                      member_dir,
                                      member_online_path,
                                      read_engines,
                                      training_member,
                                      write_engines,
)
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

__all__ = ["BIGRAMS", "DECISIONS", "DISTILLED", "ENGINES_FILE", "FORMAT", "GLOBAL", "SCHEMA_VERSION",
           "TRAINING_ENGINE", "VOCAB", "Decision", "DistilledRecord", "DomainRecord", "EngineSet", "Interval",
           "MeasureSettings", "Measurement", "ModelFingerprint", "Prior", "Priors", "Profile", "ProfileError",
           "RuntimeSettings", "SkipSearch", "StatisticalAcceptance", "VocabChoice", "check_writable", "is_two_engine",
           "load_profile", "member_dir", "member_online_path", "profile_json", "read_engines", "save_profile",
           "training_member", "write_engines"]
