"""The closed list of tensor dtypes a cache file may hold: the one table of them.

Each dtype has its header name (MLX's), its item size, the ``mlx.core`` attribute of its
MLX dtype and the ``numpy`` attribute of the element type its bytes are carried as.
:data:`kvtrio.storage.format.DTYPE_SIZES` (header validation) and the MLX and numpy
tables of :mod:`kvtrio.storage.hostbuffers` derive from :data:`DTYPES`. This module
imports neither MLX nor numpy, so the CPU side of storage stays light.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import attrs

__all__ = ["DTYPES", "DTYPES_BY_NAME", "DType"]


@attrs.frozen
class DType:
    """One dtype of the closed list: header name, item size, MLX and numpy attribute names."""

    name: str
    itemsize: int
    mlx_attr: str
    numpy_attr: str


DTYPES: Final[tuple[DType, ...]] = (
    DType("bool", 1, "bool_", "bool_"),
    DType("uint8", 1, "uint8", "uint8"),
    DType("uint16", 2, "uint16", "uint16"),
    DType("uint32", 4, "uint32", "uint32"),
    DType("uint64", 8, "uint64", "uint64"),
    DType("int8", 1, "int8", "int8"),
    DType("int16", 2, "int16", "int16"),
    DType("int32", 4, "int32", "int32"),
    DType("int64", 8, "int64", "int64"),
    DType("float16", 2, "float16", "float16"),
    # numpy has no bfloat16: carry the bits as uint16, then view them in MLX.
    DType("bfloat16", 2, "bfloat16", "uint16"),
    DType("float32", 4, "float32", "float32"),
    DType("float64", 8, "float64", "float64"),
    DType("complex64", 8, "complex64", "complex64"),
)

#: :data:`DTYPES` by header name.
DTYPES_BY_NAME: Final[Mapping[str, DType]] = {d.name: d for d in DTYPES}
