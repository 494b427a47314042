"""Weight-only quantization: literal worked examples, the kernels against their dequantized weights,
greedy equality with plain decoding on the same weights, and clear errors."""

import os
import random
import subprocess
import sys

import pytest
import torch

from adaptive.drafters.factory import DrafterSpec, build_drafter
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.engine.quant import (
    DENSE_ROWS,
    Linear,
    check_weights,
    dequantize_int4,
    packing_supported,
    quantize_int4,
    quantize_int8,
    resolve_weights,
)
from adaptive.engine.skip import SkipSet
from adaptive.errors import ConfigError
from adaptive.models import LoadedModel
from tests.conftest import char_tokenizer, tiny_model


def quantized_lm(weights: str, family: str = "llama", **kw) -> LoadedModel:
    model = tiny_model(family, **kw)
    return LoadedModel(model, char_tokenizer(), f"tiny-{family}", "in-process", torch.device("cpu"), torch.float32,
                       weights)


def test_int8_worked_example():
    q, scales = quantize_int8(torch.tensor([[0.5, -1.0, 0.25]]))
    assert q.tolist() == [[64, -127, 32]]
    assert scales.float().item() == pytest.approx(1 / 127, rel=1e-2)


def test_int4_recovers_a_q4_1_block_exactly():
    # a block of 32 on Q4_1's grid (scale d, minimum m, codes 0..15 including both ends)
    d, m = 0.125, -1.0
    codes = torch.tensor([0, 15] + [random.Random(0).randrange(16) for _ in range(30)], dtype=torch.float32)
    w = (m + d * codes).reshape(1, 32).repeat(16, 1)
    q, sz = quantize_int4(w)
    assert torch.equal(q[0], codes.to(torch.int32))
    assert torch.equal(dequantize_int4(q, sz), w)


def test_int4_needs_whole_groups():
    with pytest.raises(ConfigError, match="divisible by 32"):
        quantize_int4(torch.randn(16, 48))


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_kernel_multiplies_by_the_rounded_weights(mode, rows):
    torch.manual_seed(0)
    w = torch.randn(40, 64)  # 40 rows: int4 pads them to 48 and cuts the output back
    original = w.clone()
    lin = Linear.build(w, torch.randn(40), mode)
    assert not torch.equal(w, original)  # rounded in place: the model now holds the quantized values
    assert (w - original).abs().max() < (0.02 if mode == "int8" else 0.3)
    x = torch.randn(rows, 64)
    y = lin(x)
    assert y.shape == (rows, 40) and y.dtype == torch.float32
    ref = x @ w.T + lin.bias  # the same weights, dense, in float32
    assert torch.allclose(y, ref, atol=0.1, rtol=0.02)  # the kernel's activations are bf16
    assert lin.nbytes < w.numel() * 4 / (3.5 if mode == "int8" else 5)  # int4 here: 8 rows of padding


def test_long_inputs_use_the_rounded_dense_weights():
    w = torch.randn(32, 64)
    lin = Linear.build(w, None, "int8")
    x = torch.randn(DENSE_ROWS, 64)
    assert torch.equal(lin(x), x @ w.T)  # exactly F.linear on the rounded weights


def test_dense_is_f_linear():
    w, b = torch.randn(8, 16), torch.randn(8)
    x = torch.randn(2, 16)
    assert torch.equal(Linear.build(w, b)(x), torch.nn.functional.linear(x, w, b))


needs_packing = pytest.mark.skipif(not packing_supported(torch.float32), reason="PyTorch without oneDNN")


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 9, DENSE_ROWS + 3])
def test_packed_multiplies_as_f_linear(dtype, rows):
    if not packing_supported(dtype):
        pytest.skip(f"oneDNN computes no {dtype} on this CPU")
    torch.manual_seed(0)
    w, b = torch.randn(40, 64, dtype=dtype), torch.randn(40, dtype=dtype)
    original = w.clone()
    lin = Linear.build(w, b, "packed")
    assert torch.equal(w, original) and lin.dense is None  # nothing rounded; the layer keeps only its packed copy
    assert torch.equal(lin.plain(), w)  # unpacked exactly
    x = torch.randn(rows, 64, dtype=dtype)
    y = lin(x)
    assert y.shape == (rows, 40) and y.dtype == dtype
    assert torch.allclose(y.float(), torch.nn.functional.linear(x, w, b).float(), atol=1e-5 if dtype == torch.float32
                          else 0.05, rtol=1e-4 if dtype == torch.float32 else 0.02)


@needs_packing
def test_packed_products_of_few_rows_are_padded_without_changing_the_real_rows():
    torch.manual_seed(1)
    lin = Linear.build(torch.randn(24, 32), torch.randn(24), "packed")
    lin.rows = 6  # as packed_rows() finds it on the reference host's bf16 (fp32 there: 1)
    x = torch.randn(2, 32)
    y = lin(x)
    assert y.shape == (2, 24)
    for _ in range(3):  # whatever fills the other rows of the kernel's block, the real rows are the same
        other = torch.cat([x, torch.randn(4, 32)])
        assert torch.equal(lin(other)[:2], y)
    assert torch.allclose(y, torch.nn.functional.linear(x, lin.plain(), lin.bias), atol=1e-5, rtol=1e-4)
    assert lin(torch.randn(9, 32)).shape == (9, 24)  # more rows than the block: not padded


def test_packed_rows_is_a_candidate_or_one():
    from adaptive.engine.quant import PACKED_ROW_CANDIDATES, packed_rows

    if not packing_supported(torch.float32):
        pytest.skip("PyTorch without oneDNN")
    assert packed_rows(torch.float32) in (1, *PACKED_ROW_CANDIDATES)


@needs_packing
def test_packed_backbone_computes_the_dense_logits_and_holds_one_copy():
    dense, packed = quantized_lm("dense", "qwen2"), quantized_lm("packed", "qwen2")
    assert packed.fingerprint().same_model(dense.fingerprint())
    bb, ref = packed.backbone, dense.backbone
    assert bb.weight_mode == "packed" and bb.numerics == torch.float32
    # the Hugging Face layer modules' own weights are released: the packed copies are the only ones
    attn = packed.model.model.layers[0].self_attn
    assert attn.q_proj.weight.numel() == 0 and packed.model.model.layers[0].mlp.down_proj.weight.numel() == 0
    assert attn.q_proj.bias.numel() > 0  # biases stay (the fused bias is the layer's)
    ids = torch.tensor([5, 9, 2, 7, 11, 3])
    a = bb.forward(ids, bb.new_cache(8), 0, logits="all").logits
    b = ref.forward(ids, ref.new_cache(8), 0, logits="all").logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    for key in ("gate", "up", "down"):  # what an early-exit block starts from: the same weights either way
        assert torch.equal(bb.mlp_weights(1)[key], ref.mlp_weights(1)[key])
    prompt = torch.tensor([[5, 9, 2, 7]])
    want = dense.model.generate(prompt, max_new_tokens=5, do_sample=False)
    with bb.module_weights():  # Hugging Face's generate runs on the unpacked weights, then they go again
        assert torch.equal(packed.model.generate(prompt, max_new_tokens=5, do_sample=False), want)
    assert attn.q_proj.weight.numel() == 0


def test_weights_auto_is_packed_where_onednn_runs_the_dtype(monkeypatch):
    from adaptive.engine import quant

    cpu = torch.device("cpu")
    monkeypatch.setattr(quant, "packing_supported", lambda dtype: dtype == torch.float32)
    assert resolve_weights("auto", cpu, torch.float32) == "packed"
    assert resolve_weights("auto", cpu, torch.bfloat16) == "dense"  # e.g. an AVX2-only host
    assert resolve_weights("auto", torch.device("cuda"), torch.float32) == "dense"
    assert resolve_weights("int4", cpu, torch.bfloat16) == "int4"
    with pytest.raises(ConfigError, match="use --weights dense"):
        resolve_weights("packed", cpu, torch.bfloat16)
    with pytest.raises(ConfigError, match="oneDNN kernels for bfloat16 .* use --weights dense"):
        Linear.build(torch.randn(8, 16, dtype=torch.bfloat16), None, "packed")  # a model built without load_model
    with pytest.raises(ConfigError, match="CPU kernels"):
        resolve_weights("packed", torch.device("cuda"), torch.float32)


@pytest.mark.parametrize("mode", ["int8", "int4", pytest.param("packed", marks=needs_packing)])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_speculation_equals_plain_decoding_on_the_same_weights(mode, family):
    lm = quantized_lm(mode, family, n_layers=6)
    eng = Engine(lm)
    rng = random.Random(7)
    V = lm.model.config.vocab_size
    for prompt_len in (3, 20):
        prompt = [rng.randrange(3, V) for _ in range(prompt_len)]
        ref = eng.generate(prompt, GenerationConfig(max_new_tokens=24, ignore_eos=True)).token_ids
        assert len(set(ref)) > 3
        for spec in (DrafterSpec("ssd", skip=SkipSet((1, 3), (2,))), DrafterSpec("pld")):
            for k in (1, 3, 6):
                cfg = GenerationConfig(max_new_tokens=24, draft_len=k, ignore_eos=True)
                out = eng.generate(prompt, cfg, drafter=build_drafter(spec, lm.backbone)).token_ids
                assert out == ref, (mode, family, prompt_len, spec.kind, k)


def test_quantizing_keeps_the_dense_fingerprint():
    dense = quantized_lm("dense")
    q = quantized_lm("int8")
    assert q.backbone.weight_mode == "int8"
    assert q.fingerprint().same_model(dense.fingerprint())


def test_weight_mode_errors():
    with pytest.raises(ConfigError, match="unknown weights 'int3'"):
        check_weights("int3", torch.device("cpu"))
    with pytest.raises(ConfigError, match="CPU kernels"):
        check_weights("int8", torch.device("cuda"))
    assert check_weights("dense", torch.device("cuda")) == "dense"


def test_quantized_weights_are_audited_at_bf16_tolerance():
    from adaptive.engine.audit import MARGIN_TOLERANCE, audit_divergence

    lm = quantized_lm("int8")
    assert lm.backbone.numerics == torch.bfloat16 and quantized_lm("dense").backbone.numerics == torch.float32
    prompt = [5, 6, 7, 8]
    ref = Engine(lm).generate(prompt, GenerationConfig(max_new_tokens=6, ignore_eos=True)).token_ids
    other = ref[:3] + [(ref[3] + 1) % lm.model.config.vocab_size] + ref[4:]
    a = audit_divergence(lm.backbone, prompt, ref, other)
    assert a.position == 3 and a.tolerance == MARGIN_TOLERANCE[torch.bfloat16]


def test_product_caches_are_bounded_unless_the_environment_says_otherwise(monkeypatch):
    from adaptive.engine.quant import PRODUCT_CACHE_ENTRIES, PRODUCT_CACHE_VARIABLES, bound_product_caches

    for var in PRODUCT_CACHE_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")  # the user's choice stands
    bound_product_caches()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(PRODUCT_CACHE_ENTRIES)
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"


_GROWTH = """
import sys, torch
from adaptive.engine.quant import Linear
def rss():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS')) / 1024
lin = Linear.build(torch.randn(256, 128), None, "packed")  # bounds the caches before its first product
lin(torch.randn(1, 128))
before = rss()
with torch.inference_mode():
    for m in range(2, 402):
        lin(torch.randn(m, 128))
print(rss() - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not packing_supported(torch.float32) or not os.path.exists("/proc/self/status"),
                    reason="needs oneDNN's packed kernels and /proc")
def test_a_process_making_products_of_many_row_counts_stays_bounded():
    """400 row counts: with the libraries' default capacities (1,024 each) every product is kept; with
    the bound, at most 128 of each."""
    def growth(**env) -> float:
        out = subprocess.run([sys.executable, "-c", _GROWTH], env={**os.environ, **env}, capture_output=True,
                             text=True, check=True)
        return float(out.stdout.strip().splitlines()[-1])

    bounded = growth()
    unbounded = growth(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024", LRU_CACHE_CAPACITY="1024")
    if unbounded < 40:
        pytest.skip(f"products kept here cost too little memory to tell apart ({unbounded:.0f} MiB for 400)")
    assert bounded < 0.6 * unbounded, (bounded, unbounded)
