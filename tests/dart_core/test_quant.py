"""GGUF-native 4-bit weights: GGUF blocks -> the kernels' layouts (dart-serve's qmm-a8 and qmm, PyTorch's CPU int4)
-> the same de-quantised values, on a tiny GGUF written here; a verification forward computes each row
as a one-row forward does, so greedy DART on the 4-bit target equals its autoregressive output, with
either kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from dart_core.step.engine import DartEngine
from dart_core.step.sampling import SamplingParams
from dart_core.model.target import TargetModel

from .conftest import VOCAB, OracleTreeSearch, tiny_config, tiny_target
from .test_engine import prompts_of, random_head, run_with_a_late_join

gguf = pytest.importorskip("gguf")
from dart_core.model.quant import (GGUFWeightsError, Int4Linear, KERNELS, can_int4, default_kernel,  # noqa: E402
                             int4_parts, q8_0_kernel, quantize_from_gguf, quantize_linears)

pytestmark = pytest.mark.skipif(not can_int4(), reason="this PyTorch has no CPU int4 kernel")

Q = gguf.GGMLQuantizationType


def _blocks(values: np.ndarray, qtype) -> np.ndarray:
    return gguf.quants.quantize(values.astype(np.float32), qtype)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_parts_reproduce_the_gguf_values(qtype):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(48, 96)).astype(np.float32) * rng.uniform(0.01, 3, size=(48, 1)).astype(np.float32)
    raw = _blocks(w, Q[qtype])
    expected = gguf.quants.dequantize(raw, Q[qtype])
    parts = int4_parts(raw, qtype, w.shape)
    assert len(parts) == (2 if qtype == "Q8_0" else 1)
    assert all(c.min() >= 0 and c.max() <= 15 for c, _, _ in parts)
    values = sum((c - 8) * np.repeat(s, 32, 1) + np.repeat(z, 32, 1) for c, s, z in parts)
    np.testing.assert_allclose(values, expected, rtol=1e-6, atol=1e-7)
    x = torch.from_numpy(rng.normal(size=(5, 96)).astype(np.float32))
    # qmm: the GGUF's values (Q4_1's fma(q, d, m) may round once where numpy rounds twice), float32 sums
    exact = Int4Linear(parts, gguf_type=qtype, kernel="qmm")
    assert exact.kernel == "qmm" and exact.compute_dtype == torch.float32
    np.testing.assert_allclose(exact.weight.numpy(), expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(exact(x).numpy(), x.numpy() @ expected.T, rtol=1e-5, atol=1e-5)
    # qmm-a8: the GGUF's values, activations rounded to 8 bits per block of 32 (llama.cpp's arithmetic)
    a8 = Int4Linear(parts, gguf_type=qtype, kernel="qmm-a8")
    assert a8.kernel == "qmm-a8" and a8.compute_dtype == torch.float32
    np.testing.assert_array_equal(a8.weight.numpy(), expected)
    groups = x.numpy().reshape(5, 3, 32)
    step = np.abs(groups).max(-1, keepdims=True) / np.float32(127)
    x8 = (np.rint(groups / step) * step).reshape(5, 96)  # the activations as the kernel rounds them
    np.testing.assert_allclose(a8(x).numpy(), x8 @ expected.T, rtol=1e-4, atol=1e-4)
    assert not np.allclose(a8(x).numpy(), x.numpy() @ expected.T, rtol=1e-5, atol=1e-5)
    # PyTorch's kernel: float32 activations see the GGUF's values, bfloat16 ones their rounding
    aten = Int4Linear(parts, torch.float32, qtype, kernel="aten")
    np.testing.assert_allclose(aten.weight.numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(aten(x).numpy(), x.numpy() @ expected.T, rtol=1e-4, atol=1e-4)
    fast = Int4Linear(parts, torch.bfloat16, qtype)
    assert fast.kernel == "aten" and fast(x).dtype == torch.float32
    rel = (fast.weight - torch.from_numpy(expected)).abs().max() / np.abs(expected).max()
    assert rel < 2 ** -6  # scales and zeros rounded to bfloat16


@pytest.mark.parametrize("a8, avx512, expected, head_kernel", [
    (True, True, "qmm-a8", "qmm"),  # AVX-512 VNNI
    (True, False, "qmm-a8", "qmm-a8"),  # AVX2 without AVX-512
    (False, True, "qmm", "qmm"),  # a build whose qmm-a8 has no vectorised loop
    (False, False, "aten", None)])
def test_the_default_kernel_follows_the_cpu(monkeypatch, a8, avx512, expected, head_kernel):
    """``gguf_kernel: auto``: qmm-a8 where it runs vectorised (AVX-512 VNNI or AVX2: the cheapest
    further query token), else qmm with AVX-512, else aten; the draft head's Q8_0 layers run the
    float32 qmm kernel where it runs its AVX-512 code, else qmm-a8's AVX2 loop, and are refused
    where only portable loops run."""
    from dart_core.model import quant

    monkeypatch.setattr(quant._kernels, "qmm_a8_vectorised", lambda: a8)
    monkeypatch.setattr(quant._kernels, "qmm_vectorised", lambda: avx512)
    assert quant.default_kernel() == expected
    assert quant.default_compute_dtype() == (torch.bfloat16 if expected == "aten" else torch.float32)
    assert quant.q8_0_kernel() == head_kernel
    head = torch.nn.Sequential(torch.nn.Linear(64, 16, bias=False))
    if head_kernel:
        assert quantize_linears(head) == 1 and head[0].kernel == head_kernel
    else:
        with pytest.raises(ValueError, match="AVX-512 .*or AVX2"):
            quantize_linears(head)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_row_does_not_depend_on_the_other_rows(kernel):
    """What makes tree verification exact on the 4-bit target: the kernel computes each input row alike
    whatever the number of rows in the call (1 for an autoregressive step, n for a tree; qmm changes
    its code path at 2 and at 9 rows)."""
    rng = np.random.default_rng(1)
    for qtype in ("Q4_1", "Q8_0"):
        raw = _blocks(rng.normal(size=(160, 128)), Q[qtype])
        layer = Int4Linear(int4_parts(raw, qtype, (160, 128)), kernel=kernel)
        x = torch.from_numpy(rng.normal(size=(19, 128)).astype(np.float32))
        alone = torch.cat([layer(x[i:i + 1]) for i in range(19)])
        for m in (2, 3, 4, 5, 8, 9, 13, 16, 19):
            assert torch.equal(layer(x[:m]), alone[:m]), (qtype, m)


def _qmm_loops(kernel: str) -> list[str]:
    """The vectorised loops of a qmm kernel this CPU runs (each in turn, for the equality tests)."""
    from dart_core import _kernels

    if kernel == "qmm":
        return ["avx512"] if _kernels.qmm_vectorised() else []
    loops = [isa for enabled in (True, False) if (isa := _kernels.set_qmm_a8_avx512(enabled)) != "portable"]
    _kernels.set_qmm_a8_avx512(True)
    return sorted(set(loops))


@pytest.mark.parametrize("kernel, loop", [("qmm", "avx512"), ("qmm-a8", "avx512-vnni"), ("qmm-a8", "avx2")])
def test_qmm_portable_loops_equal_their_vectorised_versions(kernel, loop):
    """The qmm kernels' vectorised code (qmm: AVX-512; qmm-a8: AVX-512 VNNI, and AVX2, which an
    AVX-512 CPU runs too when told to) and their portable loops do the same operations in the same
    order: the same bits (the portable loop is what a CPU without the instructions would run)."""
    from dart_core import _kernels

    function = {"qmm": _kernels.qmm, "qmm-a8": _kernels.qmm_a8}[kernel]
    if loop not in _qmm_loops(kernel):
        pytest.skip(f"this CPU lacks {kernel}'s {loop} instructions")
    if kernel == "qmm-a8":
        assert _kernels.set_qmm_a8_avx512(loop == "avx512-vnni") == loop
    try:
        _portable_equals_vectorised(function, getattr(_kernels, function.__name__ + "_argmax"), kernel)
    finally:
        _kernels.set_qmm_a8_avx512(True)


def _portable_equals_vectorised(function, argmax, kernel: str) -> None:
    rng = np.random.default_rng(6)
    for qtype, n in (("Q4_0", 200), ("Q4_1", 64), ("Q8_0", 130)):  # output sizes off and on a 64-row block
        layer = Int4Linear(int4_parts(_blocks(rng.normal(size=(n, 96)), Q[qtype]), qtype, (n, 96)), kernel=kernel)
        codes, scale, minimum = layer._qmm_args
        for m in (1, 2, 3, 12):
            x = (rng.normal(size=(m, 96)) * np.array([0.01, 1, 50])[np.arange(m) % 3, None]).astype(np.float32)
            x[0, :32] = 0  # a block of zeros: scale 0
            fast, slow = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
            function(x, codes, scale, minimum, n, layer.q8, fast)
            function(x, codes, scale, minimum, n, layer.q8, slow, portable=True)
            assert np.array_equal(fast, slow), (qtype, m)
            best = np.empty(m, np.int64)
            argmax(x, codes, scale, minimum, n, layer.q8, best)
            assert np.array_equal(best, slow.argmax(axis=1)), (qtype, m)
            # with a decoder layer's operations around the product: RMS norm, SiLU-and-multiply, residual add
            norm, gate_up = rng.normal(size=96).astype(np.float32), rng.normal(size=(m, 192)).astype(np.float32)
            for kwargs, inp in ((dict(norm=norm, eps=1e-5), x), (dict(gated=True, accumulate=True), gate_up)):
                fast2, slow2 = fast.copy(), fast.copy()
                function(inp, codes, scale, minimum, n, layer.q8, fast2, **kwargs)
                function(inp, codes, scale, minimum, n, layer.q8, slow2, portable=True, **kwargs)
                assert np.array_equal(fast2, slow2), (qtype, m, kwargs)


def test_qmm_a8_amx_equals_its_vnni_loop():
    """qmm-a8's AMX version (calls of enough rows on a CPU with AMX-INT8) sums each group exactly in
    tiles and scales it in the VNNI loop's order: the same bits as that loop and the portable one, for
    every row count across its 16-row tiles (here from one row up), both block types, the decoder
    layer's operations around the product and the fused argmax."""
    from dart_core import _kernels

    assert _kernels.set_qmm_a8_amx(False) is False and _kernels.qmm_a8_amx() is False
    usable = _kernels.set_qmm_a8_amx(True)
    assert usable == _kernels.qmm_a8_amx()
    if not usable:
        pytest.skip("this CPU (or its kernel) offers no AMX-INT8 tiles: only the VNNI and portable loops run here")
    rng = np.random.default_rng(11)
    try:
        for qtype, n, k in (("Q4_0", 200, 96), ("Q4_1", 64, 128), ("Q8_0", 130, 96)):
            layer = Int4Linear(int4_parts(_blocks(rng.normal(size=(n, k)), Q[qtype]), qtype, (n, k)), kernel="qmm-a8")
            codes, scale, minimum = layer._qmm_args
            norm = rng.normal(size=k).astype(np.float32)
            for m in (1, 2, 7, 15, 16, 17, 33):
                x = rng.normal(size=(m, k)).astype(np.float32)
                x[-1, 32:64] = 0  # a group of zeros: scale 0
                gate_up = rng.normal(size=(m, 2 * k)).astype(np.float32)
                base = rng.normal(size=(m, n)).astype(np.float32)
                for kwargs, inp in (({}, x), (dict(norm=norm, eps=1e-5), x), (dict(gated=True, accumulate=True), gate_up)):
                    outs = []
                    for amx in (True, False):
                        _kernels.set_qmm_a8_amx(amx, 1, 1)
                        out = base.copy()
                        _kernels.qmm_a8(inp, codes, scale, minimum, n, layer.q8, out, **kwargs)
                        outs.append(out)
                    slow = base.copy()
                    _kernels.qmm_a8(inp, codes, scale, minimum, n, layer.q8, slow, portable=True, **kwargs)
                    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], slow), (qtype, m, kwargs)
                picks = []
                for amx in (True, False):
                    _kernels.set_qmm_a8_amx(amx, 1, 1)
                    idx = np.empty(m, np.int64)
                    _kernels.qmm_a8_argmax(x, codes, scale, minimum, n, layer.q8, idx)
                    picks.append(idx)
                assert np.array_equal(picks[0], picks[1]), (qtype, m)
    finally:
        _kernels.set_qmm_a8_amx(True)  # the defaults again


@pytest.mark.parametrize("kernel", ["qmm-a8", "qmm"])
def test_the_fused_argmax_is_the_argmax_of_the_outputs(kernel):
    """Int4Linear.argmax (the outputs folded block by block, never written) against torch.argmax of the
    layer's own outputs: output sizes on and off a 64-column block, 1 to 40 rows (thread splits of the
    blocks), a tie across blocks (the first wins), with qmm rows of NaN and -inf outputs (the first
    NaN), the portable loop, and real_rows (the rows not selected get 0)."""
    from dart_core import _kernels
    from dart_core.model.rows import real_rows

    rng = np.random.default_rng(12)
    function = {"qmm": _kernels.qmm_argmax, "qmm-a8": _kernels.qmm_a8_argmax}[kernel]
    for qtype, n in (("Q4_0", 200), ("Q4_1", 4100), ("Q8_0", 130)):
        w = rng.normal(size=(n, 96)).astype(np.float32)
        w[n - 3] = w[5]  # the same row twice: equal outputs in columns 5 and n - 3
        layer = Int4Linear(int4_parts(_blocks(w, Q[qtype]), qtype, (n, 96)), kernel=kernel)
        codes, scale, minimum = layer._qmm_args
        for m in (1, 3, 7, 17, 40):
            x = torch.from_numpy(rng.normal(size=(m, 96)).astype(np.float32))
            x[0] = torch.from_numpy(w[5]) * 4  # column 5 wins, tied with column n - 3
            if m > 2 and kernel == "qmm":  # float32 activations carry NaN and -inf into the outputs
                x[1, 7] = float("nan")  # every output NaN
                x[2] = float("-inf")  # -inf and NaN outputs
            full = layer(x)
            got = layer.argmax(x)
            assert torch.equal(got, full.argmax(-1)), (qtype, m)
            assert int(got[0]) == 5
            slow = np.empty(m, np.int64)
            function(x.numpy(), codes, scale, minimum, n, layer.q8, slow, portable=True)
            assert np.array_equal(slow, got.numpy()), (qtype, m)
        x = torch.from_numpy(rng.normal(size=(6, 96)).astype(np.float32))
        with real_rows(torch.tensor([1, 4]), 6):
            part = layer.argmax(x.view(2, 3, 96))
        assert part.shape == (2, 3) and part.view(-1)[[0, 2, 3, 5]].tolist() == [0, 0, 0, 0]
        assert part.view(-1)[[1, 4]].tolist() == layer(x[[1, 4]]).argmax(-1).tolist()
    with pytest.raises(ValueError, match=r"\[M\] int64"):
        function(x.numpy(), codes, scale, minimum, n, layer.q8, np.empty(6, np.int32))
    aten = Int4Linear(int4_parts(_blocks(w[:128], Q.Q4_1), "Q4_1", (128, 96)), kernel="aten")
    with pytest.raises(ValueError, match="argmax runs the qmm kernels"):
        aten.argmax(x)


@pytest.mark.parametrize("kernel", ["qmm-a8", "qmm"])
def test_fused_into_applies_the_decoder_layer_operations(kernel):
    """fused_into's RMS norm, SiLU-and-multiply and residual add are transformers' LlamaRMSNorm, SiLU times
    up and x + y, to float32 rounding (and, with qmm-a8, the 8-bit rounding of the activations)."""
    rng = np.random.default_rng(8)
    layer = Int4Linear(int4_parts(_blocks(rng.normal(size=(128, 64)), Q.Q4_1), "Q4_1", (128, 64)), kernel=kernel)
    torch.manual_seed(8)  # inputs of their own, whatever ran before in the process
    x, residual = torch.randn(5, 64), torch.randn(5, 128)
    norm = torch.rand(64) + 0.5
    # float32: the kernel's sum of squares and products run in an order of their own, so its outputs
    # differ from PyTorch's by rounding, not bit for bit
    tol = dict(rtol=0.05, atol=0.05) if kernel == "qmm-a8" else dict(rtol=1e-5, atol=5e-5)
    normed = norm * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(layer.fused_into(x, torch.empty(5, 128), norm, 1e-6), layer(normed), **tol)
    gate_up = torch.randn(5, 128)
    expected = residual + layer(torch.nn.functional.silu(gate_up[:, :64]) * gate_up[:, 64:])
    torch.testing.assert_close(layer.fused_into(gate_up, residual.clone(), gated=True, accumulate=True), expected,
                               **tol)


@pytest.mark.parametrize("kernel", ["qmm-a8", "qmm"])
def test_qmm_refuses_arrays_of_the_wrong_shape(kernel):
    from dart_core import _kernels

    function = _kernels.qmm_a8 if kernel == "qmm-a8" else _kernels.qmm
    rng = np.random.default_rng(7)
    layer = Int4Linear(int4_parts(_blocks(rng.normal(size=(64, 64)), Q.Q4_1), "Q4_1", (64, 64)), kernel=kernel)
    codes, scale, minimum = layer._qmm_args
    x, out = np.zeros((2, 64), np.float32), np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="codes must be"):
        function(x, codes[:, :1], scale, minimum, 64, False, out)
    with pytest.raises(ValueError, match="need their minimums"):
        function(x, codes, scale, None, 64, False, out)
    with pytest.raises(ValueError, match="out must be"):
        function(x, codes, scale, minimum, 64, False, np.zeros((3, 64), np.float32))
    with pytest.raises(ValueError, match="K a positive multiple of 32"):
        function(np.zeros((2, 48), np.float32), codes, scale, minimum, 64, False, out)
    with pytest.raises(ValueError, match="takes float32 activations"):
        Int4Linear(int4_parts(_blocks(rng.normal(size=(64, 64)), Q.Q4_1), "Q4_1", (64, 64)), torch.bfloat16,
                   kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_4bit_layer_computes_only_the_real_rows(kernel):
    """Inside real_rows (a padded batch of draft trees) only the selected rows are computed, each equal
    to its row outside the block; the padding rows are zero; another row count is computed in full."""
    from dart_core.model.rows import real_rows

    rng = np.random.default_rng(2)
    layer = Int4Linear(int4_parts(_blocks(rng.normal(size=(64, 96)), Q.Q8_0), "Q8_0", (64, 96)),  # two parts
                       kernel=kernel)
    x = torch.from_numpy(rng.normal(size=(2, 3, 96)).astype(np.float32))
    full = layer(x)
    assert full.shape == (2, 3, 64)
    rows, z = torch.tensor([0, 1, 3]), torch.randn(7, 96)
    with real_rows(rows, 6):
        part, other = layer(x), layer(z)
    assert torch.equal(part.view(6, 64)[rows], full.view(6, 64)[rows])
    assert part.view(6, 64)[[2, 4, 5]].abs().max() == 0
    assert torch.equal(other, layer(z))


def test_bad_blocks_raise_named_errors():
    raw = _blocks(np.ones((4, 64)), Q.Q4_1)
    with pytest.raises(GGUFWeightsError, match="needs 160 bytes"):
        int4_parts(raw[:, :-1], "Q4_1", (4, 64))
    with pytest.raises(GGUFWeightsError, match="no 4-bit layout"):
        int4_parts(raw, "Q5_K", (4, 64))
    with pytest.raises(GGUFWeightsError, match="multiple of the block length"):
        int4_parts(raw, "Q4_1", (5, 48))


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (transformers undoes it on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_gguf_model(path, tied: bool = True, seed: int = 0, **config_overrides):
    """A tiny Llama written as a GGUF (Q4_1 linear layers, a Q8_0 token embedding tied to the output, or
    a Q4_0 output), and the model holding the file's de-quantised weights, as transformers loads it."""
    config = tiny_config("llama")
    config.tie_word_embeddings = tied
    for k, v in config_overrides.items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), "llama")
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}

    def put(name: str, param: torch.Tensor, qtype, scale: float = 1.0) -> None:
        w = param.detach().numpy() * scale
        head = next((n for k, n in heads.items() if name.endswith(k)), None)
        stored = _permute(w, head) if head else w
        raw = _blocks(stored, qtype)
        writer.add_tensor(f"{names.get_name(name)}.weight", raw, raw_dtype=qtype)
        values = gguf.quants.dequantize(raw, qtype)
        with torch.no_grad():
            param.copy_(torch.from_numpy(_unpermute(values, head) if head else values))

    put("model.embed_tokens", model.model.embed_tokens.weight, Q.Q8_0, scale=8.0)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            put(name, module.weight, Q.Q4_1)
    if not tied:
        put("lm_head", model.lm_head.weight, Q.Q4_0, scale=8.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_conversion_from_a_gguf_file_keeps_every_layer_value(tmp_path, tied):
    model = tiny_gguf_model(tmp_path / "tiny.gguf", tied=tied)
    before = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    replaced = quantize_from_gguf(model, tmp_path / "tiny.gguf", compute_dtype=torch.float32)
    layers = model.config.num_hidden_layers
    assert len(replaced) == 7 * layers + 1 and replaced["lm_head"] == ("Q8_0" if tied else "Q4_0")
    assert sum(v == "Q4_1" for v in replaced.values()) == 7 * layers
    for name, weight in before.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, Int4Linear)
        torch.testing.assert_close(layer.weight, weight, rtol=1e-5, atol=1e-6)  # q/k rows in the model's order
    from dart_core.bench.step_profile import weights_format
    from dart_core.model.quant import default_kernel

    # what the step profile's report calls these weights (not the float32 of the remaining parameters)
    assert weights_format(model) == ("4-bit GGUF Q4_1+Q8_0" if tied else "4-bit GGUF Q4_0+Q4_1") + \
        f", {default_kernel()} kernel"


def test_blocks_of_another_model_are_refused(tmp_path):
    tiny_gguf_model(tmp_path / "a.gguf", seed=0)
    other = tiny_gguf_model(tmp_path / "b.gguf", seed=1)
    with pytest.raises(GGUFWeightsError, match="do not de-quantise to the loaded model's weights"):
        quantize_from_gguf(other, tmp_path / "a.gguf")
    (tmp_path / "c.gguf").write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(GGUFWeightsError, match="not a readable GGUF"):
        quantize_from_gguf(other, tmp_path / "c.gguf")


@pytest.mark.parametrize("kernel", KERNELS)
def test_greedy_dart_on_the_4bit_target_equals_its_autoregressive_output(tmp_path, kernel):
    model = tiny_gguf_model(tmp_path / "tiny.gguf")
    quantize_from_gguf(model, tmp_path / "tiny.gguf", kernel=kernel)  # aten: bfloat16 activations
    target = TargetModel(model)
    assert target.packed  # verification computes only the real rows
    rng = np.random.default_rng(3)
    prompts = prompts_of(rng, [5, 9, 2])
    sp = SamplingParams(max_new_tokens=32)
    ar = DartEngine(target).generate(prompts, sp, speculative=False)
    truth = [p + o for p, o in zip(prompts, ar.token_ids)]
    dart = DartEngine(target, random_head(target), OracleTreeSearch(truth, depth=6, seed=1)).generate(prompts, sp)
    assert dart.token_ids == ar.token_ids
    assert dart.tau > 1.5  # the oracle's drafts were accepted, so trees of several rows were verified
    assert all(0 <= t < VOCAB for out in ar.token_ids for t in out)


def test_gguf_native_needs_a_gguf(tiny_model_dir):
    with pytest.raises(ValueError, match="needs a .gguf model"):
        TargetModel.from_pretrained(tiny_model_dir, weights="gguf-native")
    with pytest.raises(ValueError, match="'dense' or 'gguf-native'"):
        TargetModel.from_pretrained(tiny_model_dir, weights="int4")
    with pytest.raises(ValueError, match="gguf_kernel must be one of qmm-a8, qmm, aten"):
        TargetModel.from_pretrained(tiny_model_dir, weights="gguf-native", gguf_kernel="q4")
    with pytest.raises(ValueError, match="applies to weights='gguf-native' only"):
        TargetModel.from_pretrained(tiny_model_dir, gguf_kernel="qmm")


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_verification_forward_computes_each_position_as_one_token_steps_do(tmp_path, kernel):
    """Bit for bit: the 4-bit layers are row-exact, so attention must be row-exact as well
    (TargetModel.row_exact), or last-bit differences grow into different logits."""
    from dart_core.model.kv_cache import cache_mask
    from dart_core.model.target import TargetCache

    # SmolLM2's head size (64): float32 attention then differs in the last bits between row counts
    model = tiny_gguf_model(tmp_path / "tiny.gguf", seed=2, hidden_size=256, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64)
    quantize_from_gguf(model, tmp_path / "tiny.gguf", kernel=kernel)
    target = TargetModel(model)
    assert target.row_exact
    rng = np.random.default_rng(5)
    prompt, new = prompts_of(rng, [90])[0], prompts_of(rng, [12])[0]

    def logits(chunks):
        cache = TargetCache(1, "cpu")
        target.prefill([prompt], cache)
        pos, out = len(prompt), []
        for chunk in chunks:
            causal = torch.tril(torch.ones(len(chunk), len(chunk), dtype=torch.bool))[None]
            mask = cache_mask(cache.lengths, cache.padded_length, causal, target.dtype)
            res = target.forward(torch.tensor([chunk]), torch.arange(pos, pos + len(chunk))[None], mask, cache)
            cache.lengths += len(chunk)
            pos += len(chunk)
            out.append(torch.cat([res.logits[0], res.taps[0]], dim=-1))
        return torch.cat(out)

    steps = logits([[t] for t in new])
    assert torch.equal(logits([new]), steps)
    assert torch.equal(logits([new[:5], new[5:]]), steps)


def test_transformers_own_forward_of_the_4bit_target_stays_causal(tmp_path):
    """transformers' forwards (``generate``) may pass no mask and mean a causal one; the row-exact
    attention of a 4-bit target must then mask the future as SDPA does (it once attended to every
    position, and generate's output was garbage)."""
    model = tiny_gguf_model(tmp_path / "tiny.gguf", seed=4)
    quantize_from_gguf(model, tmp_path / "tiny.gguf")
    ids = torch.tensor([prompts_of(np.random.default_rng(2), [9])[0]])
    before = model(ids).logits
    target = TargetModel(model)  # turns on the row-exact attention
    assert target.row_exact
    after = model(ids).logits  # transformers' own forward, no explicit mask
    torch.testing.assert_close(after, before, rtol=1e-3, atol=1e-3)
    # the last position alone, after the others: the same logits as in the full forward
    prefix = model(ids[:, :-1], use_cache=True)
    last = model(ids[:, -1:], past_key_values=prefix.past_key_values).logits[:, -1]
    torch.testing.assert_close(last, after[:, -1], rtol=1e-3, atol=1e-3)


def test_checked_parts_are_cached_and_a_damaged_cache_is_rebuilt(tmp_path, caplog):
    path, cache = tmp_path / "tiny.gguf", tmp_path / "cache" / "int4"
    first = tiny_gguf_model(path)
    kinds = quantize_from_gguf(first, path, cache=cache)
    assert (cache / "int4.safetensors").is_file()
    path.write_bytes(b"not read again")  # the second load reads the cache only
    second = tiny_gguf_model(tmp_path / "again.gguf")
    assert quantize_from_gguf(second, path, cache=cache) == kinds
    for name in kinds:
        x = torch.randn(3, first.get_submodule(name).in_features)
        assert torch.equal(second.get_submodule(name)(x), first.get_submodule(name)(x))
    (cache / "int4.safetensors").write_bytes(b"damaged")
    third = tiny_gguf_model(tmp_path / "third.gguf")
    assert quantize_from_gguf(third, tmp_path / "third.gguf", cache=cache) == kinds
    assert "ignoring the 4-bit cache" in caplog.text


qmm_cpu = pytest.mark.skipif(q8_0_kernel() is None,
                             reason="the qmm kernels need AVX-512 or AVX2 (this CPU runs only their portable loops)")


@qmm_cpu
def test_quantize_linears_gives_q8_0_layers_with_ggmls_values():
    """Every bias-free nn.Linear becomes a Q8_0 Int4Linear holding the gguf package's Q8_0 values
    of its weight; biases, odd widths and a CPU without a qmm kernel are refused."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.ReLU(),
                                 torch.nn.Linear(96, 32, bias=False))
    dense = [m.weight.detach().numpy().copy() for m in module if isinstance(m, torch.nn.Linear)]
    x = torch.randn(3, 64)
    want = module(x).detach()
    assert quantize_linears(module) == 2
    layers = [m for m in module if isinstance(m, Int4Linear)]
    assert len(layers) == 2 and all(m.gguf_type == "Q8_0" and m.kernel == q8_0_kernel() for m in layers)
    for layer, w in zip(layers, dense):
        expected = gguf.quants.dequantize(_blocks(w, Q.Q8_0), Q.Q8_0)
        np.testing.assert_allclose(layer.weight.numpy(), expected, rtol=1e-6, atol=1e-7)
    got = module(x)
    assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=0.02, atol=0.02)
    with pytest.raises(ValueError, match="bias"):
        quantize_linears(torch.nn.Sequential(torch.nn.Linear(64, 8)))
    with pytest.raises(GGUFWeightsError, match="multiple of"):
        quantize_linears(torch.nn.Sequential(torch.nn.Linear(40, 8, bias=False)))
    with pytest.raises(ValueError, match="qmm kernel"):
        quantize_linears(torch.nn.Sequential(torch.nn.Linear(64, 8, bias=False)), kernel="aten")


@qmm_cpu
def test_greedy_dart_with_a_q8_0_draft_head_equals_autoregressive_output():
    """The draft head's linear layers in Q8_0 (the CPU default where the qmm kernel runs): its drafts
    change, the output does not, sequences joining mid-run included."""
    from ngram_service.tree_search import SearchParams

    target = tiny_target("llama", seed=4)
    rng = np.random.default_rng(5)
    prompts = prompts_of(rng, [6, 3, 8])
    sp = SamplingParams(max_new_tokens=20)
    ar = DartEngine(target).generate(prompts, sp, speculative=False).token_ids
    head = random_head(target, seed=1)
    assert quantize_linears(head) == 9  # fc, q, k, v, o, gate, up, down, lm_head
    engine = DartEngine(target, head, search_params=SearchParams(top_k=8, beam_width=4, budget=12))
    outputs, drafted = run_with_a_late_join(engine, prompts, sp)
    assert outputs == ar and drafted > 0
