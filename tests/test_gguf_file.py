"""Our GGUF reader (chunkserve/gguf_file.py) against the `gguf` package's: the same fields,
values and tensors, on a file holding every value type and several tensor types, and on the
default model's file."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from chunkserve.gguf_file import GGUFFile


def _same(path: str, nested: tuple[str, ...] = ()) -> GGUFFile:
    """`nested`: arrays of arrays, which the package's contents() flattens (we keep them)."""
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(fields)
    for key, field in fields.items():
        if key in nested:
            continue
        got, want = ours.fields[key].contents(), field.contents()
        assert type(got) is type(want) and got == want, key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape.tolist()) == (b.name, b.tensor_type, b.shape.tolist())
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
    return ours


def test_every_value_type_and_tensor_type(tmp_path) -> None:
    path = str(tmp_path / "all.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 2**32 - 1)
    w.add_int32("t.i32", -(2**31))
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**40))
    w.add_float32("t.f32", 0.1)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strs", ["a", "", "ü" * 40])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    q = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("q8", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = _same(path, nested=("t.nested",))
    assert ours.fields["t.nested"].contents() == [[1, 2], [3]]


def test_the_default_model_file(smollm2_path: str) -> None:
    _same(smollm2_path)


def test_not_a_gguf_file(tmp_path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(path))
