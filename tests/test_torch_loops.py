"""Real training loops, run once with ``torch.amp.GradScaler`` and once with only the import
changed to ``ampscale.torch.GradScaler``: parameters, optimizer state and scale trajectory must
be equal bit for bit.

* ``amp_recipe``: the loop of PyTorch's "Automatic Mixed Precision" recipe (float16 autocast,
  ``scale(loss).backward()``, ``step``, ``update``, ``zero_grad(set_to_none=True)``), with its
  clipping variant (``unscale_`` then ``clip_grad_norm_``) and its checkpoint/resume step (model,
  optimizer and scaler ``state_dict`` saved, loaded into new objects, training continued).
* ``nanogpt``: a small GPT trained the way nanoGPT's ``train.py`` does it: float16 autocast on
  the CPU, gradient accumulation over micro-steps, a warmup + cosine learning rate, ``unscale_``
  + ``clip_grad_norm_``, fused AdamW with weight-decay groups, ``zero_grad(set_to_none=True)``.

Both start at torch's default scale (2**16); in the recipe float16 gradients overflow at that
scale in the first steps, so skipped steps happen on their own; in both loops one more
overflow is forced later.
"""

from __future__ import annotations

import copy
import io
import math

import pytest

torch = pytest.importorskip("torch")

import ampscale.torch  # noqa: E402

IMPORTS = {"torch.amp": torch.amp, "ampscale.torch": ampscale.torch}


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler) -> dict:
    state = optimizer.state_dict()["state"]
    return {
        "scale": scaler.get_scale(),
        "tracker": scaler._get_growth_tracker(),
        "params": [p.detach().clone() for p in model.parameters()],
        "optimizer": {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()} for k, s in state.items()},
    }


def _assert_same_runs(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs)
    for step, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        assert (o["scale"], o["tracker"]) == (t["scale"], t["tracker"]), step
        for a, b in zip(o["params"], t["params"], strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), step  # bits, NaNs included
        assert o["optimizer"].keys() == t["optimizer"].keys(), step
        for key, state in o["optimizer"].items():
            for name, value in state.items():
                other = t["optimizer"][key][name]
                assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (step, name)


# ------------------------------------------------------------------------------ the AMP recipe


def _recipe_model(in_size: int, out_size: int, num_layers: int) -> torch.nn.Module:
    layers = []
    for _ in range(num_layers - 1):
        layers += [torch.nn.Linear(in_size, in_size), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(in_size, out_size))
    return torch.nn.Sequential(*layers)


def amp_recipe(amp, clip: bool) -> list[dict]:
    """The recipe's loop; ``amp`` is the module the script imported ``GradScaler`` from."""
    torch.manual_seed(0)
    batch, size, layers, epochs = 32, 64, 3, 3
    data = [torch.randn(batch, size) * 40 for _ in range(4)]
    targets = [torch.randn(batch, size) for _ in range(4)]
    net = _recipe_model(size, size, layers)
    opt = torch.optim.SGD(net.parameters(), lr=0.001, momentum=0.9)
    loss_fn = torch.nn.MSELoss()
    scaler = amp.GradScaler("cpu")
    seen = []
    for epoch in range(epochs):
        if epoch == 2:  # "Saving/Resuming": everything through state_dict, into new objects
            buffer = io.BytesIO()
            torch.save(
                {"model": net.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict()}, buffer
            )
            buffer.seek(0)
            checkpoint = torch.load(buffer)
            net = _recipe_model(size, size, layers)
            opt = torch.optim.SGD(net.parameters(), lr=0.001, momentum=0.9)
            scaler = amp.GradScaler("cpu")
            net.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["optimizer"])
            scaler.load_state_dict(checkpoint["scaler"])
        for i, (inputs, target) in enumerate(zip(data, targets, strict=True)):
            with torch.autocast(device_type="cpu", dtype=torch.float16):
                output = net(inputs)
                loss = loss_fn(output, target)
            scaler.scale(loss).backward()
            if epoch == 1 and i == 2:
                net[0].weight.grad[0, 0] = float("nan")  # an overflow after the warm-up ones
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=0.1)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            seen.append(_snapshot(net, opt, scaler))
    return seen


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clipped"])
def test_amp_recipe_loop_is_bit_for_bit_torchs(clip: bool) -> None:
    theirs = amp_recipe(IMPORTS["torch.amp"], clip)
    ours = amp_recipe(IMPORTS["ampscale.torch"], clip)
    _assert_same_runs(ours, theirs)
    scales = [s["scale"] for s in ours]
    assert scales[0] < 2.0**16  # float16 overflowed at the start: steps were skipped
    assert scales[6] == scales[5] / 2  # the forced overflow


# ------------------------------------------------------------------------------ a nanoGPT-style loop


class _Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = torch.nn.LayerNorm(width)
        self.c_attn = torch.nn.Linear(width, 3 * width)
        self.c_proj = torch.nn.Linear(width, width)
        self.ln_2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp(self.ln_2(x))


class _GPT(torch.nn.Module):
    def __init__(self, vocab: int = 65, block: int = 16, width: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, width)
        self.wpe = torch.nn.Embedding(block, width)
        self.blocks = torch.nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)
        self.lm_head = torch.nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _lr(it: int, warmup: int = 2, decay: int = 8, top: float = 6e-3, low: float = 6e-4) -> float:
    if it < warmup:
        return top * (it + 1) / (warmup + 1)
    ratio = min(1.0, (it - warmup) / (decay - warmup))
    return low + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (top - low)


def nanogpt(amp) -> list[dict]:
    """nanoGPT's train.py loop on a small model; ``amp`` provides ``GradScaler``."""
    torch.manual_seed(1337)
    text = torch.randint(0, 65, (4096,), generator=torch.Generator().manual_seed(0))
    batches = torch.Generator().manual_seed(1)
    model = _GPT()
    params = [p for p in model.parameters() if p.requires_grad]
    optim_groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optim_groups, lr=6e-3, betas=(0.9, 0.95), fused=True)
    scaler = amp.GradScaler("cpu", enabled=True)
    accumulation, grad_clip, block = 3, 1.0, 16

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(text) - block - 1, (4,), generator=batches)
        return torch.stack([text[i : i + block] for i in ix]), torch.stack([text[i + 1 : i + 1 + block] for i in ix])

    x, y = get_batch()
    seen = []
    for it in range(8):
        for group in optimizer.param_groups:
            group["lr"] = _lr(it)
        for _ in range(accumulation):
            with torch.autocast(device_type="cpu", dtype=torch.float16):
                _, loss = model(x, y)
                loss = loss / accumulation
            x, y = get_batch()  # prefetch, as nanoGPT does, while the backward runs
            scaler.scale(loss).backward()
        if it == 5:
            model.blocks[1].c_proj.weight.grad[0, 0] = float("inf")
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        seen.append(_snapshot(model, optimizer, scaler))
    return seen


def test_nanogpt_loop_is_bit_for_bit_torchs() -> None:
    theirs = nanogpt(IMPORTS["torch.amp"])
    ours = nanogpt(IMPORTS["ampscale.torch"])
    _assert_same_runs(ours, theirs)
    scales = [s["scale"] for s in ours]
    assert scales[5] == scales[4] / 2  # the forced overflow
    first, last = ours[0]["params"], ours[-1]["params"]
    assert any(not torch.equal(a, b) for a, b in zip(first, last, strict=True))  # it trained


def test_loops_do_not_depend_on_what_they_are_given() -> None:
    """The comparison is not vacuous: a different scaler setting changes the trajectory."""

    class Halved:
        @staticmethod
        def GradScaler(*args, **kwargs):  # stands for the imported class
            return copy.copy(torch.amp.GradScaler(*args, init_scale=2.0**15, **kwargs))

    with pytest.raises(AssertionError):
        _assert_same_runs(amp_recipe(Halved, clip=False), amp_recipe(IMPORTS["torch.amp"], clip=False))
