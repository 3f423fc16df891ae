"""loss.png: training and validation cross-entropy over the steps."""

from __future__ import annotations


def plot_losses(path, train_steps, train_losses, evals):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(
        train_steps, train_losses, color="tab:blue", alpha=0.25, lw=0.8, label="train CE (per step)"
    )
    if train_losses:
        ema, sm = 0.0, []
        for i, v in enumerate(train_losses):
            ema = 0.95 * ema + 0.05 * v
            sm.append(ema / (1 - 0.95 ** (i + 1)))  # bias-corrected EMA
        ax.plot(train_steps, sm, color="tab:blue", lw=1.8, label="train CE (EMA 0.95)")
    ax.plot(
        [e["step"] for e in evals],
        [e["val_loss"] for e in evals],
        "o-",
        color="tab:red",
        lw=1.8,
        label="validation CE (full held-out set)",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("Qwen3-MoE demo (python3.11-doc corpus)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
