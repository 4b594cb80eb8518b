from collections.abc import Sequence
from typing import Any

KIND_FLOAT16: int
KIND_BFLOAT16: int
KIND_FLOAT32: int
KIND_FLOAT64: int
PARALLEL_THRESHOLD: int

def check_and_unscale(
    arrays: Sequence[Any], kind: int, inv_scale: float, multiply: bool, threads: int, count_tiny: bool = ..., /
) -> Any: ...
def check_and_unscale_at(
    addresses: list[int], counts: list[int], kind: int, inv_scale: float, multiply: bool, threads: int, /
) -> bool: ...
def check_and_unscale_tensors(
    tensors: list[Any], types: tuple[type, ...], api: Any, inv_scale: Any, multiply: bool, threads: int, /
) -> bool | None: ...
def tensor_kind(tensors: list[Any], types: tuple[type, ...], api: Any, /) -> int | None: ...
def use_isa(name: str, /) -> str: ...
