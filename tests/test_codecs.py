"""Tensor codecs: round-trip error bounds, the exact validation rules of decode, error feedback, and
property tests that decoding arbitrary bytes or meta only ever raises a `ProtocolError`."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.protocol import device_int8
from diloco.protocol.codecs import (
    Codec,
    ErrorFeedback,
    Int4Codec,
    Int8Codec,
    available_codecs,
    get_codec,
    register_codec,
)
from diloco.protocol.errors import Malformed, ProtocolError, TooLarge

# hivemind 1.1.12 (and bitsandbytes under it) warn about numpy and torch deprecations; not ours to fix.
pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning:hivemind",
    "ignore::UserWarning:hivemind",
    "ignore:`torch.jit:DeprecationWarning",
)

OURS = ["fp32", "fp16", "bf16", "int8", "int4"]
# rel_l2 = ||decode(encode(x)) - x|| / ||x|| must stay under these on 100k samples.
GAUSSIAN_BOUND = {"fp32": 0.0, "fp16": 5e-4, "bf16": 3e-3, "int8": 0.01, "int4": 0.10}
HEAVY_TAIL_BOUND = {"fp32": 0.0, "fp16": 5e-4, "bf16": 3e-3, "int8": 0.03, "int4": 0.20}
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def rel_l2(y: torch.Tensor, x: torch.Tensor) -> float:
    x64, y64 = x.double(), y.double()
    norm = x64.norm().item()
    return (y64 - x64).norm().item() / norm if norm else (y64 - x64).norm().item()


def roundtrip(name: str, x: torch.Tensor) -> torch.Tensor:
    codec = get_codec(name)
    meta, data = codec.encode(x)
    meta = msgpack.unpackb(msgpack.packb(meta))  # meta must survive the wire unchanged
    assert meta["codec"] == name and meta["shape"] == list(x.shape)
    assert len(data) == codec.encoded_size(x.numel())
    y = codec.decode(meta, data)
    assert y.dtype == torch.float32 and y.shape == x.shape
    return y


def gaussian(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def hivemind_names() -> list[str]:
    try:
        import diloco.protocol.hivemind_codecs  # noqa: F401
    except ImportError:
        return []
    return ["hivemind_fp16", "hivemind_uniform8", "hivemind_blockwise8"]


# --- round trips ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OURS)
def test_roundtrip_error_on_gaussian_is_within_bound(name: str) -> None:
    x = gaussian(100_000)
    assert rel_l2(roundtrip(name, x), x) <= GAUSSIAN_BOUND[name]


@pytest.mark.parametrize("name", OURS)
def test_roundtrip_error_on_heavy_tailed_data_is_within_bound(name: str) -> None:
    torch.manual_seed(1)
    x = torch.distributions.StudentT(3.0).sample((100_000,))
    assert rel_l2(roundtrip(name, x), x) <= HEAVY_TAIL_BOUND[name]


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("magnitude", [1e30, 1e-30])
def test_roundtrip_keeps_relative_error_at_huge_and_tiny_magnitudes(name: str, magnitude: float) -> None:
    x = gaussian(10_000) * magnitude
    assert rel_l2(roundtrip(name, x), x) <= GAUSSIAN_BOUND[name]


def test_fp16_saturates_beyond_its_range_and_flushes_tiny_values_to_zero() -> None:
    x = torch.tensor([1e30, -1e30, 7e4, 1e-30])
    assert roundtrip("fp16", x).tolist() == [65504.0, -65504.0, 65504.0, 0.0]


@pytest.mark.parametrize("name", OURS)
def test_all_zero_tensor_decodes_to_exact_zeros(name: str) -> None:
    assert torch.equal(roundtrip(name, torch.zeros(1001)), torch.zeros(1001))


@pytest.mark.parametrize("name", OURS)
@pytest.mark.parametrize("shape", [(), (1,), (0,), (3, 0)])
def test_zero_dim_single_element_and_empty_tensors_keep_their_shape(name: str, shape: tuple) -> None:
    x = torch.full(shape, -2.75)
    y = roundtrip(name, x)
    assert torch.allclose(y, x, rtol=2**-8)


@pytest.mark.parametrize("name", OURS)
def test_non_contiguous_input_encodes_like_its_contiguous_copy(name: str) -> None:
    base = gaussian(64 * 48).view(64, 48)
    codec = get_codec(name)
    for view in (base.t(), base[::3, 1::2]):
        assert not view.is_contiguous()
        assert codec.encode(view) == codec.encode(view.contiguous())


@pytest.mark.parametrize("name", OURS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_any_float_dtype_is_encoded_as_its_float32_value(name: str, dtype: torch.dtype) -> None:
    x = gaussian(1000).to(dtype)
    assert get_codec(name).encode(x) == get_codec(name).encode(x.float())


@pytest.mark.parametrize("name", OURS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_encode_refuses_non_finite_values(name: str, bad: float) -> None:
    x = gaussian(3000)
    x[2500] = bad
    with pytest.raises(Malformed, match="non-finite"):
        get_codec(name).encode(x)


def test_encode_refuses_integer_tensors() -> None:
    with pytest.raises(TypeError):
        get_codec("int8").encode(torch.arange(10))


def test_int8_error_per_element_is_at_most_half_a_step_of_its_block() -> None:
    codec = Int8Codec(block=64)
    x = gaussian(64 * 100) * torch.linspace(1e-3, 1e3, 64 * 100)
    y = codec.decode(*codec.encode(x))
    half_step = x.view(-1, 64).abs().amax(1, keepdim=True) / 127 / 2
    assert ((y - x).view(-1, 64).abs() <= half_step * (1 + 1e-5)).all()


def test_int4_keeps_zero_exact_and_block_absmax_within_bf16_rounding() -> None:
    x = gaussian(1024)
    x[::7] = 0.0
    y = roundtrip("int4", x)
    assert (y[::7] == 0).all()
    i = x.abs().argmax()
    assert abs(y[i] - x[i]) < abs(x[i]) * 2**-7  # bfloat16 keeps 8 significant bits


@pytest.mark.parametrize("name", OURS)
def test_encoded_size_matches_payload_and_ratio_counts_float32_bytes(name: str) -> None:
    codec = get_codec(name)
    for n in (0, 1, 2, 127, 128, 129, 4097):
        assert len(codec.encode(gaussian(n))[1]) == codec.encoded_size(n)
    assert codec.ratio(10**6) == pytest.approx(4e6 / codec.encoded_size(10**6))
    assert {"int8": 3.9, "int4": 7.5}.get(name, 1.0) <= codec.ratio(10**7)


@pytest.mark.parametrize("name", OURS)
def test_decode_accepts_bytearray_and_misaligned_memoryview(name: str) -> None:
    x = gaussian(999)
    codec = get_codec(name)
    meta, data = codec.encode(x)
    expected = codec.decode(meta, data)
    assert torch.equal(codec.decode(meta, bytearray(data)), expected)
    assert torch.equal(codec.decode(meta, memoryview(b"\0" + data)[1:]), expected)


@pytest.mark.parametrize("name", OURS)
def test_decode_into_out_writes_there_and_returns_a_view_of_it(name: str) -> None:
    x = gaussian(600).view(20, 30)
    codec = get_codec(name)
    meta, data = codec.encode(x)
    out = torch.empty(600)
    y = codec.decode(meta, data, out=out)
    assert y.shape == (20, 30) and y.data_ptr() == out.data_ptr()
    assert torch.equal(y, codec.decode(meta, data))
    with pytest.raises(ValueError):
        codec.decode(meta, data, out=torch.empty(599))


def _int8_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    mixed = torch.randn(2048, generator=g)
    mixed[:512] *= 1e-40  # a block with a subnormal scale: divided, not multiplied by an overflowing inverse
    mixed[512:1024] = 0  # a zero block
    mixed[1024:1536] *= 3e38 / 4  # a scale at float32's top
    return {"gaussian, a short last block": torch.randn(100_003, generator=g), "zeros": torch.zeros(1500),
            "blocks of every kind": mixed,
            "ties": (torch.randint(-300, 300, (4096,), generator=g).float() + 0.5) / 2.0,
            "smallest subnormals": torch.tensor([1e-45, -1e-45, 3e-45]),
            "negative zeros": torch.full((1030,), -0.0), "empty": torch.zeros(0)}


@pytest.mark.parametrize("case", list(_int8_cases()))
def test_the_device_int8_path_gives_the_cpu_kernels_bytes_and_values(case: str) -> None:
    """protocol/device_int8.py, run here on CPU tensors: the same torch operations a GPU runs."""
    x, codec = _int8_cases()[case], get_codec("int8")
    meta, data = codec.encode(x)
    assert device_int8.encode(x, codec.block).numpy().tobytes() == bytes(data)
    out = torch.empty(x.numel())
    device_int8.decode(torch.tensor(np.frombuffer(bytes(data), np.uint8)), x.numel(), codec.block, out)
    assert torch.equal(out, codec.decode(meta, data))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_device_int8_path_refuses_what_the_kernels_refuse(bad: float) -> None:
    for at in (1, 700):  # in a whole block, in the short last block
        x = torch.ones(1000)
        x[at] = bad
        with pytest.raises(Malformed, match="non-finite"):
            device_int8.encode(x, 512)
    payload = torch.tensor(np.frombuffer(np.float32(1.0).tobytes() + bytes([0x80, 1]), np.uint8))
    with pytest.raises(Malformed, match="-128"):
        device_int8.decode(payload, 2, 512, torch.empty(2))


_TRITON_CHECK = """
import torch, sys
sys.path.insert(0, "tests")
from test_codecs import _int8_cases
from diloco.protocol import _int8_triton
from diloco.protocol.codecs import get_codec
codec, g = get_codec("int8"), torch.Generator().manual_seed(7)
cases = list(_int8_cases().values())
for n in (1, 511, 513, 70_001):  # magnitudes across float32's range, exact zeros
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 20).clamp(max=1e30)
    x[torch.rand(n, generator=g) < 0.01] = 0.0
    cases.append(x)
for x in cases:
    payload, flag = _int8_triton.encode(x, codec.block)
    assert payload.numpy().tobytes() == bytes(codec.encode(x)[1]) and int(flag) == 0
for bad in (float("nan"), float("inf"), -float("inf")):
    x = torch.ones(1000)
    x[700] = bad
    assert int(_int8_triton.encode(x, 512)[1]) == 1
print("same bytes")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the test extra has it)")
def test_the_triton_int8_encoder_gives_the_cpu_kernels_bytes_in_the_interpreter() -> None:
    """protocol/_int8_triton.py, the kernel a CUDA learner encodes with, run by Triton's interpreter on the
    CPU (the same kernel, numpy doing each operation): every case's bytes are the CPU kernels'."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", _TRITON_CHECK], capture_output=True, text=True, timeout=120,
                          env=env, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0 and "same bytes" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(_int8_cases()))
def test_int8_encodes_and_decodes_a_cuda_tensor_on_the_device_as_on_the_cpu(case: str) -> None:
    x, codec = _int8_cases()[case], get_codec("int8")
    meta, data = codec.encode(x.cuda())
    assert (meta, bytes(data)) == (codec.encode(x)[0], bytes(codec.encode(x)[1]))
    out = torch.empty(x.numel(), device="cuda")
    assert torch.equal(codec.decode(meta, data, out=out).cpu(), codec.decode(meta, data))
    for bad in (float("nan"), float("inf")):
        y = x.clone().cuda()
        if y.numel():
            y[-1] = bad
            with pytest.raises(Malformed, match="non-finite"):
                codec.encode(y)


# --- decode validation ----------------------------------------------------------------------------------


def encoded(name: str, n: int = 1000) -> tuple[dict, bytes]:
    meta, data = get_codec(name).encode(gaussian(n))
    return meta, bytes(data)  # (a read-only view of the encoder's own buffer: bytes, to edit it here)


@pytest.mark.parametrize("name", OURS)
def test_a_payload_is_its_own_buffer_never_a_view_of_the_tensor_encoded(name: str) -> None:
    x = gaussian(1000)
    meta, data = get_codec(name).encode(x)
    before = bytes(data)
    x.fill_(7.0)  # the caller reuses its buffer (a pooled work buffer) right after encoding
    assert bytes(data) == before and memoryview(data).readonly


@pytest.mark.parametrize("name", OURS)
def test_decode_rejects_payload_of_wrong_length(name: str) -> None:
    meta, data = encoded(name)
    for bad in (data[:-1], data + b"\0", b""):
        with pytest.raises(Malformed, match="bytes"):
            get_codec(name).decode(meta, bad)


def test_int8_decode_rejects_payload_of_wrong_length() -> None:
    meta, data = encoded("int8")
    with pytest.raises(Malformed, match=f"needs exactly {len(data)}"):
        get_codec("int8").decode(meta, data[:-4])


@pytest.mark.parametrize("name", OURS)
def test_decode_rejects_meta_naming_another_codec(name: str) -> None:
    meta, data = encoded(name)
    with pytest.raises(Malformed, match="codec"):
        get_codec(name).decode({**meta, "codec": "fp32" if name != "fp32" else "fp16"}, data)


@pytest.mark.parametrize("shape", [None, "10", [10.0], [-1], [True], [[10]], {"a": 1}, [1] * 33])
def test_decode_rejects_shape_that_is_not_a_list_of_non_negative_ints(shape: object) -> None:
    with pytest.raises(Malformed):
        get_codec("fp32").decode({"codec": "fp32", "shape": shape}, b"\0" * 40)


def test_decode_enforces_max_elements_before_reading_the_payload() -> None:
    meta, data = encoded("int8", 1000)
    get_codec("int8").decode(meta, data, max_elements=1000)
    with pytest.raises(TooLarge):
        get_codec("int8").decode(meta, data, max_elements=999)
    with pytest.raises(TooLarge):
        get_codec("int8").decode({**meta, "shape": [2**40, 2**40]}, data)
    assert TooLarge("x").status == 413


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("block", [0, -2, 2**21, 3.0, "64", None, True])
def test_blockwise_decode_rejects_block_outside_the_allowed_range(name: str, block: object) -> None:
    meta, data = encoded(name)
    with pytest.raises(Malformed, match="block"):
        get_codec(name).decode({**meta, "block": block}, data)


def test_int4_decode_rejects_odd_block() -> None:
    meta, data = encoded("int4")
    with pytest.raises(Malformed, match="even"):
        get_codec("int4").decode({**meta, "block": 127}, data)


@pytest.mark.parametrize("scale", [math.nan, math.inf, -1.0, 3e38])
def test_int8_decode_rejects_non_finite_negative_or_overflowing_scales(scale: float) -> None:
    meta, data = encoded("int8")
    forged = np.float32(scale).tobytes() + data[4:]
    with pytest.raises(Malformed, match="scales"):
        get_codec("int8").decode(meta, forged)


def test_int8_decode_rejects_code_minus_128() -> None:
    meta, data = encoded("int8")
    with pytest.raises(Malformed, match="-128"):
        get_codec("int8").decode(meta, data[:-1] + b"\x80")


@pytest.mark.parametrize("bits", [0x7F80, 0x7FC0, 0xFF80, 0x8001])
def test_int4_decode_rejects_non_finite_or_negative_scales(bits: int) -> None:
    meta, data = encoded("int4")
    with pytest.raises(Malformed, match="scales"):
        get_codec("int4").decode(meta, bits.to_bytes(2, "little") + data[2:])


def test_int4_decode_rejects_nonzero_padding_nibble() -> None:
    meta, data = encoded("int4", 999)
    assert data[-1] >> 4 == 0
    with pytest.raises(Malformed, match="nibble"):
        get_codec("int4").decode(meta, data[:-1] + bytes([data[-1] | 0x10]))


@pytest.mark.parametrize(
    ("name", "bad"), [("fp32", b"\0\0\x80\x7f"), ("fp16", b"\0\x7c"), ("bf16", b"\xc0\x7f")]
)
def test_float_decode_rejects_non_finite_payload_values(name: str, bad: bytes) -> None:
    meta, data = encoded(name, 10)
    with pytest.raises(Malformed, match="non-finite"):
        get_codec(name).decode(meta, data[: -len(bad)] + bad)


# --- registry -------------------------------------------------------------------------------------------


def test_get_codec_names_the_known_codecs_when_asked_for_an_unknown_one() -> None:
    assert set(OURS) <= set(available_codecs())
    with pytest.raises(Malformed, match="unknown codec 'zstd'; known: .*int4.*int8"):
        get_codec("zstd")
    with pytest.raises(Malformed):
        get_codec(7)  # type: ignore[arg-type]


def test_register_codec_makes_a_new_codec_available_by_name() -> None:
    @register_codec
    class Int8Block64(Int8Codec):
        name = "test_int8_b64"

        def __init__(self) -> None:
            super().__init__(block=64)

    codec = get_codec("test_int8_b64")
    assert isinstance(codec, Codec) and codec.block == 64
    assert rel_l2(roundtrip("test_int8_b64", gaussian(640)), gaussian(640)) < 0.01


def test_codec_sources_never_use_pickle() -> None:
    root = Path(__file__).resolve().parents[1] / "protocol"
    for name in ("codecs.py", "_kernels.py", "hivemind_codecs.py"):
        assert "pickle" not in (root / name).read_text().replace("never unpickle", "")


# --- error feedback -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["int4", "int8"])
def test_error_feedback_sum_of_decoded_tracks_sum_of_inputs(name: str) -> None:
    codec = get_codec(name)
    feedback = ErrorFeedback(codec)
    sum_in, sum_ef, sum_plain = torch.zeros(4096), torch.zeros(4096), torch.zeros(4096)
    step_error = 0.0
    for step in range(200):
        x = gaussian(4096, seed=step) * 0.01 + 0.001  # small bias: plain quantization errors add up
        sum_in += x
        sum_ef += codec.decode(*feedback.encode("w", x))
        plain = codec.decode(*codec.encode(x))
        step_error = max(step_error, (plain - x).norm().item())
        sum_plain += plain
        assert torch.allclose(sum_in - sum_ef, feedback.residual("w"), atol=1e-5)
    assert (sum_in - sum_ef).norm() <= 2 * step_error  # bounded, not growing with steps
    assert (sum_in - sum_ef).norm() < (sum_in - sum_plain).norm() / 5


def test_error_feedback_keeps_keys_apart_never_writes_the_input_and_resets() -> None:
    feedback = ErrorFeedback("int4")
    x = gaussian(256)
    before = x.clone()
    feedback.encode("a", x)
    assert torch.equal(x, before)
    assert feedback.residual("a") is not None and feedback.residual("b") is None
    feedback.encode("b", x.view(16, 16))
    feedback.reset("a")
    assert feedback.residual("a") is None and feedback.residual("b").shape == (16, 16)
    with pytest.raises(ValueError, match="shape"):
        feedback.encode("b", x)
    feedback.reset()
    assert feedback.residual("b") is None


# --- property tests: decode never fails with anything but a ProtocolError -------------------------------


ALL = OURS + hivemind_names()
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def decode_or_protocol_error(name: str, meta: object, data: bytes, max_elements: int = 10_000) -> None:
    try:
        y = get_codec(name).decode(meta, data, max_elements=max_elements)  # type: ignore[arg-type]
    except ProtocolError:
        return
    assert y.dtype == torch.float32 and list(y.shape) == list(meta["shape"])  # type: ignore[index]
    assert y.numel() <= max_elements and bool(torch.isfinite(y).all())


@FUZZ
@given(name=st.sampled_from(ALL), shape=st.lists(st.integers(0, 40), max_size=3), data=st.binary(max_size=3000),
       block=st.integers(-4, 300))  # fmt: skip
def test_random_payload_with_plausible_meta_only_raises_protocol_errors(name, shape, data, block) -> None:
    decode_or_protocol_error(name, {"codec": name, "shape": shape, "block": block}, data)


@FUZZ
@given(name=st.sampled_from(ALL), meta=st.dictionaries(st.sampled_from(["codec", "shape", "block", "x"]),
       msgpack_values, max_size=4), data=st.binary(max_size=600))  # fmt: skip
def test_random_meta_only_raises_protocol_errors(name, meta, data) -> None:
    decode_or_protocol_error(name, meta, data)


@FUZZ
@given(name=st.sampled_from(ALL), n=st.integers(0, 300), key=st.sampled_from(["shape", "block", "codec"]),
       value=msgpack_values, flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=4))  # fmt: skip
def test_mutated_meta_or_flipped_payload_bytes_only_raise_protocol_errors(name, n, key, value, flips) -> None:
    meta, data = get_codec(name).encode(gaussian(n, seed=n))
    payload = bytearray(data)
    for at, mask in flips:
        if payload:
            payload[at % len(payload)] ^= mask
    decode_or_protocol_error(name, meta, bytes(payload))
    decode_or_protocol_error(name, {**meta, key: value}, data)


NF4_HALF_GAP = float(np.diff(Int4Codec.levels).max() / 2)


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(-1e6, 1e6, width=32), max_size=300), name=st.sampled_from(OURS))
def test_roundtrip_of_arbitrary_finite_values_stays_within_the_codec_error_rule(values, name) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    y = roundtrip(name, x)
    if name in ("fp32", "fp16", "bf16"):
        narrow = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
        assert torch.equal(
            y, x.clamp(-65504, 65504).to(narrow).float() if name == "fp16" else x.to(narrow).float()
        )
        return
    codec = get_codec(name)
    blocks = torch.nn.functional.pad(x, (0, -len(x) % codec.block)).view(-1, codec.block)
    absmax = blocks.abs().amax(1, keepdim=True).expand_as(blocks).reshape(-1)[: len(x)]
    step = absmax / 254 if name == "int8" else absmax * NF4_HALF_GAP * (1 + 2**-7)
    assert ((y - x).abs() <= step * (1 + 1e-5) + 1e-37).all()  # + 1e-37: subnormal scales lose bits


# --- the hivemind adapter -------------------------------------------------------------------------------


def test_hivemind_adapter_speaks_hivemind_protobuf_both_ways() -> None:
    pytest.importorskip("hivemind")
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.proto import runtime_pb2

    x = gaussian(10_000).view(100, 100)
    kinds = {"hivemind_fp16": runtime_pb2.FLOAT16, "hivemind_blockwise8": runtime_pb2.BLOCKWISE_8BIT,
             "hivemind_uniform8": runtime_pb2.UNIFORM_8BIT}  # fmt: skip
    for name, kind in kinds.items():
        codec = get_codec(name)
        meta, data = codec.encode(x)
        assert data == serialize_torch_tensor(x, kind).SerializeToString()
        theirs = deserialize_torch_tensor(runtime_pb2.Tensor.FromString(data))
        assert torch.equal(codec.decode(meta, data), theirs)
        assert rel_l2(theirs, x) < 0.05
        assert abs(len(data) - codec.encoded_size(x.numel())) <= 4


def test_hivemind_adapter_rejects_forged_codebook_size() -> None:
    pytest.importorskip("hivemind")
    from hivemind.proto import runtime_pb2

    meta, data = get_codec("hivemind_uniform8").encode(gaussian(100))
    proto = runtime_pb2.Tensor.FromString(data)
    proto.buffer = (10**6).to_bytes(8, "little") + proto.buffer[8:]
    with pytest.raises(Malformed, match="codebook"):
        get_codec("hivemind_uniform8").decode(meta, proto.SerializeToString())
    with pytest.raises(Malformed, match="protobuf"):
        get_codec("hivemind_uniform8").decode(meta, b"\xff" * 50)


def test_int4_codec_constructor_refuses_odd_block() -> None:
    with pytest.raises(ValueError):
        Int4Codec(block=33)


def test_l2_norm_sums_in_float64_and_keeps_non_finite_values():
    from diloco.protocol.codecs import l2_norm

    g = torch.Generator().manual_seed(3)
    for n in (0, 1, 7, 8, 9, 1001):
        x = torch.randn(n, generator=g)
        assert l2_norm(x) == pytest.approx(torch.linalg.vector_norm(x.double()).item(), rel=1e-12)
    x = torch.randn(1000, generator=g)
    for scale in (1e30, 1e-30):  # fp32 squares would overflow or underflow
        assert l2_norm(x * scale) == pytest.approx(torch.linalg.vector_norm((x * scale).double()).item(), rel=1e-6)
    assert math.isnan(l2_norm(torch.tensor([1.0, float("nan")])))
    assert l2_norm(torch.tensor([1.0, float("-inf")])) == float("inf")
    assert l2_norm(torch.tensor([3.0, 4.0], dtype=torch.float64)) == 5.0  # other dtypes: torch's fp64 norm


@pytest.mark.skipif(importlib.util.find_spec("scipy") is None, reason="scipy is not installed")
def test_loading_the_kernels_does_not_import_scipy_linalg_and_leaves_it_importable():
    """A fresh interpreter: numba's runtime starts inside `load_kernels`, not earlier."""
    script = (
        "import sys, torch\n"
        "from diloco.protocol.codecs import load_kernels\n"
        "load_kernels()\n"
        "assert 'scipy.linalg' not in sys.modules, 'scipy.linalg was imported'\n"
        "assert 'scipy.linalg.cython_blas' not in sys.modules, 'the blocking entry was left behind'\n"
        "import scipy.linalg.cython_blas\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
