"""The packed device state of the CUDA backends: one small buffer per state, fields as views.

A :class:`PackedState` owns one 80-byte device buffer laid out as
:func:`ampscale._codegen.state_dtype`: every field of :class:`~ampscale._core.ScalerState`, the
next step's ``inv_scale``, the flags of the step that wrote it, and scratch for the next check.
Each update writes a new buffer (a scaler stays immutable); the public fields are 0-d views of
it, made on first use; reading the whole state is one device-to-host copy.

It reads like a ``ScalerState`` (``state.scale``, iteration in field order, ``_replace``), so code
written against the unpacked state keeps working; ``_replace`` returns a plain ``ScalerState``
of views, which the backends pack again when it comes back to them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ampscale._codegen import STATE_BYTES, state_dtype
from ampscale._core import ScalerState

__all__ = ["EXTRA_FIELDS", "PackedState", "decode", "encode"]

#: the views a packed state offers beyond the ScalerState fields
EXTRA_FIELDS = ("inv_scale", "finite", "loss_finite", "floor_event", "found_inf", "loss_found_inf")
_VIEWS = frozenset(ScalerState._fields) | frozenset(EXTRA_FIELDS)


def encode(values: ScalerState, scale_dtype: str) -> np.ndarray:
    """The 80-byte record of host ``values``: fields, ``inv_scale``, flags set, scratch zero."""
    record = np.zeros(1, state_dtype(scale_dtype))
    for field in ScalerState._fields:
        record[field] = getattr(values, field)
    with np.errstate(divide="ignore", over="ignore"):  # 1/0 and a tiny scale's inverse: inf, as on the GPU
        record["inv_scale"] = np.float32(1.0 / np.float64(record["scale"][0]))
    record["finite"] = record["loss_finite"] = 1
    return record.view(np.uint8)


def decode(raw: np.ndarray, scale_dtype: str) -> ScalerState:
    """The host values of an 80-byte record (the inverse of :func:`encode`)."""
    record = np.asarray(raw).view(np.uint8).reshape(-1)[:STATE_BYTES].view(state_dtype(scale_dtype))[0]
    return ScalerState(
        *(float(record[f]) if f in ("scale", "last_scale") else int(record[f]) for f in ScalerState._fields)
    )


class PackedState:
    """One state in one device buffer (``buffer``, float32 elements), with lazy 0-d field views.

    Attributes:
        buffer: the framework's array holding the record.
        ptr: its device address.
        scale_dtype: ``"float32"`` or ``"float64"``.
        pending: ``(finite, loss_finite, next_state)`` when the next state was already computed
            with the flags a check returned (the one-launch step), so that ``update`` given
            those very flag objects launches nothing.
        scratch_stream: the stream whose launches use this buffer's scratch (``None``: unused).
        stream: the stream current when the buffer was allocated (``None``: unknown); a launch
            on another stream must keep the buffer alive past itself (:meth:`CudaStep.used_on`).
    """

    __slots__ = ("_views", "buffer", "pending", "ptr", "scale_dtype", "scratch_stream", "stream")
    _fields: ClassVar[tuple[str, ...]] = ScalerState._fields

    def __init__(self, buffer: Any, ptr: int, scale_dtype: str, stream: int | None = None) -> None:
        self.buffer = buffer
        self.ptr = ptr
        self.scale_dtype = scale_dtype
        self.stream = stream
        self.pending: tuple[Any, Any, PackedState] | None = None
        self.scratch_stream: int | None = None
        self._views: dict[str, Any] = {}

    def view(self, name: str) -> Any:
        """A 0-d view of one field of the record (made by the backend's :meth:`_make_view`)."""
        made = self._views.get(name)
        if made is None:
            made = self._views[name] = self._make_view(name)
        return made

    def _make_view(self, name: str) -> Any:
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        if name in _VIEWS:
            return self.view(name)
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    def __iter__(self) -> Any:
        return iter([self.view(f) for f in ScalerState._fields])

    def __len__(self) -> int:
        return len(ScalerState._fields)

    def fields(self) -> ScalerState:
        """The fields as a ``ScalerState`` of 0-d views."""
        return ScalerState(*self)

    def _replace(self, **changes: Any) -> ScalerState:
        return self.fields()._replace(**changes)

    def claim_scratch(self, stream: int) -> bool:
        """Whether a check on ``stream`` may use this buffer's scratch (else it needs fresh scratch).

        The first check claims it for its stream; a launch that reads the flags resets them at
        its end, so later checks on the same stream reuse it in stream order.
        """
        if self.scratch_stream is None or self.scratch_stream == stream:
            self.scratch_stream = stream
            return True
        return False


def offset_of(name: str, scale_dtype: str) -> tuple[int, str]:
    """``(byte offset, numpy dtype name)`` of a field of the record."""
    fields = state_dtype(scale_dtype).fields
    assert fields is not None
    dtype, offset = fields[name][:2]
    return offset, np.dtype(dtype).name


# Flag kinds of ampscale_update (see kernels.cu): true, a bool byte, a float32 found_inf, false,
# a bool byte that says "not finite" (the drop-in GradScaler's loss flag)
FLAG_TRUE, FLAG_BOOL, FLAG_FOUND_INF, FLAG_FALSE, FLAG_BAD_BOOL = 0, 1, 2, 3, 4


class CudaStep:
    """The one-launch step and the one-thread update, over a framework's arrays and streams.

    A backend mixes this in and supplies the framework's pieces: a new record buffer, the
    current stream, a device table of chunks, and what a flag is. The launch logic is shared.
    """

    def new_record(self, like: PackedState, zero: bool = False) -> PackedState:
        """A new record on ``like``'s device (contents undefined unless ``zero``)."""
        raise NotImplementedError

    def current_stream(self, state: PackedState) -> int:
        """The framework's current stream on ``state``'s device, as a ``CUstream`` value."""
        raise NotImplementedError

    def flag_argument(self, flag: Any, state: PackedState) -> tuple[int, int, Any]:
        """``(pointer, kind, keep)`` for a flag passed to ``update`` (``keep``: an object to hold
        alive until the launch is queued)."""
        raise NotImplementedError

    def keep_for_stream(self, buffers: tuple[Any, ...], stream: int) -> None:
        """Keep ``buffers`` (allocated on another stream) alive until ``stream`` has run the
        launch just queued on it: torch's ``record_stream``, or CuPy holding them until an event."""
        raise NotImplementedError

    def used_on(self, stream: int, *records: PackedState | None) -> None:
        """Records read or written by a launch on ``stream``: those allocated on another stream
        are kept alive past the launch (a caching allocator would otherwise reuse a dropped
        record on its own stream while this one still reads it). Same stream: nothing to do."""
        foreign = tuple(r.buffer for r in records if r is not None and r.stream != stream)
        if foreign:
            self.keep_for_stream(foreign, stream)

    def scratch_for(self, state: PackedState, stream: int) -> PackedState:
        """The record whose scratch a check on ``stream`` writes: the state's own, or fresh zeros."""
        return state if state.claim_scratch(stream) else self.new_record(state, zero=True)

    def launch_update(
        self,
        module: Any,
        state: PackedState,
        stream: int,
        finite: tuple[int, int],
        loss_finite: tuple[int, int],
        scratch: PackedState | None = None,
    ) -> PackedState:
        """Queue ``ampscale_update``: the next state for flags already on the device."""
        nxt = self.new_record(state)
        module.launch(
            module.update,
            module.context,
            1,
            1,
            stream,
            state.ptr,
            nxt.ptr,
            finite[0],
            finite[1],
            loss_finite[0],
            loss_finite[1],
            0 if scratch is None else scratch.ptr,
        )
        self.used_on(stream, state, scratch)
        return nxt

    def update_packed(self, module: Any, state: PackedState, finite: Any, loss_finite: Any) -> PackedState:
        """The next state for ``update(finite, loss_finite=...)``: the one computed with the very
        flags a one-launch check returned, or one ``ampscale_update`` launch for any other flag."""
        pending = state.pending
        if pending is not None and pending[0] is finite and pending[1] is loss_finite:
            return pending[2]
        f_ptr, f_kind, _keep_f = self.flag_argument(finite, state)
        if loss_finite is None:
            l_ptr, l_kind, _keep_l = 0, FLAG_TRUE, None
        else:
            l_ptr, l_kind, _keep_l = self.flag_argument(loss_finite, state)
        return self.launch_update(module, state, self.current_stream(state), (f_ptr, f_kind), (l_ptr, l_kind))
