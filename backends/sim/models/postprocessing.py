"""The ``postprocessing`` model: token ids to text (``TOKENS_BATCH``, ``SEQUENCE_LENGTH`` in,
``OUTPUT`` out), as TensorRT-LLM's ``postprocessing`` model; the end token carries no text."""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.sim.models.common import InputError, array, error_response
from backends.sim.tokenizer import decode


def texts(tokens: np.ndarray[Any, Any], lengths: np.ndarray[Any, Any]) -> list[bytes]:
    """One text per beam of a [1, beams, L] batch, each cut at its sequence length."""
    beams = tokens.reshape(-1, tokens.shape[-1]) if tokens.size else np.zeros((1, 0), np.int32)
    cuts = lengths.reshape(-1)
    pairs = zip(beams, cuts, strict=True)
    return [decode(beam[: int(cut)].tolist()).encode("utf-8") for beam, cut in pairs]


class TritonPythonModel:
    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            tokens, lengths = array(request, "TOKENS_BATCH"), array(request, "SEQUENCE_LENGTH")
            if tokens is None or lengths is None:
                responses.append(error_response(str(InputError("TOKENS_BATCH is required"))))
                continue
            output = np.array([texts(tokens, lengths)], dtype=np.object_)
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", output)])
            )
        return responses
