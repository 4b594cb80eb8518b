"""The FP8 scaler: a thin immutable wrapper over an :class:`Fp8Config` and an :class:`Fp8State`.

``update`` runs :func:`~ampscale.fp8._transition.slot_transition` once over every slot, with the
operations of the framework that holds the state (NumPy, JAX, torch, CuPy): no host read, so it
runs inside ``jax.jit`` / ``lax.scan`` / ``vmap`` and asynchronously on GPUs. Only the methods
whose names end in ``_sync`` (and ``state_dict``) read values back to the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ampscale._config import shown
from ampscale.fp8 import _cuda
from ampscale.fp8._cast import dequantize_as, quantize_as, tensor_amax
from ampscale.fp8._config import Fp8Config, make_fp8_config
from ampscale.fp8._distributed import UNSET, check_group, reduce_amax, resolve_group
from ampscale.fp8._ops import Fp8ArrayOps, framework_of, make_ops, namespace_of
from ampscale.fp8._transition import Fp8State, in_warmup, initial_state_values, warmup_scale
from ampscale.fp8._update import canonical_history, check_step_ok, device_of, ops_of
from ampscale.fp8._update import update_state as array_update_state

__all__ = ["BACKENDS", "Fp8Scaler", "create_fp8_scaler", "init_state", "update_state"]

BACKENDS = ("numpy", "jax", "torch", "cupy")


def update_state(
    config: Fp8Config, state: Fp8State, amax: Any, step_ok: Any = True, donate: bool = False
) -> tuple[Fp8State, Any]:
    """The pure update: ``(next_state, updated)`` for ``[N]`` float32 ``amax`` of the state's framework.

    ``updated`` is an ``[N]`` bool array: the slots whose scale was recomputed this step. On
    CuPy and on torch's CUDA tensors: one launch of the emitted C transition
    (:mod:`ampscale.fp8._cuda`); elsewhere, and where that kernel cannot be built, the
    transition's array operations. No host read either way. ``donate=True`` gives ``state`` up:
    its history buffer (on CUDA, every field) is written in place instead of copied.

    Raises:
        TypeError, ValueError: ``step_ok`` is not a bool or a 0-d bool array; nothing changes.
    """
    framework = framework_of(state.scale)
    if framework == "cupy" or (framework == "torch" and _cuda.is_torch_cuda(state.scale)):
        check_step_ok(step_ok, framework)
        update = _cuda.update_cupy if framework == "cupy" else _cuda.update_torch
        fast = update(config, state, amax, step_ok, donate=donate)
        if fast is not None:
            return fast
    return array_update_state(config, state, amax, step_ok, donate=donate)


def _namespace_backend(backend: Any) -> Any:
    """The array-API namespace ``backend`` names (a module, or the name of one already
    imported), or ``None``."""
    if isinstance(backend, str):
        import sys

        backend = sys.modules.get(backend)
    if backend is not None and hasattr(backend, "asarray") and hasattr(backend, "__array_api_version__"):
        return backend
    return None


def init_state(config: Fp8Config, backend: Any = "numpy", device: Any = None) -> Fp8State:
    """The initial state of ``config`` as arrays of ``backend`` (on ``device`` for torch).

    ``backend``: ``"numpy"``, ``"jax"``, ``"torch"``, ``"cupy"``, or an array-API namespace
    (``array_api_strict``, or its name once imported): the update then uses the standard's
    functions only.
    """
    namespace = None
    if backend not in BACKENDS:
        namespace = _namespace_backend(backend)
        if namespace is None:
            raise ValueError(
                f"backend must be one of {list(BACKENDS)} or an array-API namespace (a module with "
                f"__array_api_version__, or the name of one already imported); got {shown(backend)}"
            )
        backend = "array_api"
    if backend == "jax":
        ensure_jax_pytree()
    ops = make_ops(backend, device=device, xp=namespace)
    values = initial_state_values(config)
    n, length = config.size, config.history_len
    return Fp8State(
        scale=ops.new_array([values["scale"]] * n, "float32"),
        scale_inv=ops.new_array([values["scale_inv"]] * n, "float32"),
        history=ops.new_array([[values["history"]] * length for _ in range(n)], "float32"),
        filled=ops.new_array([0] * n, "int32"),
        zero_amax=ops.new_array([0] * n, "int32"),
        nonfinite=ops.new_array([0] * n, "int32"),
        steps=ops.new_array(0, "int32"),
        head=ops.new_array([0] * n, "int32"),
    )


class Fp8Scaler:
    """Per-tensor FP8 scales for ``N`` slots, with the history and rules of one preset.

    Immutable: :meth:`update` returns the next scaler. Build one with :func:`create_fp8_scaler`.

    Attributes:
        config: the static settings (a hashable :class:`Fp8Config`).
        state: the arrays (a :class:`Fp8State`).
    """

    __slots__ = ("config", "state")

    def __init__(self, config: Fp8Config, state: Fp8State) -> None:
        self.config = config
        self.state = state

    def __repr__(self) -> str:
        c = self.config
        return f"Fp8Scaler(preset={c.preset!r}, slots={len(c.slots)}, history_len={c.history_len})"

    @property
    def framework(self) -> str:
        """The framework holding the state."""
        return framework_of(self.state.scale)

    def index(self, slot: str | int) -> int:
        """The position of ``slot`` (a name or a position).

        Raises:
            KeyError: an unknown slot (the message lists the slots).
        """
        names = self.config.slots
        if isinstance(slot, int) and not isinstance(slot, bool):
            if 0 <= slot < len(names):
                return slot
        elif isinstance(slot, str) and slot in names:
            return names.index(slot)
        raise KeyError(f"slot must be one of {list(names)} (or a position 0 to {len(names) - 1}); got {shown(slot)}")

    def format_of(self, slot: str | int) -> str:
        """The FP8 format of ``slot``."""
        return self.config.slot_formats[self.index(slot)]

    # ------------------------------------------------------------------ the update

    def _amax_vector(self, amax: Any) -> Any:
        """``amax`` as an ``[N]`` float32 array of the state's framework, checked before use."""
        c = self.config
        framework = self.framework
        ops = ops_of(c, self.state.scale)
        if isinstance(amax, Mapping):
            unknown = [k for k in amax if k not in c.slots]
            if unknown:
                raise KeyError(f"amax has unknown slot(s) {unknown}; the slots are {list(c.slots)}")
            missing = [k for k in c.slots if k not in amax]
            if missing:
                raise ValueError(f"amax misses slot(s) {missing}: give every slot's amax (0 if it did not run)")
            amax = [amax[k] for k in c.slots]
        if isinstance(amax, Sequence) and not hasattr(amax, "shape"):
            if len(amax) != c.size:
                raise ValueError(f"amax must hold {c.size} values (one per slot); got {len(amax)}")
            parts = [self._scalar(a, ops, framework) for a in amax]
            return ops.xp.stack(parts)
        shape = tuple(getattr(amax, "shape", ()))
        if shape != (c.size,):
            raise ValueError(f"amax must have shape ({c.size},) (one value per slot); got shape {shape}")
        if framework_of(amax) != framework or namespace_of(amax) is not namespace_of(self.state.scale):
            raise TypeError(f"amax must be a {framework} array like the state; got {type(amax).__name__}")
        return self._as_f32(amax, framework)

    @staticmethod
    def _as_f32(a: Any, framework: str) -> Any:
        if framework == "torch":
            import torch

            return a.to(torch.float32)
        if framework == "array_api":
            xp = a.__array_namespace__()
            return xp.astype(a, xp.float32)
        return a.astype(np.float32) if framework != "jax" else a.astype("float32")

    def _scalar(self, a: Any, ops: Fp8ArrayOps, framework: str) -> Any:
        if hasattr(a, "shape"):
            if tuple(a.shape) not in ((), (1,)):
                raise ValueError(f"each amax must be a scalar; got shape {tuple(a.shape)}")
            flat = ops.xp.reshape(a, ()) if framework == "array_api" else a.reshape(())
            return self._as_f32(flat, framework)
        if isinstance(a, bool) or not isinstance(a, (int, float, np.floating, np.integer)):
            raise TypeError(f"each amax must be a number or a 0-d array; got {type(a).__name__}")
        if framework == "torch":
            return ops.xp.tensor(float(a), dtype=ops.xp.float32, device=ops.device)
        return ops.xp.asarray(float(a), dtype=ops.xp.float32)

    def update(self, amax: Any, step_ok: Any = True, *, group: Any = UNSET, donate: bool = False) -> Fp8Scaler:
        """The scaler after one optimizer step whose amaxes were ``amax``.

        Args:
            amax: ``[N]`` float32 array of the state's framework (max over micro-batches: see
                :func:`ampscale.fp8.combine_amax`), a list of N values, or a dict slot -> value.
            step_ok: whether the loss scaler applied this step (a bool or 0-d bool array; the
                ``finite`` of ``Scaler.unscale``). With ``on_skipped_step="freeze"`` a skipped
                step changes no scale and no history.
            group: the ranks or devices whose amaxes are reduced (max, nan kept) before the
                update, in one collective (see :func:`ampscale.fp8.reduce_amax`): a torch
                process group or ``"world"``, JAX axis name(s), a CuPy NCCL communicator, a
                callable, or ``None`` (this rank's own). Required while ``torch.distributed``
                runs with several ranks or the amaxes vary over mapped JAX axes.
            donate: give this scaler's state up, so that NumPy, torch and CuPy write the one
                new amax per slot into its history buffer instead of copying ``[N, L]``
                values; this scaler must not be used afterwards.

        Raises:
            ValueError, KeyError, TypeError: ``amax`` of the wrong shape, framework or slots,
                a ``step_ok`` that is not a bool, or a distributed run without ``group``; nothing
                is changed.
        """
        vector = self._amax_vector(amax)
        group = resolve_group(group, vector)
        check_group(group, self.framework)
        if group is not None:
            vector = reduce_amax(vector, group)
        state, _updated = update_state(self.config, self.state, vector, step_ok, donate=donate)
        return Fp8Scaler(self.config, state)

    # ------------------------------------------------------------------ casts

    def scale(self, slot: str | int) -> Any:
        """The quantization scale of ``slot`` (a 0-d array on the state's device)."""
        return self.state.scale[self.index(slot)]

    def scale_inv(self, slot: str | int) -> Any:
        """The dequantization scale of ``slot`` (a 0-d array)."""
        return self.state.scale_inv[self.index(slot)]

    def _cast_scales(self, k: int, amax: Any) -> tuple[Any, Any]:
        """The ``(scale, scale_inv)`` a cast of slot ``k`` uses: the state's, or in a warm-up
        (torchao's first cast, MS-AMP's in-time scaling) the rule applied to ``amax``."""
        c = self.config
        scale, scale_inv = self.state.scale[k], self.state.scale_inv[k]
        if c.warmup == "none":
            return scale, scale_inv
        ops = ops_of(c, self.state.scale)
        early, early_inv = warmup_scale(c, ops.enter(scale), ops.enter(amax), ops.f32(c.slot_max[k]), ops)
        warm = in_warmup(c, self.state.filled[k], ops)
        return ops.where(warm, ops.leave(early), scale), ops.where(warm, ops.leave(early_inv), scale_inv)

    def quantize(self, x: Any, slot: str | int, compute_dtype: Any = None) -> tuple[Any, Any, Any]:
        """``(q, scale_inv, amax)``: ``x`` saturated into ``slot``'s format, the scale to
        dequantize it with, and ``max(|x|)`` for the next :meth:`update`. Changes no state.

        Cast as the preset's anchor does (the ``cast`` setting); ``compute_dtype`` is the
        dtype flax and Keras divide in (``None``: ``x``'s dtype; the other presets cast in
        float32). In a warm-up (``warmup`` setting) the scale comes from ``amax`` itself.
        """
        k = self.index(slot)
        c = self.config
        amax = tensor_amax(x)
        scale, scale_inv = self._cast_scales(k, amax)
        q = quantize_as(x, scale, scale_inv, c.slot_formats[k], c.cast, compute_dtype)
        return q, scale_inv, amax

    def dequantize(self, q: Any, slot: str | int, dtype: Any = None, compute_dtype: Any = None) -> Any:
        """``q`` back in ``dtype`` (``None``: float32) with ``slot``'s scales, as the preset's
        anchor dequantizes (``q * scale_inv``; torchao ``q / scale``; flax and Keras ``q * S``
        in ``dtype`` or, for Keras, ``compute_dtype``). Uses the state's scales: a cast in a
        warm-up dequantizes with the ``scale_inv`` that :meth:`quantize` returned."""
        k = self.index(slot)
        return dequantize_as(q, self.state.scale[k], self.state.scale_inv[k], self.config.cast, dtype, compute_dtype)

    def qdq(self, x: Any, slot: str | int, compute_dtype: Any = None) -> Any:
        """Fake quantization of ``x`` with ``slot``'s scales, as the preset's anchor does it: in
        ``x``'s dtype (Keras: the compute dtype; torchao rowwise: float32)."""
        k = self.index(slot)
        c = self.config
        scale, scale_inv = self._cast_scales(k, tensor_amax(x) if c.warmup != "none" else None)
        q = quantize_as(x, scale, scale_inv, c.slot_formats[k], c.cast, compute_dtype)
        return dequantize_as(q, scale, scale_inv, c.cast, x.dtype, compute_dtype)

    def history(self, slot: str | int | None = None) -> Any:
        """The amax history, oldest first: ``[N, L]``, or ``[L]`` for one ``slot`` (the
        state's framework and device; the state keeps it as a ring buffer)."""
        ordered = canonical_history(self.state)
        return ordered if slot is None else ordered[self.index(slot)]

    # ------------------------------------------------------------------ host reads

    def scales_sync(self) -> dict[str, float]:
        """Every slot's scale as a Python float (an explicit host read)."""
        values = np.asarray(_to_host(self.state.scale))
        return {name: float(v) for name, v in zip(self.config.slots, values.tolist(), strict=True)}

    def state_dict(self) -> dict[str, Any]:
        """The versioned, JSON-serialisable checkpoint (see :mod:`ampscale.fp8._state_dict`)."""
        from ampscale.fp8._state_dict import to_state_dict

        return to_state_dict(self.config, host_state(self.state))

    def load_state_dict(self, state_dict: Any) -> Fp8Scaler:
        """A scaler with the state of ``state_dict``, on this scaler's framework and device.

        Raises:
            ampscale.StateDictError: the dict is malformed, or its recipe differs from this
                scaler's (the message names every setting that differs); nothing is loaded.
        """
        from ampscale.fp8._state_dict import from_state_dict

        host = from_state_dict(state_dict, self.config)
        scale = self.state.scale
        device = device_of(scale, self.framework)
        return Fp8Scaler(self.config, to_framework(host, self.framework, device, namespace_of(scale)))


def _to_host(array: Any) -> Any:
    framework = framework_of(array)
    if framework == "torch":
        return array.detach().cpu().numpy()
    if framework == "cupy":
        return array.get()
    if framework == "array_api":
        return np.from_dlpack(array)  # the standard's way out (a copy from a device)
    return np.asarray(array)


def host_state(state: Fp8State) -> Fp8State:
    """``state`` as NumPy arrays (a host read); a missing ``head`` (canonical order) as zeros."""
    head = np.zeros(np.shape(_to_host(state.scale)), np.int32) if state.head is None else _to_host(state.head)
    return Fp8State(*(_to_host(field) for field in state[:-1]))._replace(head=head)


def to_framework(state: Fp8State, framework: str, device: Any = None, xp: Any = None) -> Fp8State:
    """NumPy ``state`` as arrays of ``framework`` (on ``device`` for torch; of the namespace
    ``xp`` for ``"array_api"``)."""
    if framework == "array_api":
        return Fp8State(*(xp.asarray(np.array(f)) for f in state))
    if framework == "numpy":
        return Fp8State(*(np.array(f) for f in state))
    if framework == "torch":
        import torch

        return Fp8State(*(torch.from_numpy(np.array(f)).to(device) for f in state))
    if framework == "jax":
        import jax.numpy as jnp

        ensure_jax_pytree()
        return Fp8State(*(jnp.asarray(f) for f in state))
    import cupy

    return Fp8State(*(cupy.asarray(f) for f in state))


def create_fp8_scaler(
    preset: str = "ampscale", slots: Any = 1, backend: Any = "numpy", device: Any = None, **settings: Any
) -> Fp8Scaler:
    """A new FP8 scaler.

    Args:
        preset: whose recipe to reproduce (see :data:`ampscale.fp8.FP8_PRESETS`).
        slots: the tensors: an int, a list of names (forward tensors), or a dict name ->
            ``"forward"`` / ``"backward"`` (the role picks the format of ``formats``).
        backend: ``"numpy"``, ``"jax"``, ``"torch"``, ``"cupy"``, or an array-API namespace
            (``array_api_strict``; the standard's functions only).
        device: the torch device of the state (``None``: the CPU).
        **settings: any setting of :mod:`ampscale.fp8._config` (``history_len``, ``margin``,
            ``formats``, ...), read in the preset's terms.

    Example:
        >>> import numpy as np, ampscale.fp8 as fp8
        >>> f8 = fp8.create_fp8_scaler("te_delayed", slots=["fc1.x"], history_len=4)
        >>> f8 = f8.update(np.array([2.0], np.float32))
        >>> f8.scales_sync()
        {'fc1.x': 224.0}
    """
    config = make_fp8_config(preset, slots, **settings)
    return Fp8Scaler(config, init_state(config, backend, device))


def _register_jax() -> None:
    try:
        import jax
    except ImportError:  # pragma: no cover - only without JAX
        return
    jax.tree_util.register_pytree_node(
        Fp8Scaler,
        lambda s: ((s.state,), s.config),
        lambda config, children: Fp8Scaler(config, children[0]),
    )


_jax_registered = False


def ensure_jax_pytree() -> None:
    """Register :class:`Fp8Scaler` as a JAX pytree (state leaves, config static), once."""
    global _jax_registered
    if not _jax_registered:
        _register_jax()
        _jax_registered = True
