"""The smallest complete loop: create an adapter, teach it one answer, publish, sample the new version.

    loraplane up                                   # or point LORAPLANE_*_ADDRESS at running services
    python examples/quickstart.py
"""

from __future__ import annotations

import argparse

from loraplane.client import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from loraplane_cli.product import encode_prompt


def build_datum(tokenizer, question: str, answer: str) -> Datum:
    """Prompt tokens weigh 0, answer tokens 1: only the answer is learned."""
    prompt = encode_prompt(tokenizer, question)
    completion = [int(t) for t in tokenizer.encode(answer, add_special_tokens=False)] + [tokenizer.eos_token_id]
    tokens = prompt + completion
    weights = [0.0] * len(prompt) + [1.0] * len(completion)
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                 loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]})


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="quickstart/colors")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    args = parser.parse_args(argv)

    service = ServiceClient()
    training = service.create_lora_training_client(rank=8, seed=0, name=args.name, exist_ok=True)
    tokenizer = training.get_tokenizer()
    datum = build_datum(tokenizer, "What is loraplane?", "A control plane for LoRA post-training.")

    losses = []
    for step in range(args.steps):
        backward = training.forward_backward([datum], "cross_entropy")
        training.optim_step(AdamParams(learning_rate=args.learning_rate))  # pipelined behind the backward pass
        losses.append(backward.result().loss)
        print(f"step {step + 1:>2}  loss {losses[-1]:.3f}")

    sampler = training.save_weights_for_sampler("quickstart").result()
    reply = sampler.sample(ModelInput.from_ints(encode_prompt(tokenizer, "What is loraplane?")), 1,
                           SamplingParams(max_tokens=16, temperature=0.0, stop=[tokenizer.eos_token_id])).result()
    text = tokenizer.decode(reply.sequences[0].tokens, skip_special_tokens=True)
    print(f"{sampler.path} (served v{reply.served_version}): {text!r}")
    return {"losses": losses, "version": sampler.version, "served_version": reply.served_version, "text": text}


if __name__ == "__main__":
    main()
