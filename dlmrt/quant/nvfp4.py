"""NVFP4, simulated exactly in torch: the quantizer, and a denoiser whose transformer Linears run as
TensorRT's NVFP4 GEMMs would (for accuracy figures on machines without a Blackwell GPU).

The format (TensorRT's DynamicQuantize/DequantizeLinear, nvidia-modelopt's NVFP4 recipe):

- elements are FP4 E2M1, magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}, in blocks of 16 consecutive
  elements along the last (reduction) axis;
- each block has an FP8 E4M3 scale: `e4m3(min(block_amax / (6 * global_scale), 448))`;
- the tensor has one FP32 global scale: `amax / (6 * 448)`, from the tensor itself (weights) or
  from a calibrated amax (activations);
- an element is stored as `e2m1(x / (block_scale * global_scale))` and read back as
  `e2m1_value * (block_scale * global_scale)`, the two DequantizeLinear nodes of the ONNX form.

Decisions, where the format leaves room:

- Rounding: both casts round to nearest, ties to even, and saturate (E2M1 at 6, E4M3 at 448), as
  the E2M1/E4M3 casts of CUDA, ONNX (`saturate=1`) and ml_dtypes do and as modelopt's reference
  quantizer rounds (its decision bounds 0.25, 0.75, ..., 5 break ties toward the even code).
- An all-zero block gets scale 1.0, and a block whose E4M3 scale would underflow (one far below the
  tensor's amax) gets E4M3's smallest step, 2^-9, as modelopt writes them: TensorRT's parser wants
  positive scales, and the smallest step keeps what can be kept of a tiny block. A tensor whose
  amax is 0 gets global scale 1.0.
- The last dimension must be a multiple of 16: TensorRT's FP4 GEMM refuses anything else, so a
  Linear whose input width is not is left in high precision (here and in `nvfp4_onnx`) rather
  than padded.
- Signs survive: -0.0 and tiny negative values become E2M1 -0 (code 8) and dequantize to -0.0.
- Inputs with inf or nan are refused: their scales would be meaningless.

What is quantized (`simulate`): every nn.Linear inside the transformer blocks (attention
projections, dense MLPs, MoE experts and shared experts), weights and inputs (W4A4), as
modelopt's default NVFP4 config does for LLMs. The embedding, the LM head, the MoE router and the
ORL residual adapter stay in high precision: modelopt's defaults leave out `*lm_head*`,
`*router*` and `*mlp.gate.*`, and the adapter lies outside the blocks. Weight global scales come
from the weights; input global scales from the largest |input| seen while calibrating.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlmrt.core.errors import DlmrtError
from dlmrt.models.experts import StackedLinear

if TYPE_CHECKING:
    from dlmrt.models import Denoiser

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_SMALLEST = 2.0 ** -9  # the smallest positive E4M3 value (a subnormal)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # by code; code | 8 is the negative
# Midpoints between neighbouring E2M1 magnitudes. A tie goes to the even code: down at these...
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
# ...and up at these.
_TIES_UP = (0.75, 1.75, 3.5)


class QuantizationError(DlmrtError, ValueError):
    """A tensor, scale or calibration input that NVFP4 quantization cannot take."""


class NVFP4Tensor(NamedTuple):
    codes: Tensor  # uint8 E2M1 bit patterns (sign in bit 3), the input's shape
    block_scales: Tensor  # torch.float8_e4m3fn, [..., K / 16]
    global_scale: Tensor  # float32 scalar


def global_scale_from_amax(amax: float | Tensor) -> Tensor:
    """The FP32 global scale `amax / (6 * 448)` (1.0 for an amax of 0)."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    if amax.numel() != 1 or not torch.isfinite(amax).all() or (amax < 0).any():
        raise QuantizationError(f"an NVFP4 amax must be one finite number >= 0, got {amax.tolist()}: "
                                f"check the calibration inputs")
    amax = amax.reshape(())
    return torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))


def e2m1_codes(values: Tensor) -> Tensor:
    """E2M1 bit patterns (uint8) of float32 values: nearest, ties to even, saturating at 6."""
    magnitude = values.abs()
    ties_down, ties_up = (torch.tensor(t, device=values.device) for t in (_TIES_DOWN, _TIES_UP))
    # How many midpoints lie below |v|, counting a tie only where it rounds up.
    code = (torch.bucketize(magnitude, ties_down, right=False)
            + torch.bucketize(magnitude, ties_up, right=True))
    return (code + 8 * torch.signbit(values)).to(torch.uint8)


def e2m1_values(codes: Tensor) -> Tensor:
    """Float32 values of E2M1 bit patterns."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=codes.device)
    return table[codes.long()]


def e4m3(values: Tensor) -> Tensor:
    """Float32 values rounded to FP8 E4M3 (nearest, ties to even), saturating at 448."""
    return values.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)


def _blocks(x: Tensor) -> Tensor:
    if not x.is_floating_point() or x.dim() == 0:
        raise QuantizationError(f"NVFP4 quantizes floating-point tensors of rank >= 1, got {x.dtype} of "
                                f"shape {list(x.shape)}")
    if x.shape[-1] % BLOCK_SIZE:
        raise QuantizationError(f"NVFP4 needs the last dimension to be a multiple of {BLOCK_SIZE}, got shape "
                                f"{list(x.shape)}: leave this tensor unquantized (TensorRT's FP4 GEMM "
                                f"takes no other widths)")
    if not torch.isfinite(x).all():
        raise QuantizationError("the tensor to quantize to NVFP4 holds inf or nan: fix the model or input "
                                "that produced it")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)


def quantize(x: Tensor, global_scale: float | Tensor | None = None) -> NVFP4Tensor:
    """NVFP4 codes, block scales and global scale of `x` (blocks of 16 along the last axis).

    global_scale: by default from x's own amax; give one from a calibrated amax
    (`global_scale_from_amax`) to quantize activations as TensorRT does.
    """
    blocks = _blocks(x)
    if global_scale is None:
        global_scale = global_scale_from_amax(blocks.abs().amax() if blocks.numel() else 0.0)
    global_scale = torch.as_tensor(global_scale, dtype=torch.float32).reshape(())
    if not (torch.isfinite(global_scale) and global_scale > 0):
        raise QuantizationError(f"an NVFP4 global scale must be finite and positive, got {global_scale.item()}")
    raw = blocks.abs().amax(-1) / (E2M1_MAX * global_scale)
    scales = e4m3(torch.where(raw == 0, torch.ones_like(raw), raw.clamp(min=E4M3_SMALLEST)))
    codes = e2m1_codes(blocks / (scales.float() * global_scale)[..., None])
    return NVFP4Tensor(codes.reshape(x.shape), scales, global_scale)


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The values `q` stands for: E2M1 value times (block scale times global scale)."""
    shape = q.codes.shape
    values = e2m1_values(q.codes).reshape(*shape[:-1], shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    return (values * (q.block_scales.float() * q.global_scale)[..., None]).reshape(shape).to(dtype)


def fake_quantize(x: Tensor, global_scale: float | Tensor | None = None) -> Tensor:
    """`dequantize(quantize(x, global_scale))`, in x's dtype."""
    return dequantize(quantize(x, global_scale), x.dtype)


# -- the simulated denoiser ---------------------------------------------------------------


class NVFP4Linear(nn.Module):
    """An nn.Linear as TensorRT's NVFP4 GEMM computes it: both operands fake-quantized.

    The input's global scale comes from its calibrated amax; a layer that saw no calibration input
    (an expert no token chose) takes it from each input's own amax instead.
    """

    def __init__(self, linear: nn.Linear, input_amax: float | None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(fake_quantize(linear.weight.detach()), requires_grad=False)
        self.bias = linear.bias
        self.input_global_scale = None if input_amax is None else global_scale_from_amax(input_amax)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(fake_quantize(x, self.input_global_scale), self.weight, self.bias)


class NVFP4Experts(StackedLinear):
    """Stacked experts' linears, each expert as an `NVFP4Linear` of its own computes it (its weight row
    fake-quantized with its own global scale, its inputs with its own calibrated one)."""

    def __init__(self, stacked: StackedLinear, input_amax: list[float | None]):
        nn.Module.__init__(self)
        self.in_features, self.out_features = stacked.in_features, stacked.out_features
        weight = torch.stack([fake_quantize(row) for row in stacked.weight.detach()])
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.input_global_scales = [None if amax is None else global_scale_from_amax(amax) for amax in input_amax]

    def forward(self, x: Tensor, expert: int | None = None, offsets: Tensor | None = None) -> Tensor:
        if offsets is None:
            return F.linear(fake_quantize(x, self.input_global_scales[expert]), self.weight[expert])
        out = x.new_zeros(x.shape[0], self.out_features)  # rows past the last offset belong to no expert here
        for index, rows in _expert_rows(offsets):
            out[rows] = F.linear(fake_quantize(x[rows], self.input_global_scales[index]), self.weight[index])
        return out


def _expert_rows(offsets: Tensor) -> list[tuple[int, slice]]:
    """Each expert with rows, and its rows, from the grouped form's end offsets (a host read: a simulation)."""
    ends = offsets.tolist()
    return [(index, slice(start, end)) for index, (start, end) in enumerate(zip([0, *ends[:-1]], ends))
            if end > start]


def quantizable_linears(model: Denoiser) -> dict[str, nn.Linear | StackedLinear]:
    """The Linears NVFP4 quantizes, by name in `model`: those inside the transformer blocks whose
    input width is a multiple of 16 (a MoE's stacked experts' linears among them)."""
    inside = {id(m) for block in model.blocks() for m in block.modules()}
    return {name: m for name, m in model.named_modules()
            if id(m) in inside and isinstance(m, (nn.Linear, StackedLinear)) and m.in_features % BLOCK_SIZE == 0}


def calibrate(model: Denoiser, calibration_inputs: Iterable[Tensor | Mapping]) -> dict[str, float]:
    """The largest |input| of each quantizable Linear over the calibration inputs (token ids
    `[B, T]` for `model(ids)`, or keyword arguments for `model.denoise`); a stacked expert's under
    `NAME.EXPERT` (`...experts.gate_proj.5`)."""
    amax: dict[str, float] = {}

    def seen(key: str, x: Tensor) -> None:
        amax[key] = max(amax.get(key, 0.0), float(x.detach().abs().amax()))

    def record(name: str):
        def hook(module, args, kwargs):
            x, expert, offsets = _linear_call(module, args, kwargs)
            if not isinstance(module, StackedLinear):
                seen(name, x)
            elif offsets is None:
                seen(f"{name}.{expert}", x)
            else:
                for index, rows in _expert_rows(offsets):
                    seen(f"{name}.{index}", x[rows])
        return hook

    handles = [m.register_forward_pre_hook(record(name), with_kwargs=True)
               for name, m in quantizable_linears(model).items()]
    count = 0
    try:
        with torch.no_grad():
            for item in calibration_inputs:
                model.denoise(**item) if isinstance(item, Mapping) else model(item)
                count += 1
    finally:
        for handle in handles:
            handle.remove()
    if not count:
        raise QuantizationError("NVFP4 calibration got no inputs: give at least one batch of token ids")
    return amax


def _linear_call(module: nn.Module, args: tuple, kwargs: dict) -> tuple[Tensor, int | None, Tensor | None]:
    """(input, expert, offsets) of a call of a Linear or of a StackedLinear."""
    named = dict(zip(("x", "expert", "offsets"), args)) | kwargs
    return named["x"], named.get("expert"), named.get("offsets")


def simulate(model: Denoiser, calibration_inputs: Iterable[Tensor | Mapping]) -> Denoiser:
    """A copy of `model` whose transformer Linears are NVFP4 fake-quantized (weights, and inputs
    with global scales calibrated on `calibration_inputs`: token ids `[B, T]` or keyword
    arguments for `model.denoise`). `model` itself is left unchanged."""
    amax = calibrate(model, calibration_inputs)
    simulated = copy.deepcopy(model)
    for name, linear in quantizable_linears(simulated).items():
        if isinstance(linear, StackedLinear):
            quantized = NVFP4Experts(linear, [amax.get(f"{name}.{row}") for row in range(linear.weight.shape[0])])
        else:
            quantized = NVFP4Linear(linear, amax.get(name))
        simulated.set_submodule(name, quantized)
    return simulated.eval()
