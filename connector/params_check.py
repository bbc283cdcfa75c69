"""Refuse a bad ``kv_transfer_params`` at admission, as an HTTP 400 naming it.

Why a logits processor: vLLM 0.32 gives a KV connector no hook of its own
that runs before a request is admitted; the connector first sees a request
in the engine core, where refusing it could only end it as a server error
(or, with ``kv_load_failure_policy: fail``, as a failed load that names
nothing). vLLM does run every custom logits processor's ``validate_params``
on each request in the API server, and turns a ``VLLMValidationError``
raised there into a 400 that names the parameter. This class is that check
and nothing else: it never changes a logit, and says so
(``is_argmax_invariant``), so vLLM skips it on the sampling path.

Enable it with ``--logits-processors kvstrata.connector.params_check:KVStrataParamsCheck``
(the quick start and the webhook's vLLM arguments do). Without it, the
connector still never acts on params it cannot read: that request gets no
load and no store (``kvstrata.connector.request_tiers.NOTHING``), logged
and counted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from kvstrata.connector.request_tiers import ROOT, KVTransferParamsError, parse_request_tiers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams

__all__ = ["KVStrataParamsCheck"]


class KVStrataParamsCheck(LogitsProcessor):
    """Validates ``kv_transfer_params`` at admission; a no-op on logits."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        extra: dict[str, Any] = sampling_params.extra_args or {}
        try:
            parse_request_tiers(extra.get("kv_transfer_params"))
        except KVTransferParamsError as exc:
            raise VLLMValidationError(str(exc), parameter=ROOT) from exc

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        pass  # no state: the check is per request, at admission

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass
