"""The names the gateway serves its base model under, for Tinker and OpenAI callers alike: the trainer's name for
it, the operator's extra names (LORAPLANE_GATEWAY_MODEL_NAMES) and, last, the absolute path of a local directory
holding the base model's tokenizer.

That directory is what makes the SDK's tokenizer lookups work offline: `TrainingClient.get_tokenizer()` loads get_info's
`tokenizer_id` (this directory) and `SamplingClient.get_tokenizer()` calls `AutoTokenizer.from_pretrained(<the base
model's name>)`, which for a name like `smollm2-135m-instruct` asks the Hugging Face hub. A sampler (or training
client) created with the directory's path as its base model loads the tokenizer from disk instead. The path has
more than two '/' (the SDK reads `<org>/<model>/<variant>` names as hub repos), and it is local to the gateway's
host: an SDK elsewhere uses an extra name whose hub repo holds the same tokenizer."""

from __future__ import annotations

import re
import shutil
import tempfile
import uuid
from pathlib import Path

from gateway_svc.config import GatewaySettings
from gateway_svc.upstream import Upstream


class ServedNames:
    def __init__(self, settings: GatewaySettings, upstream: Upstream):
        self.settings = settings
        self.upstream = upstream
        self._dirs: dict[str, str] = {}

    async def names(self) -> list[str]:
        info = await self.upstream.info()
        names = [info.base_model, *self.settings.extra_model_names()]
        return names + [d for d in [await self.tokenizer_dir()] if d not in names]

    async def tokenizer_dir(self) -> str:
        """The base model's tokenizer saved once (save_pretrained) under the configured directory, resolved."""
        info = await self.upstream.info()
        if info.base_model not in self._dirs:
            root = Path(self.settings.tokenizer_dir or Path(tempfile.gettempdir()) / "loraplane-gateway-tokenizers")
            target = (root / re.sub(r"[^A-Za-z0-9._-]", "_", info.base_model)).resolve()
            if not (target / "tokenizer.json").exists() and not (target / "tokenizer_config.json").exists():
                tokenizer = await self.upstream.tokenizer()
                target.parent.mkdir(parents=True, exist_ok=True)
                scratch = target.with_name(target.name + f".tmp{uuid.uuid4().hex[:6]}")
                tokenizer.save_pretrained(str(scratch))
                try:
                    scratch.rename(target)
                except OSError:  # another replica wrote it first
                    shutil.rmtree(scratch, ignore_errors=True)
            self._dirs[info.base_model] = str(target)
        return self._dirs[info.base_model]
