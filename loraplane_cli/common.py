"""What the CLI's commands share: prompts as tokens, SFT datums, loss plots (the demo, `train` and `sample` use them;
a module of its own, so that no command module imports another)."""

from __future__ import annotations

from pathlib import Path

from loraplane.client import Datum, ModelInput


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of the prompt; with `chat`, as a user turn in the tokenizer's chat template (if it has one)."""
    if chat and getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True)
        if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
            encoded = encoded["input_ids"]
        return [int(t) for t in encoded]
    return [int(t) for t in tokenizer.encode(prompt)]


def end_of_turn_ids(tokenizer) -> list[int]:
    ids = [tokenizer.eos_token_id]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.append(im_end)
    return sorted({int(i) for i in ids if i is not None and i >= 0})


def sft_datum(tokenizer, question: str, answer: str) -> Datum:
    """Prompt tokens carry weight 0, the answer and its end-of-turn token weight 1/len (a per-example mean, so
    long and short answers count alike)."""
    prompt = encode_prompt(tokenizer, question, chat=True)
    answer_ids = [int(t) for t in tokenizer.encode(answer, add_special_tokens=False)]
    answer_ids.append(end_of_turn_ids(tokenizer)[-1])
    tokens = prompt + answer_ids
    weights = [0.0] * len(prompt) + [1.0 / len(answer_ids)] * len(answer_ids)
    return Datum(ModelInput(tokens[:-1]), {"target_tokens": tokens[1:], "weights": weights[1:]})


def plot_losses(series: dict[str, list[float]], path: Path, title: str,
                marks: dict[str, list[int]] | None = None) -> Path:
    """A PNG of loss curves (one per label), with optional vertical marks at given steps (e.g. publishes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for label, losses in series.items():
        axes.plot(range(1, len(losses) + 1), losses, marker="o", markersize=3, label=label)
        for step in (marks or {}).get(label, ()):
            axes.axvline(step, color=axes.lines[-1].get_color(), alpha=0.15)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss per example")
    axes.set_title(title)
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
