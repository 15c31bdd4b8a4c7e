"""FP8-block and compressed-tensors INT4 decoding against independently written packers and hand-built words."""
import re

import pytest
import torch

from fixtures import dequantize_fp8_reference, pack_int4, quantize_fp8_block
from nano.errors import NanoError
from nano.quant import dequantize_fp8_block, e4m3_bits, unpack_int4


@pytest.mark.parametrize("shape, block", [((200, 300), (128, 128)), ((128, 256), (128, 128)),
                                          ((5, 7), (128, 128)), ((70, 90), (32, 64))])
def test_fp8_block_matches_reference_and_approximates_weight(shape, block):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.05
    fp8, scale_inv = quantize_fp8_block(w, block)
    out = dequantize_fp8_block(fp8, scale_inv, block)
    assert out.dtype == torch.float32 and out.shape == shape
    torch.testing.assert_close(out, dequantize_fp8_reference(fp8, scale_inv, block), rtol=0, atol=0)
    assert ((out - w).abs() <= w.abs() * 2 ** -3 + 1e-6).all()  # e4m3 keeps 3 mantissa bits


def test_fp8_block_applies_each_blocks_own_scale():
    fp8 = torch.ones(130, 129).to(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = dequantize_fp8_block(fp8, scale_inv)
    assert out[0, 0] == 1 and out[127, 127] == 1 and out[0, 128] == 2 and out[128, 0] == 3 and out[129, 128] == 4


def test_fp8_clamps_to_finite_range():
    fp8, scale_inv = quantize_fp8_block(torch.tensor([[1e6, -1e6, 0.0]]))
    assert torch.isfinite(dequantize_fp8_block(fp8, scale_inv)).all()


@pytest.mark.parametrize("scale_shape", [(1, 1), (3, 2), (2, 3, 1)])
def test_fp8_wrong_scale_shape_names_shapes(scale_shape):
    fp8 = torch.zeros(200, 300).to(torch.float8_e4m3fn)
    with pytest.raises(NanoError, match=re.escape("(200, 300)") + ".*" + re.escape(f"(2, 3), got {scale_shape}")):
        dequantize_fp8_block(fp8, torch.ones(scale_shape))


def test_fp8_rejects_non_fp8_and_non_matrix():
    with pytest.raises(NanoError, match="float8"):
        dequantize_fp8_block(torch.zeros(4, 4), torch.ones(1, 1))
    with pytest.raises(NanoError, match="2-D"):
        dequantize_fp8_block(torch.zeros(4).to(torch.float8_e4m3fn), torch.ones(1))


def test_int4_bit_layout_low_nibble_first():
    # 0x76543210: nibble j holds j, i.e. stored u = j and q = j - 8; 0xFEDCBA98 (negative as int32): q = 0..7
    words = torch.tensor([[0x76543210, 0xFEDCBA98 - 2 ** 32]], dtype=torch.int32)
    scale = torch.tensor([[1.0, 0.5]])
    out = unpack_int4(words, scale, (1, 16), group_size=8)
    expected = torch.tensor([[-8, -7, -6, -5, -4, -3, -2, -1] + [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_int4_padding_is_stripped_by_weight_shape():
    # K = 3: one word, only nibbles 0..2 are real (u = 9, 10, 15 -> q = 1, 2, 7); the rest is padding
    word = 9 + 10 * 16 + 15 * 16 ** 2 + 0xF * 16 ** 7 - 2 ** 32
    out = unpack_int4(torch.tensor([[word]], dtype=torch.int32), torch.tensor([[2.0]]), (1, 3), group_size=32)
    torch.testing.assert_close(out, torch.tensor([[2.0, 4.0, 14.0]]), rtol=0, atol=0)


@pytest.mark.parametrize("shape, group", [((64, 128), 32), ((3, 64), 64), ((16, 20), 32), ((8, 44), 16)])
def test_int4_round_trip_against_independent_packer(shape, group):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    packed, scale, weight_shape, reference = pack_int4(w, group)
    out = unpack_int4(packed, scale, weight_shape, group)
    assert out.dtype == torch.float32 and out.shape == shape
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    step = scale.float().repeat_interleave(group, dim=1)[:, :shape[1]]
    assert ((out - w).abs() <= step * 0.5 + 1e-3 * step).all()   # round-to-nearest within half a step


def test_int4_accepts_tensor_weight_shape_and_fp32_scale():
    w = torch.randn(4, 32)
    packed, scale, weight_shape, reference = pack_int4(w, 32, scale_dtype=torch.float32)
    torch.testing.assert_close(unpack_int4(packed, scale, weight_shape, 32), reference, rtol=0, atol=0)


def test_int4_malformed_inputs_raise_nano_errors():
    packed, scale, _, _ = pack_int4(torch.randn(4, 64), 32)
    with pytest.raises(NanoError, match=r"weight_packed of shape \(4, 8\), got \(4, 7\)"):
        unpack_int4(packed[:, :7], scale, (4, 64), 32)
    with pytest.raises(NanoError, match=r"weight_scale of shape \(4, 2\), got \(4, 1\)"):
        unpack_int4(packed, scale[:, :1], (4, 64), 32)
    with pytest.raises(NanoError, match=r"weight_packed of shape \(5, 8\)"):
        unpack_int4(packed, scale, (5, 64), 32)
    with pytest.raises(NanoError, match="int32"):
        unpack_int4(packed.to(torch.int64), scale, (4, 64), 32)
    with pytest.raises(NanoError, match=r"\(N, K\)"):
        unpack_int4(packed, scale, (4, 64, 1), 32)
    with pytest.raises(NanoError, match="group_size"):
        unpack_int4(packed, scale, (4, 64), 0)


@pytest.mark.parametrize("dtype, factor", [(torch.float16, 2.0 ** -8), (torch.bfloat16, 2.0 ** -120)])
def test_e4m3_bits_convert_every_code_exactly(dtype, factor):
    """All 254 finite e4m3fn codes (subnormals, both zeros, ±448) against torch's own FP8 -> float conversion."""
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = ~codes.float().isnan()
    converted = e4m3_bits(codes[finite], dtype)
    assert converted.dtype == dtype
    assert torch.equal(converted.double() / factor, codes[finite].double())
    assert torch.equal(converted.view(torch.int16) < 0, codes[finite].view(torch.int8) < 0)   # -0 keeps its sign
