"""The llama.cpp engine (:mod:`adaptive.engine.llamacpp`) on a tiny random GGUF written in-process.

The GGUF holds the tiny torch Llama's own weights (float32), so the two engines can be compared on
the same model; llama.cpp keeps its KV cache in float16, hence the tolerances. Greedy equality of
speculative decoding is checked against the same engine's plain decoding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("llama_cpp")

from adaptive.drafters.factory import DrafterSpec, build_drafter  # noqa: E402
from adaptive.engine import llamacpp  # noqa: E402
from adaptive.engine.backbone import Segment  # noqa: E402
from adaptive.engine.config import GenerationConfig, Pooling  # noqa: E402
from adaptive.engine.engine import Engine  # noqa: E402
from adaptive.engine.llamacpp import LlamaCppBackbone  # noqa: E402
from adaptive.engine.llamacpp_host import mapped_resident  # noqa: E402
from adaptive.engine.loop import GenerationStats  # noqa: E402
from adaptive.engine.skip import SkipSet  # noqa: E402
from adaptive.errors import ConfigError, ContextFullError, PromptTooLongError  # noqa: E402
from adaptive.models import LoadedModel  # noqa: E402
from tests.conftest import char_tokenizer  # noqa: E402
from tests.helpers.decoding import decode_ids  # noqa: E402

PROMPT = [5, 9, 14, 22, 9, 14, 22, 31, 7, 9, 14, 22, 40, 12]


@pytest.fixture(scope="module")
def pair(tiny_gguf):
    """``(llama.cpp backbone, torch backbone)`` of the same tiny model."""
    path, lm = tiny_gguf
    return LlamaCppBackbone(path, threads=2, context=256, sequences=4), lm.backbone


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-2) -> bool:
    return float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))


def test_logits_and_embedding_match_the_torch_engine_on_the_same_weights(pair):
    cpp, pt = pair
    ids = torch.tensor(PROMPT)
    ours = cpp.forward(ids, cpp.new_cache(32), 0, logits="all").logits
    ref = pt.forward(ids, pt.new_cache(32), 0, logits="all").logits
    assert ours.shape == ref.shape == (len(PROMPT), pt.vocab_size)
    assert close(ours, ref)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    for pooling in (Pooling(None, "last"), Pooling(2, "mean"), Pooling(2, "last"), Pooling(0, "last"),
                    Pooling(1, "mean")):
        assert cpp.routing_pooling(pooling) == pooling  # every pooling, as on torch
        out = cpp.forward(ids, cpp.new_cache(32), 0, logits="last", **cpp.pool_args(pooling))
        ref = pt.forward(ids, pt.new_cache(32), 0, logits="last", **pt.pool_args(pooling))
        assert cpp.pooled(out, pooling).shape == (pt.config.hidden_size,)
        assert close(cpp.pooled(out, pooling), pt.pooled(ref, pooling)), pooling
        assert close(out.logits, ref.logits)


def test_layer_pools_come_from_the_prefill_itself_chunk_by_chunk(pair):
    """A layer's pool is read from the prompt's own forward (no extra decode), leaves its logits and the
    decoding after it unchanged bit for bit, and a prompt fed in chunks (a server's chunked prefill)
    pools to the same mean and last position as one forward."""
    cpp, _ = pair
    ids = torch.tensor(PROMPT)
    a, b, c = cpp.new_cache(32), cpp.new_cache(32), cpp.new_cache(32)
    plain = cpp.forward(ids, a, 0, logits="last").logits
    pooled = cpp.forward(ids, b, 0, logits="last", pool_layers=(1, 2))
    assert torch.equal(plain, pooled.logits) and set(pooled.layer_pools) == {1, 2}
    nxt = torch.tensor([int(plain.argmax())])
    assert torch.equal(cpp.forward(nxt, a, len(PROMPT)).logits, cpp.forward(nxt, b, len(PROMPT)).logits)
    first = cpp.forward(ids[:6], c, 0, logits="none", pool_layers=(1,)).layer_pools[1]
    rest = cpp.forward(ids[6:], c, 6, logits="last", pool_layers=(1,)).layer_pools[1]
    whole = pooled.layer_pools[1]
    assert close((6 * first[0] + (len(PROMPT) - 6) * rest[0]) / len(PROMPT), whole[0], 1e-4)
    assert close(rest[1], whole[1], 1e-4)


def test_layer_pools_of_a_prompt_longer_than_llama_cpp_s_micro_batch(long_gguf):
    """A forward of 700 tokens runs as two of llama.cpp's 512-token micro-batches: its layer rows are
    the whole batch's, in order (the same mean and last position as two forwards of 350)."""
    cpp = LlamaCppBackbone(long_gguf, threads=2, context=1200, sequences=2)
    assert cpp.max_positions == 1200
    ids = torch.tensor((PROMPT * 60)[:700])
    whole = cpp.forward(ids, cpp.new_cache(720), 0, logits="last", pool_layers=(1, 3)).layer_pools
    c = cpp.new_cache(720)
    first = cpp.forward(ids[:350], c, 0, logits="none", pool_layers=(1, 3)).layer_pools
    rest = cpp.forward(ids[350:], c, 350, logits="last", pool_layers=(1, 3)).layer_pools
    for layer in (1, 3):
        assert close((first[layer][0] + rest[layer][0]) / 2, whole[layer][0], 1e-3)
        assert close(rest[layer][1], whole[layer][1], 1e-3)


def test_without_layer_inputs_routing_falls_back_to_the_last_layer_once(tiny_gguf, monkeypatch, capsys):
    """A build of llama.cpp without the layer-input API (or a model whose graph gives no rows) routes on
    today's embedding, the final layer's last position, and says so once."""
    from adaptive.engine import llamacpp, llamacpp_host

    monkeypatch.setattr(llamacpp, "layer_input_api", lambda lib: None)
    monkeypatch.setattr(llamacpp_host, "_WARNED", set())
    cpp = LlamaCppBackbone(tiny_gguf[0], threads=1, context=64, sequences=1)
    assert not cpp.layer_pools
    for _ in range(2):
        assert cpp.routing_pooling(Pooling(1, "last")) == Pooling(None, "last")
    assert capsys.readouterr().err.count("routing on the final layer's last position") == 1
    with pytest.raises(ConfigError, match="--engine torch"):
        cpp.pool_args(Pooling(1, "last"))


def test_embedding_the_prompt_changes_nothing_of_its_decoding(pair):
    """Routing's prefill equals plain decoding's bit for bit (the embedding comes from a scratch
    sequence), so a routed request that decodes plainly gives exactly ``ar``'s tokens."""
    cpp, _ = pair
    ids = torch.tensor(PROMPT)
    a, b = cpp.new_cache(32), cpp.new_cache(32)
    plain = cpp.forward(ids, a, 0, logits="last").logits
    routed = cpp.forward(ids, b, 0, logits="last", **cpp.pool_args(Pooling(None, "last")))
    assert torch.equal(plain, routed.logits) and routed.pooled.shape == (cpp.hidden_size,)
    nxt = torch.tensor([int(plain.argmax())])
    assert torch.equal(cpp.forward(nxt, a, len(PROMPT)).logits, cpp.forward(nxt, b, len(PROMPT)).logits)


def test_a_verification_gives_the_rows_of_one_token_steps(pair):
    cpp, _ = pair
    cache = cpp.new_cache(32)
    cpp.forward(torch.tensor(PROMPT[:8]), cache, 0, logits="none")
    rows = cpp.forward(torch.tensor(PROMPT[8:13]), cache, 8, logits="all").logits  # [5, V]
    steps = cpp.new_cache(32)
    cpp.forward(torch.tensor(PROMPT[:8]), steps, 0, logits="none")
    one = torch.cat([cpp.forward(torch.tensor([t]), steps, 8 + j, logits="last").logits
                     for j, t in enumerate(PROMPT[8:13])])
    assert rows.shape == one.shape == (5, cpp.vocab_size)
    assert close(rows, one, 1e-3)
    assert torch.equal(rows.argmax(-1), one.argmax(-1))


def test_forward_argmax_is_the_argmax_of_the_logits_read_in_place(pair):
    cpp, _ = pair
    a, b = cpp.new_cache(32), cpp.new_cache(32)
    cpp.forward(torch.tensor(PROMPT[:8]), a, 0, logits="none")
    cpp.forward(torch.tensor(PROMPT[:8]), b, 0, logits="none")
    rows = cpp.forward(torch.tensor(PROMPT[8:13]), a, 8, logits="all").logits
    ids = cpp.forward_argmax(PROMPT[8:13], b, 8)
    assert ids == rows.argmax(-1).tolist() and all(type(t) is int for t in ids)
    assert b.written == 13
    with pytest.raises(PromptTooLongError):
        cpp.forward_argmax([1] * 30, b, 13)


def test_the_final_norm_is_read_from_the_file_and_a_bad_file_only_turns_layer_pools_off(pair, monkeypatch):
    import adaptive.engine.llamacpp as llamacpp
    from adaptive.engine.gguf_file import GGUFFormatError

    cpp, torch_bb = pair
    weight, eps = cpp.final_norm()
    assert torch.equal(weight, torch_bb.norm.weight.detach().float())  # the GGUF holds the torch model's own
    assert eps == pytest.approx(torch_bb.norm.variance_epsilon)

    def damaged(*a, **kw):
        raise GGUFFormatError("x.gguf: a damaged GGUF file")

    monkeypatch.setattr(llamacpp, "read_gguf", damaged)
    assert cpp.final_norm() == (weight, eps)  # read once
    monkeypatch.setattr(cpp, "_final_norm", None)  # as a backbone that had not read it yet
    assert cpp.final_norm() is None


def test_rolling_back_is_setting_the_length(pair):
    """A rejected draft's positions never reach a later forward: after writing 3 drafts and rolling
    back by assignment, a new token at the same position sees exactly a fresh cache's context."""
    cpp, _ = pair
    cache = cpp.new_cache(32)
    cpp.forward(torch.tensor(PROMPT[:6]), cache, 0, logits="none")
    cache.length = 6
    cpp.forward(torch.tensor([40, 41, 42]), cache, 6, logits="all")  # drafts, all rejected
    cache.length = 6
    after = cpp.forward(torch.tensor([7, 8]), cache, 6, logits="all").logits
    fresh = cpp.new_cache(32)
    cpp.forward(torch.tensor(PROMPT[:6]), fresh, 0, logits="none")
    assert torch.equal(after, cpp.forward(torch.tensor([7, 8]), fresh, 6, logits="all").logits)
    with pytest.raises(ValueError, match="holds 8 positions"):
        cpp.forward(torch.tensor([7]), cache, 9, logits="last")  # a gap: position 8 was never written


def test_several_sequences_verify_in_one_decode(pair):
    cpp, _ = pair
    caches = [cpp.new_cache(32), cpp.new_cache(32)]
    cpp.forward(torch.tensor(PROMPT[:7]), caches[0], 0, logits="none")
    cpp.forward(torch.tensor(PROMPT[3:13]), caches[1], 0, logits="none")
    batched = cpp.forward_batch([Segment(torch.tensor([3]), caches[0], 7),
                                 Segment(torch.tensor([4, 5, 6]), caches[1], 10)])
    assert [b.shape[0] for b in batched] == [1, 3]
    alone = []
    for ids, start, prompt in (([3], 7, PROMPT[:7]), ([4, 5, 6], 10, PROMPT[3:13])):
        c = cpp.new_cache(32)
        cpp.forward(torch.tensor(prompt), c, 0, logits="none")
        alone.append(cpp.forward(torch.tensor(ids), c, start, logits="all").logits)
    for b, a in zip(batched, alone):
        assert close(b, a, 1e-3)
        assert torch.equal(b.argmax(-1), a.argmax(-1))


@pytest.mark.parametrize("kind", ["pld", "cascade"])
def test_greedy_speculative_decoding_equals_plain_decoding(pair, kind):
    cpp, _ = pair
    cfg = GenerationConfig(max_new_tokens=40, draft_len=6)
    plain = decode_ids(cpp, PROMPT, cfg)
    stats = GenerationStats()
    drafter = build_drafter(DrafterSpec(kind), cpp)
    spec = decode_ids(cpp, PROMPT, cfg, drafter=drafter, stats=stats)
    assert spec == plain
    assert stats.accepted > 0 and stats.steps < len(plain) - 1  # drafts were verified and kept


def test_sessions_decoded_together_equal_each_alone(tiny_gguf):
    """A server's batch on llama.cpp: sessions joining a running batch (one llama_decode per step for
    all of them, ragged drafts) produce their lone greedy outputs."""
    lm = LoadedModel(None, char_tokenizer(), "tiny-gguf", str(tiny_gguf[0]), torch.device("cpu"), torch.float32,
                     engine="llama.cpp", threads=1)
    eng = Engine(lm)
    prompts = [PROMPT, PROMPT[3:] * 2, [9, 14, 22] * 5, PROMPT[:5]]
    kinds = ["pld", "ar", "cascade", "pld"]
    cfg = GenerationConfig(max_new_tokens=24, draft_len=5, ignore_eos=True)

    def drafter(kind):
        return None if kind == "ar" else build_drafter(DrafterSpec(kind), lm.backbone)

    alone = [eng.generate(p, cfg, drafter=drafter(k)).token_ids for p, k in zip(prompts, kinds)]
    running = {0: eng.begin(eng.start(prompts[0], cfg), drafter(kinds[0]))}
    out, waiting, sizes = {}, [1, 2, 3], []
    while running or waiting:
        if waiting:  # one more joins every step
            i = waiting.pop(0)
            running[i] = eng.begin(eng.start(prompts[i], cfg), drafter(kinds[i]))
        sizes.append(len(running))
        eng.step(list(running.values()))
        for i in [i for i, d in running.items() if d.done]:
            out[i] = running.pop(i).result().token_ids
    assert max(sizes) == 4
    assert [out[i] for i in range(4)] == alone


def test_a_separate_draft_model_drafts_for_llama_cpp(pair, tiny_gguf):
    """A draft model (a torch backbone of its own) proposes, llama.cpp verifies: greedy output equal to
    llama.cpp's plain decoding. The draft here is the target's own weights on torch, so it is accepted."""
    cpp, pt = pair
    cfg = GenerationConfig(max_new_tokens=30, draft_len=4)
    plain = decode_ids(cpp, PROMPT, cfg)
    stats = GenerationStats()
    drafter = build_drafter(DrafterSpec("draft-model", draft_backbone=pt), cpp)
    spec = decode_ids(cpp, PROMPT, cfg, drafter=drafter, stats=stats)
    assert spec == plain
    assert stats.accepted > stats.drafted // 2


def test_sequences_are_given_back_and_running_out_is_a_clear_error(tiny_gguf):
    cpp = LlamaCppBackbone(tiny_gguf[0], threads=1, context=64, sequences=2)
    a, b = cpp.new_cache(16), cpp.new_cache(16)
    with pytest.raises(ConfigError, match="all 2 llama.cpp sequences are in use"):
        cpp.new_cache(16)
    seq = a.seq
    del a
    c = cpp.new_cache(16)
    assert c.seq == seq and c.written == 0
    assert cpp.forward(torch.tensor(PROMPT[:4]), c, 0).logits.shape == (1, cpp.vocab_size)
    del b, c
    cpp.close()


def test_free_positions_are_the_context_less_what_live_caches_were_made_for(tiny_gguf):
    """The positions a new request can be sure of: each live cache holds what it was made for, given back
    when it is released or collected (a reference cycle: only a collection gives them back)."""
    cpp = LlamaCppBackbone(tiny_gguf[0], threads=1, context=64, sequences=4)
    assert cpp.free_positions() == 64
    a, b = cpp.new_cache(16), cpp.new_cache(30)
    assert cpp.free_positions() == 64 - 46
    a.release()
    assert cpp.free_positions() == 64 - 30
    b.cycle = b  # held by a reference cycle: not given back until collected
    del b
    assert cpp.free_positions() == 34 and not cpp.room_for(65)
    assert cpp.room_for(60) and cpp.free_positions() == 64  # room_for collected the cycle to find them
    c = cpp.new_cache(50)  # a cache that could overflow the context mid-request is refused at once
    with pytest.raises(ContextFullError, match="20 positions are needed and live requests leave 14"):
        cpp.new_cache(20)
    c.cycle = c
    del c
    assert cpp.new_cache(20).max_len == 20  # a collection gave the held positions back first
    cpp.close()


def test_a_context_is_never_beyond_the_models_and_only_llama_cpp_takes_one(tiny_gguf):
    from adaptive.models import LoadedModel

    path, torch_lm = tiny_gguf
    train = LlamaCppBackbone(path, threads=1).max_positions  # the tiny model's own (below 8192)
    assert LlamaCppBackbone(path, threads=1, context=train * 4).max_positions == train
    assert LlamaCppBackbone(path, threads=1, context=32).max_positions == 32
    with pytest.raises(ConfigError, match="torch engine sizes each request's cache"):
        LoadedModel(torch_lm.model, torch_lm.tokenizer, "t", "-", torch.device("cpu"), torch.float32, context=64)


def test_what_only_the_torch_engine_can_do_is_refused_clearly(pair):
    cpp, _ = pair
    cache = cpp.new_cache(32)
    skip = SkipSet.from_text("attn=1")
    with pytest.raises(ConfigError, match="--engine torch"):
        cpp.forward(torch.tensor([1, 2]), cache, 0, skip_masks=skip.masks(cpp.n_layers))
    with pytest.raises(ValueError, match="after layer 9 of a"):
        cpp.pool_args(Pooling(9, "last"))
    with pytest.raises(ConfigError, match="final layer at the last position only"):
        cpp.pool_args(Pooling(None, "mean"))  # llama.cpp has no layer after the last one to read the input of
    assert cpp.routing_pooling(Pooling(None, "mean")) == Pooling(None, "last")
    for spec in (DrafterSpec("ssd", skip=skip), DrafterSpec("cascade", skip=skip)):
        with pytest.raises(ConfigError, match="use --engine torch"):
            build_drafter(spec, cpp)
    with pytest.raises(PromptTooLongError, match="llama.cpp context is 256"):
        cpp.new_cache(300)
    with pytest.raises(PromptTooLongError, match="exceed the cache of 32"):
        cpp.forward(torch.arange(40), cache, 0)


def test_the_engine_decodes_text_on_llama_cpp(tiny_gguf):
    lm = LoadedModel(None, char_tokenizer(), "tiny-gguf", str(tiny_gguf[0]), torch.device("cpu"), torch.float32,
                     engine="llama.cpp", threads=1)
    assert lm.n_layers == tiny_gguf[1].n_layers and 2 in lm.eos_ids()
    fp = lm.fingerprint()
    assert fp.engine == "llama.cpp" and fp.model_type == "llama" and not fp.same_model(tiny_gguf[1].fingerprint())
    engine = Engine(lm)
    cfg = GenerationConfig(max_new_tokens=24)
    plain = engine.generate("abc abc abc abc", cfg)
    spec = engine.generate("abc abc abc abc", cfg, drafter=build_drafter(DrafterSpec("pld"), lm.backbone))
    assert plain.token_ids == spec.token_ids and plain.text == spec.text
    assert len(plain.token_ids) == 24 or plain.finish_reason == "eos"
    with pytest.raises(ConfigError, match="has no torch model"):
        LoadedModel(None, char_tokenizer(), "t", "x.gguf", torch.device("cpu"), torch.float32)


def test_layer_inputs_are_probed_once_per_architecture_in_a_child_process(tiny_gguf, tmp_path, monkeypatch):
    """llama.cpp aborts the process when a graph builder (Qwen2's) never records a layer's input: the
    first probe of an architecture runs in a child process, and its answer is kept."""
    import subprocess

    from adaptive.engine import llamacpp

    monkeypatch.setenv("ADAPTIVE_CACHE", str(tmp_path))
    path = tiny_gguf[0]
    assert llamacpp._layer_inputs_safe(path, "llama")  # a real child: the tiny Llama fills them
    kept = json.loads((tmp_path / "llama.cpp" / llamacpp.LAYER_INPUTS_FILE).read_text())
    assert list(kept.values()) == [True]

    def no_child(*a, **kw):
        raise AssertionError("asked again")

    monkeypatch.setattr(subprocess, "run", no_child)
    assert llamacpp._layer_inputs_safe(path, "llama")  # from the file
    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: subprocess.CompletedProcess(a, -6, "", "GGML_ASSERT"))
    assert not llamacpp._layer_inputs_safe(path, "qwen2")  # the child aborted: unsafe, and kept
    monkeypatch.setattr(subprocess, "run", no_child)
    assert not llamacpp._layer_inputs_safe(path, "qwen2")



@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_loading_drops_the_file_s_pages_and_decoding_reads_the_same_weights(tiny_gguf, monkeypatch):
    """After llama.cpp loads the file its mapped pages are dropped (those still in use refault from the
    page cache): the logits equal those of a backbone that kept them."""
    import adaptive.engine.llamacpp as llamacpp

    path, _ = tiny_gguf
    ids = torch.tensor(PROMPT)
    dropped = LlamaCppBackbone(path, threads=2, context=64, sequences=1)
    assert mapped_resident(path) == 0
    ours = dropped.forward(ids, dropped.new_cache(32), 0, logits="all").logits
    assert mapped_resident(path) > 0  # the weights llama.cpp reads from the file, read back
    dropped.close()
    monkeypatch.setattr(llamacpp, "release_mapped_file", lambda p: 0)
    kept = LlamaCppBackbone(path, threads=2, context=64, sequences=1)
    assert torch.equal(ours, kept.forward(ids, kept.new_cache(32), 0, logits="all").logits)
    kept.close()


def test_a_backbone_loads_without_extra_buffers_where_the_probe_said_no(tiny_gguf, monkeypatch):
    import llama_cpp

    path, _ = tiny_gguf
    ids = torch.tensor(PROMPT)
    seen = []
    load = llama_cpp.llama_model_load_from_file

    def spy(file, params):
        seen.append(bool(params.use_extra_bufts))
        return load(file, params)

    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", spy)
    logits = {}
    for ok in (True, False):
        monkeypatch.setattr(llamacpp, "extra_buffers_ok", lambda gguf, ok=ok: ok)
        cpp = LlamaCppBackbone(path, threads=2, context=64, sequences=1)
        logits[ok] = cpp.forward(ids, cpp.new_cache(32), 0, logits="all").logits
        cpp.close()
    assert seen == [True, False]
    assert torch.equal(logits[True], logits[False])  # the tiny file's F32 weights have no other layout
