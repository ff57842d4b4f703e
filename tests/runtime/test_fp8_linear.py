"""FP8 linear layers (dlmrt/runtime/fp8_linear.py) against plain references: the scales, the e4m3 round trip,
the product within e4m3's precision, which layers the swap touches, and the step loop in fp8."""

import copy

import pytest
import torch
from torch import nn

import dlmrt
from dlmrt.core.errors import ArgumentError
from dlmrt.runtime import GenerationSettings, Generator, Threshold, fp8_linear
from dlmrt.runtime.fp8_linear import Fp8Linear, quantize_model, quantize_rows

# e4m3: 3 mantissa bits, so a normal value rounds within 2^-4 of itself; below 2^-6 (times the scale)
# values are subnormal, spaced 2^-9, and round within 2^-10 (times the scale)
RELATIVE, SUBNORMAL_STEP = 2.0 ** -4, 2.0 ** -10


def dequantized(values, scale):
    return values.double() * scale.double()


def test_scales_are_each_rows_amax_over_448_by_hand():
    rows = torch.tensor([[448.0, 1.0, -0.5, 0.0], [1.0, 0.3, -0.25, 0.0], [-2.0, 0.0, 0.0, 0.0]])
    values, scale = quantize_rows(rows)
    assert scale.shape == (3, 1) and scale.dtype == torch.float32
    assert scale.flatten().tolist() == pytest.approx([1.0, 1 / 448, 2 / 448], rel=1e-7)
    assert values.dtype == torch.float8_e4m3fn
    # row 0 is exact at scale 1; row 1: 0.3 * 448 = 134.4 lies between e4m3's 128 and 144 and rounds to 128,
    # -0.25 * 448 = -112 is exact; row 2's amax maps to -448
    assert values.float().tolist() == [[448.0, 1.0, -0.5, 0.0], [448.0, 128.0, -112.0, 0.0], [-448.0, 0, 0, 0]]


def test_round_trip_error_is_within_e4m3s_rounding():
    torch.manual_seed(0)
    rows = torch.randn(64, 256) * torch.logspace(-3, 2, 64)[:, None]  # rows of very different sizes
    values, scale = quantize_rows(rows)
    expected_scale = rows.double().abs().amax(dim=1, keepdim=True) / 448
    assert torch.allclose(scale.double(), expected_scale, rtol=1e-6, atol=0)
    error = (dequantized(values, scale) - rows.double()).abs()
    bound = torch.maximum(rows.double().abs() * RELATIVE, SUBNORMAL_STEP * expected_scale)
    assert (error <= bound * (1 + 1e-6)).all()
    assert error.max() > 0  # it did quantize


def test_an_all_zero_row_quantizes_to_zeros():
    values, scale = quantize_rows(torch.zeros(2, 16))
    assert (values.float() == 0).all() and torch.isfinite(scale).all() and (scale > 0).all()


def product_bound(x, weight):
    """|fp8 product - exact product| <= sum_k |x_k| |w_k| ((1 + 2^-4)^2 - 1), plus the subnormal terms."""
    x_scale = x.double().abs().amax(dim=1, keepdim=True) / 448
    w_scale = weight.double().abs().amax(dim=1, keepdim=True) / 448
    x_error = torch.maximum(x.double().abs() * RELATIVE, SUBNORMAL_STEP * x_scale)
    w_error = torch.maximum(weight.double().abs() * RELATIVE, SUBNORMAL_STEP * w_scale)
    return (x.double().abs() @ w_error.T + x_error @ weight.double().abs().T + x_error @ w_error.T) * (1 + 1e-4)


def linear(in_features, out_features, bias, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize("kernel", fp8_linear.KERNELS)
@pytest.mark.parametrize("bias", [False, True])
def test_the_fp8_product_is_within_e4m3s_precision_of_the_float_one(kernel, bias):
    layer = linear(128, 48, bias)
    x = torch.randn(2, 5, 128) * 3
    out = Fp8Linear(layer, kernel)(x)
    assert out.shape == (2, 5, 48) and out.dtype == torch.float32
    exact = x.double().reshape(10, 128) @ layer.weight.double().T
    if bias:
        exact = exact + layer.bias.double()
    error = (out.double().reshape(10, 48) - exact).abs()
    assert (error <= product_bound(x.reshape(10, 128), layer.weight.detach())).all()
    assert error.max() > 1e-4  # it is not the float product


def test_a_wrong_weight_scale_falls_outside_the_bound():
    layer = linear(64, 32, False)
    with torch.no_grad():
        layer.weight[3].abs_()  # with x > 0 too, no term of output 3 cancels another
    x = torch.rand(4, 64) + 0.1
    wrong = Fp8Linear(layer, "dequantize")
    wrong.weight_scale[0, 3] *= 1.25
    error = (wrong(x).double() - x.double() @ layer.weight.double().T).abs()
    assert (error[:, 3] > product_bound(x, layer.weight.detach())[:, 3]).any()


def test_scaled_mm_and_the_dequantize_reference_agree():
    if fp8_linear.kernel_for("cpu") != "scaled_mm":
        pytest.skip(f"torch {torch.__version__} runs no _scaled_mm on the CPU")
    layer = linear(256, 64, True)
    x = torch.randn(7, 256)
    fast, reference = Fp8Linear(layer, "scaled_mm")(x), Fp8Linear(layer, "dequantize")(x)
    assert torch.allclose(fast, reference, rtol=1e-5, atol=1e-5)


def test_bfloat16_in_bfloat16_out():
    layer = linear(64, 32, False).to(torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    out = Fp8Linear(layer, fp8_linear.kernel_for("cpu"))(x)
    assert out.dtype == torch.bfloat16
    error = (out.double() - x.double() @ layer.weight.double().T).abs()
    assert (error <= product_bound(x.float(), layer.weight.float()) + out.double().abs() * 2 ** -8).all()


def test_the_swap_leaves_the_head_embeddings_and_adapter_alone():
    model = dlmrt.load(dlmrt.TINY_ORL_MODEL_DIR)
    before = {name: type(m) for name, m in model.named_modules()}
    swapped = quantize_model(model)
    assert len(swapped) == 7 * model.num_layers  # q, k, v, out, gate, up, down in every block
    for name, module in model.named_modules():
        if name in swapped:
            assert isinstance(module, Fp8Linear) and module.weight_fp8.dtype == torch.float8_e4m3fn
        else:
            assert type(module) is before[name], name
    transformer = model.model.transformer
    assert type(transformer["ff_out"]) is nn.Linear and transformer["ff_out"].weight.dtype == torch.float32
    assert transformer["wte"].weight.dtype == torch.float32
    assert all(type(m) is not Fp8Linear for m in model.residual_adapter().modules())


def test_unaligned_linears_stay_and_a_model_with_none_is_refused():
    model = dlmrt.load()
    for block in model.blocks():
        block.k_proj = nn.Linear(128, 40, bias=False)  # 40 is no multiple of 16
    quantize_model(model)
    assert all(type(block.k_proj) is nn.Linear for block in model.blocks())
    assert all(isinstance(block.q_proj, Fp8Linear) for block in model.blocks())
    with pytest.raises(ArgumentError, match="cannot run in fp8"):
        quantize_model(model)  # nothing plain is left to swap


def test_kernels_by_device():
    assert fp8_linear.kernel_for("meta") == "scaled_mm"
    assert fp8_linear.kernel_for("cpu") in fp8_linear.KERNELS
    with pytest.raises(ArgumentError, match="not on mps") as raised:
        fp8_linear.kernel_for("mps")
    assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match="unknown fp8 kernel"):
        Fp8Linear(nn.Linear(16, 16), "int8")


def test_a_gpu_older_than_compute_capability_8_9_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ArgumentError, match=r"compute capability 8.9 or newer .*NVIDIA A100 is 8.0") as raised:
        fp8_linear.kernel_for("cuda")
    assert "\n" not in str(raised.value)


def test_the_tiny_model_decodes_in_fp8_as_in_float32_mostly():
    model = dlmrt.load()
    fp8 = copy.deepcopy(model)
    quantize_model(fp8)
    prompts = [model.tokenizer.encode(p).ids for p in ("add:762+139=", "rev:hello=", "sort:dcba=")]
    settings = GenerationSettings(gen_length=16, block_length=8, policy=Threshold(0.9), cache="dual")
    floats = Generator(model, mode="eager").generate(prompts, settings).tokens
    quantized = Generator(fp8, mode="eager").generate(prompts, settings).tokens
    assert (floats == quantized).float().mean() >= 0.9
    assert model.tokenizer.decode(Generator(fp8, mode="eager").generate(prompts[:1], settings).rows[0].token_ids) \
        == "0901"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_scaled_mm_matches_the_reference_and_cuda_graphs_match_eager():
    if torch.cuda.get_device_capability() < fp8_linear.MIN_CAPABILITY:
        with pytest.raises(ArgumentError, match="compute capability 8.9"):
            fp8_linear.kernel_for("cuda")
        return
    layer = linear(256, 128, False).to("cuda", torch.bfloat16)
    x = torch.randn(9, 256, device="cuda", dtype=torch.bfloat16)
    fast, reference = Fp8Linear(layer, "scaled_mm")(x), Fp8Linear(layer, "dequantize")(x)
    assert torch.allclose(fast.float(), reference.float(), rtol=2 ** -7, atol=1e-2)
    model = dlmrt.load(dtype="bfloat16", device="cuda")
    quantize_model(model)
    from dlmrt.runtime.torch_backend import TorchBackend

    prompts = [model.tokenizer.encode(p).ids for p in ("add:762+139=", "rev:hello=")]
    settings = GenerationSettings(gen_length=16, block_length=8, policy=Threshold(0.9), cache="dual")
    eager = Generator(TorchBackend(model, mode="eager", max_batch=2)).generate(prompts, settings).tokens
    graphs = Generator(TorchBackend(model, mode="cudagraph", max_batch=2)).generate(prompts, settings).tokens
    assert torch.equal(eager, graphs)
