"""workbench.dtypes: bytes per element and Triton type names of torch dtypes."""
import pytest
import torch

from workbench.dtypes import element_size, triton_pointer, triton_type


@pytest.mark.parametrize("dtype,name,size", [
    (torch.float16, "fp16", 2), (torch.bfloat16, "bf16", 2), (torch.float32, "fp32", 4),
    (torch.float64, "fp64", 8), (torch.float8_e4m3fn, "fp8e4nv", 1), (torch.float8_e5m2, "fp8e5", 1),
    (torch.int8, "i8", 1), (torch.uint8, "u8", 1), (torch.int16, "i16", 2), (torch.int32, "i32", 4),
    (torch.int64, "i64", 8), (torch.bool, "u1", 1),
])
def test_names_and_sizes(dtype, name, size):
    assert triton_type(dtype) == name and triton_pointer(dtype) == "*" + name
    assert element_size(dtype) == size == torch.empty((), dtype=dtype).element_size()


def test_same_names_as_triton():
    from triton._utils import canonicalize_dtype  # Triton's own table (private: the test breaks, not the code)

    from workbench.dtypes import _TRITON_NAMES

    for name, ty in _TRITON_NAMES.items():
        assert canonicalize_dtype(getattr(torch, name)) == ty, name


def test_errors():
    with pytest.raises(ValueError, match="complex64: no Triton type"):
        triton_type(torch.complex64)
    with pytest.raises(TypeError, match="expected a torch.dtype"):
        element_size("fp16")
