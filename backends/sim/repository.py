"""Write a stand-in replica's files: TensorRT-LLM's model repository, its engine and tokenizer.

Under one replica's directory::

    models/                  the Triton model repository (``--model-repository``)
      ensemble/config.pbtxt  platform ensemble: preprocessing -> tensorrt_llm -> postprocessing
      preprocessing/         text -> input_ids (config.pbtxt, 1/model.py)
      tensorrt_llm/          the engine (decoupled); gpt_model_path names ../../engine
      postprocessing/        output_ids -> text
    engine/                  config.json and rank0.engine, as trtllm-build leaves them
    tokenizer/               tokenizer_config.json (end and pad ids, the chat template)

The layout, names and parameters are those of TensorRT-LLM's ``inflight_batcher_llm`` models
(see :mod:`backends.sim.configs`), so a client, or the proxy, meets the same topology, final
responses, counters and metrics as on a GPU. Each ``1/model.py`` imports its model class from
:mod:`backends.sim.models` (the project is installed where the Python-backend stub runs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from backends.sim import configs
from backends.sim.engine_files import EngineBuild, Precision, build_engine
from backends.sim.tokenizer import CHAT_TEMPLATE, EOS_ID, VOCAB_SIZE

__all__ = ["ENGINE_MODEL", "MODEL_NAME", "ModelSettings", "Precision", "write_repository"]

MODEL_NAME = "ensemble"  # the model clients call
ENGINE_MODEL = "tensorrt_llm"  # the model every path to the KV cache goes through
MODELS = (MODEL_NAME, *configs.STEPS)


@dataclass(frozen=True)
class ModelSettings:
    """What one replica's model is: its cache behaviour (model config) and its engine (build)."""

    reuse: bool = True
    tokens_per_block: int = 16
    max_tokens_in_paged_kv_cache: int = 131072
    precision: Precision = "bf16"
    weight_seed: int = 0
    max_input_len: int = 32768
    max_seq_len: int = 0  # 0: max_input_len + 4096
    partial_reuse: bool = True  # KvCacheConfig::enablePartialReuse, on by default
    chunked_context: bool = True  # the prompt limit is then max_seq_len - 1 (trtGptModel.h)

    def engine_build(self) -> EngineBuild:
        return EngineBuild(
            precision=self.precision,
            weight_seed=self.weight_seed,
            tokens_per_block=self.tokens_per_block,
            max_input_len=self.max_input_len,
            max_seq_len=self.max_seq_len or self.max_input_len + 4096,
        )


def engine_dir(root: Path) -> Path:
    """Where a replica directory keeps its engine (what ``gpt_model_path`` names)."""
    return root / "engine"


def write_repository(root: Path, settings: ModelSettings) -> Path:
    """Lay out ``root/models``, ``root/engine`` and ``root/tokenizer``; returns ``root/models``."""
    models, tokenizer = root / "models", root / "tokenizer"
    engine = build_engine(engine_dir(root), settings.engine_build())
    tokenizer.mkdir(parents=True, exist_ok=True)
    token_config = {
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
        "vocab_size": VOCAB_SIZE,
        "chat_template": CHAT_TEMPLATE,
    }
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(token_config, indent=2) + "\n")
    texts = {
        "ensemble": configs.ensemble(),
        "preprocessing": configs.preprocessing(str(tokenizer.resolve())),
        "tensorrt_llm": configs.tensorrt_llm(
            str(engine.resolve()),
            settings.reuse,
            settings.max_tokens_in_paged_kv_cache,
            partial_reuse=settings.partial_reuse,
            chunked_context=settings.chunked_context,
        ),
        "postprocessing": configs.postprocessing(str(tokenizer.resolve())),
    }
    for name, text in texts.items():
        (models / name / "1").mkdir(parents=True, exist_ok=True)  # an ensemble needs one too
        (models / name / "config.pbtxt").write_text(text)
        if name != MODEL_NAME:
            shim = f"from backends.sim.models.{name} import TritonPythonModel  # noqa: F401\n"
            (models / name / "1" / "model.py").write_text(shim)
    return models
