"""The ``preprocessing`` model: text to token ids with the stand-in tokenizer.

Inputs and outputs are those of TensorRT-LLM's ``preprocessing`` model (``QUERY``,
``REQUEST_OUTPUT_LEN``, ``BAD_WORDS_DICT``, ``STOP_WORDS_DICT``, ``END_ID``, ``PAD_ID`` in;
``INPUT_ID``, ``REQUEST_INPUT_LEN``, ``REQUEST_OUTPUT_LEN``, ``BAD_WORDS_IDS``,
``STOP_WORDS_IDS``, ``OUT_END_ID``, ``OUT_PAD_ID`` out). The tokenizer's end and pad ids come
from ``tokenizer_dir``, as the real model reads them from a Hugging Face tokenizer there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.sim.models.common import (
    InputError,
    array,
    error_response,
    parameters,
    scalar,
    tensor,
    word_list,
)
from backends.sim.tokenizer import EOS_ID, encode

TOKENIZER_FILE = "tokenizer_config.json"


def _words(request: Any, name: str) -> list[list[int]]:
    values = array(request, name)
    if values is None:
        return []
    words = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values.reshape(-1)]
    return [encode(word) for word in words if word]


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        directory = parameters(args).get("tokenizer_dir", "")
        config: dict[str, Any] = {}
        if directory:
            config = json.loads((Path(directory) / TOKENIZER_FILE).read_text())
        self.end_id = int(config.get("eos_token_id", EOS_ID))
        self.pad_id = int(config.get("pad_token_id", self.end_id))

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=self._tensors(request)))
            except (InputError, UnicodeDecodeError) as exc:
                responses.append(error_response(str(exc)))
        return responses

    def _tensors(self, request: Any) -> list[Any]:
        query = scalar(request, "QUERY", b"")
        text = query.decode("utf-8") if isinstance(query, bytes) else str(query)
        ids = encode(text)
        output_len = int(scalar(request, "REQUEST_OUTPUT_LEN", 16))
        return [
            tensor("INPUT_ID", [ids], np.int32),
            tensor("REQUEST_INPUT_LEN", [[len(ids)]], np.int32),
            tensor("REQUEST_OUTPUT_LEN", [[output_len]], np.int32),
            pb_utils.Tensor("BAD_WORDS_IDS", word_list(_words(request, "BAD_WORDS_DICT"))),
            pb_utils.Tensor("STOP_WORDS_IDS", word_list(_words(request, "STOP_WORDS_DICT"))),
            tensor("OUT_END_ID", [[int(scalar(request, "END_ID", self.end_id))]], np.int32),
            tensor("OUT_PAD_ID", [[int(scalar(request, "PAD_ID", self.pad_id))]], np.int32),
        ]
