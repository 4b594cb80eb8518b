"""Render the presets table of docs/presets.md from ampscale.PRESETS (a test keeps them equal)."""

from __future__ import annotations

import math

import ampscale


def _num(value: float | None, dtype: str = "float32") -> str:
    if value is None:
        return "none"
    if dtype == "float64" and value == ampscale._config.FLOAT64_TINY:
        return "f64 tiny"
    if dtype == "float64" and value == ampscale._config.FLOAT64_MAX:
        return "f64 max"
    if value == ampscale._config.FLOAT32_MAX:
        return "f32 max"
    if value == ampscale._config.FLOAT32_TINY:
        return "f32 tiny"
    if value > 0 and math.log2(value).is_integer() and abs(math.log2(value)) >= 4:
        return f"2^{int(math.log2(value))}"
    return f"{value:g}"


def rows() -> list[str]:
    out = [
        "| preset | reproduces | init | growth / backoff | grows on finite step | hysteresis | floor | ceiling "
        "| counter | scale dtype | at floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, preset in ampscale.PRESETS.items():
        c = ampscale.create_scaler(preset=name).config
        backoff = f"/{c.growth_factor:g}" if c.backoff_rule == "divide" else f"x{c.backoff_factor:g}"
        if c.first_growth_delay:
            grows = f"{c.growth_interval + 1}, then every {c.growth_interval}"
        else:
            grows = f"every {c.interval}" if c.interval_offset else f"every {c.growth_interval}"
        if c.hysteresis == 1:
            hyst = "1"
        else:
            hyst = f"{c.hysteresis} ({c.hysteresis_mode})"
        dtype = c.scale_dtype
        ceiling = "skip if not finite" if c.ceiling == "skip" else f"clamp to {_num(c.max_value, dtype)}"
        if c.ceiling == "skip" and c.max_scale is not None:
            ceiling = f"skip above {_num(c.max_scale)}"
        floor = _num(c.min_scale) if c.min_scale is not None else f"{_num(c.min_value, dtype)} (none)"
        out.append(
            f"| `{name}` | {preset.system} | {_num(c.init_scale)} | x{c.growth_factor:g} / {backoff} | {grows} "
            f"| {hyst} | {floor} | {ceiling} | {c.counter_rule} | {c.scale_dtype} "
            f"| {c.on_floor} |"
        )
    return out


if __name__ == "__main__":
    print("\n".join(rows()))
