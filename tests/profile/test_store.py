"""Profile files: round trip, atomic replacement, and every kind of damage as a clear error."""

import json
import shutil
from dataclasses import replace

import pytest

from adaptive.engine.skip import SkipSet
from adaptive.profile import SCHEMA_VERSION, DomainRecord, ProfileError, load_profile, profile_json, save_profile
from tests.conftest import TINY_DOMAINS


@pytest.fixture
def prof(tiny_profile, tmp_path):
    dst = tmp_path / "p"
    shutil.copytree(tiny_profile, dst)
    return dst


def test_profile_round_trip(prof, tmp_path):
    p = load_profile(prof)
    assert sorted(p.domains) == sorted(TINY_DOMAINS)
    assert p.global_set.name == "global"
    assert p.n_layers == 4 and p.model.dtype == "float32"
    for name, d in p.domains.items():
        assert isinstance(d, DomainRecord) and d.name == name
        assert d.prompts == 4 and d.anchors == 2
        assert d.layer_skip.trials >= 6 or not d.layer_skip.may_pay  # the bound can stop a search early
        assert d.layer_skip.draft_len >= 1 and d.decision.drafter in ("ar", "ssd", "pld", "cascade")
        assert all(m.speedup > 0 for m in d.measurements)
    assert sorted(set(p.index.labels)) == sorted(TINY_DOMAINS)
    for d in [*p.domains.values(), p.global_set]:  # the cascade: a plan, a timing, a bigram table
        assert d.cascade.draft_len >= 1 and [m.role for m in d.measurements].count("cascade") == 1
        assert d.bigram is not None and len(d.bigram) > 0
        assert 0.0 <= d.statistical.token_acceptance <= 1.0
        assert d.verify_table(20)[0] == d.verify[0] and len(d.verify_table(20)) == 21
    again = save_profile(p, tmp_path / "copy")
    q = load_profile(again)
    assert profile_json(q) == profile_json(p)
    assert q.domains == p.domains and q.global_set == p.global_set and q.runtime == p.runtime
    assert q.model == p.model and q.cost_model == p.cost_model
    assert any(d.draft_vocab is not None for d in p.domains.values())
    for name, d in p.domains.items():  # reduced vocabularies round-trip
        if d.draft_vocab is not None:
            assert q.domains[name].draft_vocab.tolist() == d.draft_vocab.tolist()
    for name, d in p.domains.items():  # the bigram tables round-trip (ids and float16 probabilities)
        e = q.domains[name].bigram
        assert e.keys.tolist() == d.bigram.keys.tolist() and e.succ.tolist() == d.bigram.succ.tolist()
        assert e.prob.tolist() == pytest.approx(d.bigram.prob.tolist(), abs=1e-3)
    # the lexicon: fitted on the domains' prompts, round-trips, guesses a calibration prompt's domain
    assert set(p.lexicon.names) == set(TINY_DOMAINS) and p.lexicon.prompts == 4 * len(TINY_DOMAINS)
    assert q.lexicon.names == p.lexicon.names and q.lexicon.tokens.tolist() == p.lexicon.tokens.tolist()
    assert q.lexicon.centroids.tolist() == p.lexicon.centroids.tolist()


def test_save_replaces_a_profile_atomically_and_refuses_other_directories(prof, tmp_path):
    p = load_profile(prof)
    save_profile(p, prof)  # replace in place
    assert profile_json(load_profile(prof)) == profile_json(p)
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".p.")]  # no temporary left behind
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ProfileError, match="not a profile"):
        save_profile(p, other)
    assert (other / "notes.txt").read_text() == "mine"


def test_profile_for_another_model_is_refused(prof):
    p = load_profile(prof)
    p.check_model(replace(p.model, name="renamed", spec="elsewhere", dtype="bfloat16"))  # the same weights
    with pytest.raises(ProfileError, match="calibrated for .* not for the loaded model 'other'"):
        p.check_model(replace(p.model, weights_hash="0000", name="other"))
    with pytest.raises(ProfileError, match="calibrated for"):
        p.check_model(replace(p.model, n_layers=30))


def test_measurements_hold_a_skip_set_stored_as_text(prof, tmp_path):
    """A measurement's ``skip`` is a SkipSet in memory and its text form in profile.json, as every
    version has written it: a profile.json with text skip sets loads, and saves back byte for byte."""
    pj = prof / "profile.json"
    data = json.loads(pj.read_text())
    ms = data["domains"]["math"]["measurements"]
    ms[0]["skip"], ms[-1]["skip"] = "attn=1,3;mlp=0-2", "none"
    pj.write_text(json.dumps(data, indent=1) + "\n")  # as save_profile writes it
    p = load_profile(prof)
    got = p.domains["math"].measurements
    assert got[0].skip == SkipSet((1, 3), (0, 1, 2)) and got[-1].skip == SkipSet() and not got[-1].skip
    assert all(isinstance(m.skip, SkipSet) for d in [*p.domains.values(), p.global_set] for m in d.measurements)
    again = save_profile(p, tmp_path / "copy")
    assert (again / "profile.json").read_text() == pj.read_text()


def _edit(prof, fn):
    pj = prof / "profile.json"
    data = json.loads(pj.read_text())
    fn(data)
    pj.write_text(json.dumps(data))


@pytest.mark.parametrize("case,match", [
    ("newer", "newer"),
    ("format", "not an adaptive profile"),
    ("json", "not valid JSON"),
    ("missing_json", "profile.json: missing"),
    ("missing_index", "anchors.faiss: missing"),
    ("truncated_index", "checksum"),
    ("missing_bigrams", "bigrams.npz: missing"),
    ("truncated_bigrams", "checksum"),
    ("bad_bigram_entry", "bigrams.npz: unreadable or inconsistent"),
    ("missing_vocab", "vocab.npz: missing"),
    ("bad_vocab_size", "vocab.npz: unreadable or inconsistent"),
    ("bad_skip", "malformed"),
    ("schema_1", "schema version 1 was written by an earlier adaptive.*calibrate again"),
    ("bad_decision", r"malformed .*domain math\.decision\.drafter: expected a string"),
    ("unknown_decision", "malformed .*a domain decodes with one of ar, ssd, pld, cascade, eagle, got 'fast'"),
    ("bad_prior", r"malformed .*domain math\.priors\.layer_skip: missing field acceptance"),
    ("unknown_field", r"malformed .*domain math: unknown field\(s\) pays"),
    ("bad_measurement", r"malformed .*domain chat\.measurements\[0\]\.speedup: expected a number"),
    ("no_domain", "no domain entry"),
    ("missing_lexicon", "lexicon.npz: missing"),
    ("truncated_lexicon", "lexicon.npz: does not match its checksum"),
    ("not_dir", "is a directory"),
])
def test_damaged_profiles_are_clear_errors(prof, case, match):
    target = prof
    if case == "newer":
        _edit(prof, lambda d: d.update(schema_version=SCHEMA_VERSION + 1))
    elif case == "format":
        _edit(prof, lambda d: d.update(format="something"))
    elif case == "json":
        (prof / "profile.json").write_text("{ truncated")
    elif case == "missing_json":
        (prof / "profile.json").unlink()
    elif case == "missing_index":
        (prof / "anchors.faiss").unlink()
    elif case == "truncated_index":
        f = prof / "anchors.faiss"
        f.write_bytes(f.read_bytes()[:-16])
    elif case == "missing_bigrams":
        (prof / "bigrams.npz").unlink()
    elif case == "truncated_bigrams":
        f = prof / "bigrams.npz"
        f.write_bytes(f.read_bytes()[:-16])
    elif case == "bad_bigram_entry":
        _edit(prof, lambda d: d["domains"]["math"]["bigram"].update(entry=99))
    elif case == "missing_vocab":
        (prof / "vocab.npz").unlink()
    elif case == "bad_vocab_size":
        def grow(d):
            entry = next(e for e in d["domains"].values() if e.get("draft_vocab"))
            entry["draft_vocab"]["entries"] += 1
        _edit(prof, grow)
    elif case == "bad_skip":
        _edit(prof, lambda d: d["domains"]["math"]["layer_skip"]["skip"].update(attn=[99]))
    elif case == "schema_1":
        _edit(prof, lambda d: d.update(schema_version=1))
    elif case == "bad_decision":
        _edit(prof, lambda d: d["domains"]["math"]["decision"].update(drafter=3))
    elif case == "unknown_decision":
        _edit(prof, lambda d: d["domains"]["math"]["decision"].update(drafter="fast"))
    elif case == "bad_prior":
        _edit(prof, lambda d: d["domains"]["math"]["priors"]["layer_skip"].pop("acceptance"))
    elif case == "unknown_field":
        _edit(prof, lambda d: d["domains"]["math"].update(pays=True))
    elif case == "bad_measurement":
        _edit(prof, lambda d: d["domains"]["chat"]["measurements"][0].update(speedup="fast"))
    elif case == "no_domain":
        _edit(prof, lambda d: d["domains"].pop("math"))
    elif case == "missing_lexicon":
        (prof / "lexicon.npz").unlink()
    elif case == "truncated_lexicon":
        f = prof / "lexicon.npz"
        f.write_bytes(f.read_bytes()[:-16])
    elif case == "not_dir":
        target = prof / "profile.json"
    with pytest.raises(ProfileError, match=match):
        load_profile(target)


def test_missing_profile_directory(tmp_path):
    with pytest.raises(ProfileError, match="no such profile"):
        load_profile(tmp_path / "nope")


def test_a_failed_replacement_puts_the_old_profile_back(prof, monkeypatch):
    import os

    p = load_profile(prof)
    before = (prof / "profile.json").read_text()
    real_rename = os.rename
    calls = []

    def failing(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the new profile's rename into place
            raise OSError("disk trouble")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="disk trouble"):
        save_profile(p, prof)
    monkeypatch.setattr(os, "rename", real_rename)
    assert (prof / "profile.json").read_text() == before
    assert not [x for x in prof.parent.iterdir() if x.name.startswith(".p.")]


def test_skip_sets_are_every_records_once(prof):
    """What a server warms at startup: each record's skip set, each once, whatever the record decides (a
    request may ask for knn-skip, ssd-static or the cascade, which draft with it); none for a record
    without one."""
    prof = load_profile(prof)
    from adaptive.profile import Decision
    from tests.helpers.profiles import with_domains

    a, b, g = SkipSet((1,), ()), SkipSet((), (0,)), SkipSet((2,), ())
    names = sorted(prof.domains)
    sets = {names[0]: a, names[1]: b, names[2]: b}
    drafters = {names[0]: "ssd", names[1]: "cascade", names[2]: "ar", None: "pld"}
    p = with_domains(prof, lambda n: drafters[n])
    p.domains = {n: replace(d, layer_skip=replace(d.layer_skip, skip=sets.get(n, SkipSet())))
                 for n, d in p.domains.items()}
    p.global_set = replace(p.global_set, layer_skip=replace(p.global_set.layer_skip, skip=g))
    assert p.skip_sets() == (a, b, g)  # b once; the global record decides prompt lookup, its set is still warmed
    p.domains[names[0]] = replace(p.domains[names[0]], decision=Decision("ar"))
    p.global_set = replace(p.global_set, layer_skip=replace(p.global_set.layer_skip, skip=SkipSet()))
    assert p.skip_sets() == (a, b)  # the decision does not matter; an empty skip set is none


def test_a_profile_without_a_lexicon_loads_and_one_naming_unknown_domains_is_refused(prof, tmp_path):
    from adaptive.index.lexicon import Lexicon

    (prof / "lexicon.npz").unlink()  # as calibrated before the lexicon: not listed in profile.json
    _edit(prof, lambda d: d["files"].pop("lexicon.npz"))
    p = load_profile(prof)
    assert p.lexicon is None
    save_profile(replace(p, lexicon=Lexicon.fit({"math": [[1, 2]], "poetry": [[3, 4]]})), tmp_path / "q")
    with pytest.raises(ProfileError, match=r"lexicon.npz: domains \['poetry'\] have no domain entry"):
        load_profile(tmp_path / "q")
