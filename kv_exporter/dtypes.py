"""dtype names and element sizes, without importing torch.

A declaration may carry a `torch.dtype` (vllm-omni's own specs do) or a plain name, so that it can be built and read
where torch is absent (the sidecar). Everything downstream works on the canonical name.
"""

from __future__ import annotations

# Canonical name -> bytes per element. Only dtypes a KV cache is stored in.
ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int8": 1,
    "uint8": 1,
}

# torch's aliases for the same dtypes.
_ALIASES: dict[str, str] = {"double": "float64", "float": "float32", "half": "float16"}


class UnknownDTypeError(ValueError):
    """The dtype is not one a KV cache is known to be stored in."""


def dtype_name(dtype: object) -> str:
    """Canonical name of a torch dtype (`torch.float32`) or of a name (`"float32"`, `"torch.half"`)."""
    text = dtype if isinstance(dtype, str) else str(dtype)
    name = text.strip().removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in ITEMSIZE:
        raise UnknownDTypeError(f"unknown KV dtype {dtype!r}; known: {', '.join(sorted(ITEMSIZE))}")
    return name


def dtype_problem(text: str) -> str:
    """Why `text` is not a canonical dtype name, for a reader that wants exactly the canonical names."""
    try:
        canonical = dtype_name(text)
    except UnknownDTypeError as exc:
        return str(exc)
    return f"dtype {text!r} is not canonical ({canonical!r})"


def dtype_itemsize(dtype: object) -> int:
    """Bytes per element of `dtype` (a torch dtype or a name)."""
    return ITEMSIZE[dtype_name(dtype)]
