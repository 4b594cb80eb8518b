"""Train an MLP in float16 with JAX, optax and ampscale (CPU, well under a minute).

The forward and backward passes run in float16 on a float16 copy of the float32 master
weights; the float16 gradients are cast to float32 and handed to an optax optimizer wrapped by
``ampscale.jax.loss_scaled``, which unscales them, skips steps that overflowed (the Adam state
does not advance) and adjusts the scale, all inside one jitted step with no host transfer.

Run: ``python examples/jax_optax_mlp.py [--steps N]``.
"""

from __future__ import annotations

import argparse
import time

try:
    import jax
    import jax.numpy as jnp
    import optax
except ModuleNotFoundError as exc:  # one line that says what to do, as the demo does, not a traceback
    raise SystemExit(
        f"jax_optax_mlp.py needs {exc.name}, which is not installed: pip install 'ampscale[jax]'"
    ) from None

import ampscale
import ampscale.jax as ajax


def make_data(key: jax.Array, n: int = 4096) -> tuple[jax.Array, jax.Array]:
    """Two interleaved half moons: a small nonlinear classification problem, generated."""
    k1, k2, k3 = jax.random.split(key, 3)
    angle = jax.random.uniform(k1, (n,)) * jnp.pi
    label = jax.random.bernoulli(k2, 0.5, (n,)).astype(jnp.int32)
    x = jnp.stack([jnp.cos(angle) + label, jnp.sin(angle) * (1 - 2 * label) + 0.5 * label], 1)
    x = x + 0.1 * jax.random.normal(k3, x.shape)
    return jnp.concatenate([x, x**2, x[:, :1] * x[:, 1:]], 1), label


def init_params(key: jax.Array, sizes: tuple[int, ...] = (5, 128, 128, 2)) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) * jnp.sqrt(2.0 / a), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def forward(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params16: list[dict[str, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
    logits = forward(params16, x.astype(jnp.float16)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args(argv)

    x, y = make_data(jax.random.PRNGKey(0))
    params = init_params(jax.random.PRNGKey(1))
    scaler = ampscale.create_scaler(backend="jax", growth_interval=100)
    optimizer = ajax.loss_scaled(optax.adamw(3e-3), scaler)
    opt_state = optimizer.init(params)

    @jax.jit
    def train_step(params, opt_state, batch_x, batch_y):
        scaler = ajax.scaler_of(opt_state)
        params16 = jax.tree_util.tree_map(lambda p: p.astype(jnp.float16), params)
        loss, grads16 = jax.value_and_grad(lambda p: scaler.scale(loss_fn(p, batch_x, batch_y)))(params16)
        grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads16)  # fp32 master gradients
        updates, opt_state = optimizer.update(grads, opt_state, params, scaled_loss=loss)
        return optax.apply_updates(params, updates), opt_state, loss / scaler.state.scale

    start = time.perf_counter()
    key = jax.random.PRNGKey(2)
    loss = jnp.float32(0)
    for step in range(args.steps):
        key, sub = jax.random.split(key)
        index = jax.random.randint(sub, (256,), 0, x.shape[0])
        params, opt_state, loss = train_step(params, opt_state, x[index], y[index])
        if step % 100 == 0 or step == args.steps - 1:
            scaler = ajax.scaler_of(opt_state)
            print(f"step {step:4d}  loss {float(loss):.4f}  scale {scaler.get_scale():.0f}")
    accuracy = float((forward(params, x).argmax(1) == y).mean())
    outcome = ajax.scaler_of(opt_state).outcome.to_dict()
    print(
        f"accuracy {accuracy:.3f}, skipped {outcome['skipped_steps']}/{outcome['steps']} steps, "
        f"{time.perf_counter() - start:.1f} s"
    )
    return {"accuracy": accuracy, "skipped": outcome["skipped_steps"], "steps": outcome["steps"]}


if __name__ == "__main__":
    main()
