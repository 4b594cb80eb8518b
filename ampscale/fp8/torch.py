"""FP8 for torch modules: hooks that cast inputs, weights and output gradients, and collect amaxes.

:class:`Fp8Hooks` puts hooks on chosen modules of a model (every ``nn.Linear`` by default):

* forward: the module's input and weight are quantize-dequantized with their slots' current
  scales, in torch's own operations (``clamp(x * scale).to(float8)``, then ``* scale_inv``: the
  pattern ``torch._scaled_mm`` and inductor match), and their amaxes (of the values before the
  cast) are merged into a running max;
* backward: the gradient of the module's output is quantize-dequantized with its slot's scale
  (E5M2 with the ``hybrid`` formats) and its amax merged the same way;
* :meth:`Fp8Hooks.update` (or :meth:`Fp8Hooks.unscale_and_update`, with the loss scaler) runs
  the FP8 update once per optimizer step with the merged amaxes, then starts a new merge: under
  gradient accumulation every micro-batch counts and the history is written once per step.

The casts are straight-through in autograd (the gradient of a cast is the identity, as in
flax's ``fp8_ops`` and Transformer Engine's emulation). Nothing reads values back to the host:
the amaxes are merged on the device, in one small ``[N]`` tensor.

Example::

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    hooks = Fp8Hooks(model, preset="te_delayed", history_len=16)    # slots "0.input", "0.weight", ...
    for step in range(steps):
        for x, y in micro_batches:
            loss_fn(model(x), y).backward()
        optimizer.step(); optimizer.zero_grad()
        hooks.update()                                   # once per optimizer step
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ampscale.fp8._cast import quantize_dequantize
from ampscale.fp8._combined import Fp8Step, unscale_and_update
from ampscale.fp8._distributed import UNSET
from ampscale.fp8._fused import amax as fused_amax
from ampscale.fp8._scaler import Fp8Scaler, create_fp8_scaler

__all__ = ["KINDS", "Fp8Hooks", "qdq"]

#: what a slot of a module casts, and the role (hence the format) of each
KINDS = ("input", "weight", "grad_output")
_ROLES = {"input": "forward", "weight": "forward", "grad_output": "backward"}


class _QuantizeDequantize(torch.autograd.Function):  # type: ignore[misc]
    """Fake quantization whose gradient passes straight through."""

    @staticmethod
    def forward(ctx: Any, x: Any, scale: Any, scale_inv: Any, fmt: str, divide: bool) -> Any:  # type: ignore[override]
        return quantize_dequantize(x, scale, scale_inv, fmt, divide=divide)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
        return grad, None, None, None, None


def qdq(x: Any, scale: Any, scale_inv: Any, fmt: str, divide: bool = False) -> Any:
    """``x`` quantized to ``fmt`` with ``scale`` and dequantized with ``scale_inv``, in ``x``'s
    dtype (``divide``: ``x / scale_inv``, the flax and Keras presets); straight-through in autograd."""
    return _QuantizeDequantize.apply(x, scale, scale_inv, fmt, divide)


def _parse(slot: Any) -> tuple[str, str]:
    if not isinstance(slot, str) or ("." not in slot and slot not in KINDS):
        raise ValueError(f"slots must be names '<module>.<kind>' with kind one of {list(KINDS)}; got {slot!r}")
    module, _, kind = slot.rpartition(".")
    if kind not in KINDS:
        raise ValueError(f"slot {slot!r}: the kind after the last '.' must be one of {list(KINDS)}; got {kind!r}")
    return module, kind


class Fp8Hooks:
    """FP8 casts and amax collection on chosen modules of a torch model (see the module docstring).

    Args:
        model: the ``torch.nn.Module``.
        fp8_scaler: the :class:`~ampscale.fp8.Fp8Scaler` of the slots (torch state); ``None``:
            one is created with ``preset`` and ``settings`` on the device of the model's first
            parameter.
        slots: names ``"<module>.<kind>"``, ``<module>`` a name of ``model.named_modules()``
            (``""`` for the model itself) and ``<kind>`` one of ``input``, ``weight``,
            ``grad_output``; ``None``: the three of every ``nn.Linear``.
        preset, settings: for the scaler made when ``fp8_scaler`` is ``None``.

    Attributes:
        fp8_scaler: the current FP8 scaler (replaced by each update).

    Raises:
        ValueError: an unknown module or kind, a ``weight`` slot of a module without a
            ``weight`` parameter, or a scaler without a slot (or with another role); nothing
            is hooked.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        fp8_scaler: Fp8Scaler | None = None,
        *,
        slots: Sequence[str] | None = None,
        preset: str = "ampscale",
        **settings: Any,
    ) -> None:
        modules = dict(model.named_modules())
        if slots is None:
            linears = [name for name, module in modules.items() if isinstance(module, torch.nn.Linear)]
            if not linears:
                raise ValueError("the model has no torch.nn.Linear: name the slots to hook (slots=[...])")
            slots = [f"{name}.{kind}" if name else kind for name in linears for kind in KINDS]
        plan: dict[str, list[tuple[str, str]]] = {}
        for slot in slots:
            name, kind = _parse(slot)
            if name not in modules:
                raise ValueError(f"slot {slot!r}: the model has no module {name!r}; its modules: {list(modules)[:12]}")
            if kind == "weight" and not isinstance(getattr(modules[name], "weight", None), torch.nn.Parameter):
                raise ValueError(f"slot {slot!r}: module {name!r} has no 'weight' parameter")
            plan.setdefault(name, []).append((kind, slot))
        roles = {slot: _ROLES[_parse(slot)[1]] for slot in slots}
        if fp8_scaler is None:
            first = next(model.parameters(), None)
            device = None if first is None else first.device
            fp8_scaler = create_fp8_scaler(preset, roles, backend="torch", device=device, **settings)
        elif not isinstance(fp8_scaler, Fp8Scaler) or fp8_scaler.framework != "torch":
            raise ValueError(f"fp8_scaler must be an Fp8Scaler on torch tensors; got {fp8_scaler!r}")
        config = fp8_scaler.config
        for slot, role in roles.items():
            if slot not in config.slots:
                raise ValueError(f"fp8_scaler has no slot {slot!r}; its slots: {list(config.slots)}")
            own = config.roles[config.slots.index(slot)]
            if own != role:
                raise ValueError(f"slot {slot!r} is a {role} tensor, but fp8_scaler's slot has role {own!r}")
        self.fp8_scaler = fp8_scaler
        self._amax = torch.zeros(config.size, dtype=torch.float32, device=fp8_scaler.state.scale.device)
        self._handles: list[Any] = []
        self._held: dict[int, Any] = {}  # module id -> its weight Parameter while a forward runs
        for name, kinds in plan.items():
            self._hook(modules[name], dict(kinds))

    # ------------------------------------------------------------------ the hooks

    def _cast(self, x: Any, slot: str) -> Any:
        scaler = self.fp8_scaler
        k = scaler.index(slot)
        state = scaler.state
        divide = scaler.config.storage == "inverse"
        return qdq(x, state.scale[k], state.scale_inv[k], scaler.config.slot_formats[k], divide)

    def _record(self, x: Any, slot: str) -> None:
        k = self.fp8_scaler.index(slot)
        with torch.no_grad():
            # the fused pass, on one tensor: one read, no |x| temporary, exact on any subnormal
            amax = fused_amax([x.detach()]).to(self._amax.device)
            # a max that keeps nan (torch.maximum propagates it), on the device
            torch.maximum(self._amax[k : k + 1], amax.reshape(1), out=self._amax[k : k + 1])

    def _hook(self, module: torch.nn.Module, kinds: dict[str, str]) -> None:
        def before(module: torch.nn.Module, args: tuple[Any, ...]) -> Any:
            if "weight" in kinds:
                weight = module._parameters["weight"]
                self._record(weight, kinds["weight"])
                self._held[id(module)] = weight
                # the forward reads the cast weight; the Parameter comes back after it (below)
                module._parameters["weight"] = self._cast(weight, kinds["weight"])
            if "input" in kinds and args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
                self._record(args[0], kinds["input"])
                return (self._cast(args[0], kinds["input"]), *args[1:])
            return None

        def after(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            held = self._held.pop(id(module), None)
            if held is not None:
                module._parameters["weight"] = held
            if "grad_output" in kinds and isinstance(output, torch.Tensor) and output.requires_grad:
                slot = kinds["grad_output"]

                def on_gradient(grad: Any) -> Any:
                    self._record(grad, slot)
                    return self._cast(grad, slot)

                output.register_hook(on_gradient)

        self._handles.append(module.register_forward_pre_hook(before))
        # always_call: the weight Parameter is put back even when the forward raises
        self._handles.append(module.register_forward_hook(after, always_call=True))

    # ------------------------------------------------------------------ the update

    @property
    def amax(self) -> Any:
        """The ``[N]`` amaxes merged since the last update (a copy; 0: the slot did not run)."""
        return self._amax.clone()

    def reset_amax(self) -> None:
        """Start a new merge (the next update sees only what runs from now on)."""
        self._amax.zero_()

    def advance(self, fp8_scaler: Fp8Scaler) -> None:
        """Use ``fp8_scaler`` (the result of an update made elsewhere) and start a new merge."""
        if not isinstance(fp8_scaler, Fp8Scaler) or fp8_scaler.config != self.fp8_scaler.config:
            raise ValueError("fp8_scaler must be an Fp8Scaler with the hooks' config (the result of updating theirs)")
        self.fp8_scaler = fp8_scaler
        self.reset_amax()

    def update(self, step_ok: Any = True, *, group: Any = UNSET) -> Fp8Scaler:
        """The FP8 update with the merged amaxes (once per optimizer step), then a new merge.

        ``step_ok`` and ``group`` as :meth:`ampscale.fp8.Fp8Scaler.update`.
        """
        self.advance(self.fp8_scaler.update(self._amax, step_ok, group=group))
        return self.fp8_scaler

    def unscale_and_update(self, scaler: Any, grads: Any, *, loss: Any = None, group: Any = UNSET) -> Fp8Step:
        """:func:`ampscale.fp8.unscale_and_update` with the merged amaxes, then a new merge.

        The output gradients' amaxes are recorded as the hooks see them, scaled by the loss
        scale (as Transformer Engine records them), since the hooks cast those scaled gradients
        with their slot's scale. Returns the :class:`~ampscale.fp8.Fp8Step`; the hooks use its
        ``fp8_scaler`` from now on.
        """
        step = unscale_and_update(scaler, self.fp8_scaler, grads, self._amax, loss=loss, group=group)
        self.advance(step.fp8_scaler)
        return step

    def remove(self) -> None:
        """Remove every hook (the model computes in its own precision again)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
