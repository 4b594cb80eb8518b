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
def use_isa(name: str, /) -> str: ...
