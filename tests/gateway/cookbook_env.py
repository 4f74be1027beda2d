"""An offline environment in which tinker-cookbook recipes run unmodified against the gateway (wire reference
section 10): the recipes accept only names from the cookbook's model table (smallest: meta-llama/Llama-3.2-1B, the
Llama-3 vocabulary) and load their tokenizer and datasets from the Hugging Face hub. So this module builds

- the Llama-3 tokenizer from Meta's `llama-models` PyPI package (its tiktoken BPE file), as HF tokenizer files;
- a small random-weight Llama model with that vocabulary (a local HF directory the trainer and sampler serve,
  named `meta-llama/Llama-3.2-1B` by the gateway);
- an HF_HOME with the tokenizer under the repo the cookbook asks for and the recipes' datasets (no_robots,
  gsm8k, math_rl's MATH / MATH-500 / Polaris / DeepMath, Anthropic hh-rlhf) in the processed
  `datasets` cache, made from a few rows of our own, in each dataset's own columns."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

COOKBOOK_MODEL = "meta-llama/Llama-3.2-1B"
TOKENIZER_REPO = "thinkingmachineslabinc/meta-llama-3-instruct-tokenizer"
_REVISION = "0" * 40
_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
            r"|\s+(?!\S)|\s+")


def llama3_tokenizer(target: Path) -> Path:
    """HF tokenizer files for the Llama-3 vocabulary (128,256 tokens), from llama-models' tokenizer.model."""
    if (target / "tokenizer.json").exists():
        return target
    import llama_models
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    model_file = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
             "<|eot_id|>", "<|python_tag|>"]
    specials = names + [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(names))]
    backend = TikTokenConverter(vocab_file=str(model_file), pattern=_PATTERN,
                                extra_special_tokens=specials).converted()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                                        eos_token="<|end_of_text|>", pad_token="<|finetune_right_pad_id|>")
    tokenizer.save_pretrained(str(target))
    return target


def random_llama3_model(target: Path, tokenizer_dir: Path) -> Path:
    """A 2-layer random Llama with the Llama-3 vocabulary (hidden 64): tiny compute, real token ids."""
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(str(target), safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        shutil.copy2(tokenizer_dir / name, target / name)
    return target


def cached_repo(home: Path, repo_id: str, files_dir: Path, *, missing: tuple[str, ...] = ("config.json",)) -> None:
    """`files_dir`'s files as hub repo `repo_id` in HF_HOME's cache, as `from_pretrained` finds them offline."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / _REVISION
    if snapshot.exists():
        return
    snapshot.mkdir(parents=True)
    for name in os.listdir(files_dir):
        shutil.copy2(files_dir / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(_REVISION)
    # The hub's "this file does not exist" markers: transformers also asks for files a tokenizer repo lacks.
    (repo / ".no_exist" / _REVISION).mkdir(parents=True)
    for name in missing:
        (repo / ".no_exist" / _REVISION / name).write_text("")


def hf_home(root: Path, tokenizer_dir: Path, tokenizer_repos: tuple[str, ...] = (TOKENIZER_REPO,)) -> Path:
    """An HF_HOME holding the cookbook's tokenizer repos and the recipes' datasets, for HF_HUB_OFFLINE=1."""
    home = root / "hf_home"
    for repo_id in tokenizer_repos:
        cached_repo(home, repo_id, tokenizer_dir)
    _cached_dataset(home, "HuggingFaceH4/no_robots", "default", _no_robots_rows())
    _cached_dataset(home, "openai/gsm8k", "main", _gsm8k_rows())
    math_rows = _math_rows()
    # Offline, math_env's get_dataset_config_names("EleutherAI/hendrycks_math") answers ["default"], so the
    # subject configs (algebra, ...) are one config of that name here.
    _cached_dataset(home, "EleutherAI/hendrycks_math", "default", {"train": math_rows, "test": math_rows[:2]})
    _cached_dataset(home, "HuggingFaceH4/MATH-500", "default", {"test": math_rows[-2:]})
    _cached_dataset(home, "POLARIS-Project/Polaris-Dataset-53K", "default", {"train": [
        {"problem": r["problem"], "answer": str(a + b)} for r, (a, b) in zip(math_rows, _PAIRS, strict=True)]})
    _cached_dataset(home, "zwhe99/DeepMath-103K", "default", {"train": [
        {"question": r["problem"], "final_answer": str(a + b), "difficulty": 1.0}
        for r, (a, b) in zip(math_rows, _PAIRS, strict=True)]})
    hh = [{"chosen": f"\n\nHuman: What is {a} plus {b}?\n\nAssistant: It is {a + b}.",
           "rejected": f"\n\nHuman: What is {a} plus {b}?\n\nAssistant: No idea, go away."} for a, b in _PAIRS]
    _cached_dataset(home, "Anthropic/hh-rlhf", "default", {"train": hh, "test": hh[:4]})
    return home


_PAIRS = [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1), (4, 4), (6, 3)]


def _math_rows() -> list[dict]:
    """Rows in the MATH columns (the answer is the \\boxed{} of the solution)."""
    return [{"problem": f"Compute ${a} + {b}$.", "level": "Level 1", "type": "Algebra",
             "solution": f"${a} + {b} = \\boxed{{{a + b}}}$."} for a, b in _PAIRS]


def prophet_arena_csv(path: Path) -> Path:
    """A CSV in the Prophet Arena columns forecasting's data_path reads: six resolved binary markets, four closing
    before its default split date (2025-10-20, training) and two opening after it (validation)."""
    import csv

    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.DictWriter(out, fieldnames=["submission_id", "event_ticker", "title", "snapshot_time",
                                                 "close_time", "market_outcome", "category", "markets", "sources"])
        writer.writeheader()
        for i in range(6):
            month = 9 if i < 4 else 11
            market = f"The river floods more than {i} times"
            writer.writerow({
                "submission_id": f"s{i}", "event_ticker": f"EV{i}", "title": f"River floods, round {i}",
                "snapshot_time": f"2025-{month:02d}-0{i + 1}T00:00:00Z",
                "close_time": f"2025-{month:02d}-1{i + 1}T00:00:00Z",
                "market_outcome": json.dumps({market: i % 2}), "category": "Weather",
                "markets": json.dumps([market]),
                "sources": json.dumps([{"title": "Gauge report", "summary": f"The gauge read {i} meters."}])})
    return path


def _no_robots_rows() -> dict[str, list[dict]]:
    rows = []
    for i in range(16):
        rows.append({"prompt": f"Say {i}", "prompt_id": str(i), "category": "Chat", "messages": [
            {"role": "user", "content": f"Please say the number {i} in words."},
            {"role": "assistant", "content": f"The number is {i}. Have a nice day."}]})
    return {"train": rows, "test": rows[:4]}


def _gsm8k_rows() -> dict[str, list[dict]]:
    rows = [{"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1), (4, 4), (6, 3)]]
    return {"train": rows, "test": rows[:4]}


def _cached_dataset(home: Path, repo: str, config: str, splits: dict[str, list[dict]]) -> None:
    """The processed datasets cache `load_dataset(repo, config)` reads offline, written by datasets itself."""
    import datasets
    from datasets.naming import camelcase_to_snakecase

    namespace, name = repo.split("/")
    name = camelcase_to_snakecase(name)  # how the cache spells a repo's directory and files (MATH-500: math-500)
    target = home / "datasets" / f"{namespace}___{name}" / config / "0.0.0" / "0123456789abcdef"
    if target.exists():
        return
    scratch = home / "datasets-scratch" / name
    scratch.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        files[split] = str(scratch / f"{split}.jsonl")
        Path(files[split]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    builder = datasets.load_dataset_builder("json", data_files=files, cache_dir=str(scratch / "cache"))
    builder.download_and_prepare()
    built = Path(builder.cache_dir)
    target.mkdir(parents=True)
    for path in built.iterdir():
        if path.suffix == ".arrow":
            shutil.copy2(path, target / path.name.replace("json-", f"{name}-", 1))
    info = json.loads((built / "dataset_info.json").read_text())
    info.update(builder_name=name, dataset_name=name, config_name=config)
    (target / "dataset_info.json").write_text(json.dumps(info))
    shutil.rmtree(scratch, ignore_errors=True)


# Qwen3.5 (qwen3_5): the cookbook's defaults. math_rl -> Qwen/Qwen3.5-9B, rl_loop / sl_loop -> Qwen/Qwen3.5-9B-Base,
# guess_number and most other RL recipes -> Qwen/Qwen3.5-4B. One tiny dense checkpoint serves all three names.
QWEN3_5_MODELS = ("Qwen/Qwen3.5-9B", "Qwen/Qwen3.5-9B-Base", "Qwen/Qwen3.5-4B")
# The Qwen2/3/3.5 pre-tokenizer split (digits one at a time), applied before byte-level BPE.
_QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# The Qwen3.5 tokenizer's added tokens, in its order (ChatML, vision, tool and thinking markers); the renderer
# encodes each as one token.
QWEN3_5_ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>")
_QWEN3_5_SPECIAL = frozenset(t for t in QWEN3_5_ADDED_TOKENS if t.startswith("<|"))
# ChatML with Qwen3.5's thinking prefill: enough for the gateway's chat routes (the cookbook renders by itself).
_QWEN3_5_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' and '<think>' not in message['content'] %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")


def qwen3_5_tokenizer(target: Path) -> Path:
    """A fixture stand-in for the Qwen3.5 tokenizer (no model hub here): the family's pre-tokenizer split and
    byte-level BPE with a small vocabulary learnt from the recipes' own rows, plus every added token of the real
    one (ChatML, vision, tool and <think> markers) as single tokens, <|im_end|> as EOS and <|endoftext|> as PAD.
    Token ids differ from the real tokenizer's; what the cookbook's qwen3_5 renderers rely on holds."""
    return byte_level_bpe_tokenizer(
        target, "The answer is. Let me think step by step. Guess the number between one and a hundred.",
        eos_token="<|im_end|>", chat_template=_QWEN3_5_CHAT_TEMPLATE, added_tokens=QWEN3_5_ADDED_TOKENS,
        special=_QWEN3_5_SPECIAL)


def byte_level_bpe_tokenizer(target: Path, extra_text: str, *, eos_token: str, chat_template: str,
                             added_tokens, special) -> Path:
    """A fixture tokenizer written to `target` (kept when there): Qwen's pre-tokenizer split and byte-level BPE with
    a small vocabulary learnt from the recipes' own rows and `extra_text` (the words its chat format uses), plus
    `added_tokens` as single tokens (those in `special` marked special), <|endoftext|> as PAD."""
    if (target / "tokenizer.json").exists():
        return target
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    corpus = [m["content"] for r in _no_robots_rows()["train"] for m in r["messages"]]
    corpus += [r["question"] + " " + r["answer"] for r in _gsm8k_rows()["train"]]
    corpus += [r["problem"] + " " + r["solution"] for r in _math_rows()]
    corpus += [extra_text]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos_token, pad_token="<|endoftext|>",
                                        chat_template=chat_template)
    tokenizer.add_tokens([AddedToken(t, special=t in special, normalized=False) for t in added_tokens])
    tokenizer.save_pretrained(str(target))
    return target


def random_qwen3_5_model(target: Path, tokenizer_dir: Path) -> Path:
    """A tiny random Qwen3.5 (qwen3_5) vision-language checkpoint as users download one (text weights under
    model.language_model.*, a one-block vision tower beside): three Gated DeltaNet layers and one gated
    full-attention layer over the fixture tokenizer's vocabulary."""
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoTokenizer, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = Qwen3_5Config(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
                     "linear_num_value_heads": 4, "max_position_embeddings": 4096,
                     "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                     "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64},
        tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(config).save_pretrained(str(target), safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        shutil.copy2(tokenizer_dir / name, target / name)
    return target


def prepare_qwen3_5(root: Path) -> dict[str, str]:
    """As `prepare`, for the Qwen3.5 family: the model directory, and an HF_HOME with the fixture tokenizer under
    every name in QWEN3_5_MODELS (the cookbook loads the tokenizer by the recipe's model_name)."""
    tokenizer_dir = qwen3_5_tokenizer(root / "qwen3_5-tokenizer")
    model_dir = random_qwen3_5_model(root / "qwen3_5-random", tokenizer_dir)
    home = hf_home(root, tokenizer_dir, QWEN3_5_MODELS)
    return {"model_dir": str(model_dir), "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1"}


def prepare(root: Path) -> dict[str, str]:
    """Builds everything under `root`; returns the model directory and the environment for the recipes."""
    tokenizer_dir = llama3_tokenizer(root / "llama3-tokenizer")
    model_dir = random_llama3_model(root / "llama3-random", tokenizer_dir)
    home = hf_home(root, tokenizer_dir)
    return {"model_dir": str(model_dir), "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1"}
