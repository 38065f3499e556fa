"""kvstore as a vLLM V1 KV connector, loaded by vLLM from its ``kv_connector_module_path``.

vLLM is not a dependency: where it is installed, :class:`KVStoreConnector` subclasses its
``KVConnectorBase_V1`` (so vLLM's defaults fill every optional hook); where it is not, the
class still imports and works on any objects with the attributes vLLM's have, which is
how the test suite drives it. Configure it with::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
      "kv_connector_module_path": "kvclient.vllm_connector",
      "kv_role": "kv_both",
      "kv_connector_extra_config": {"master": "10.0.0.5:50051", "block_tokens": 256,
                                    "quant": "int8", "timeout_s": 10, "hold_s": 10}}'

``kv_role`` ``kv_producer`` saves only (a prefill instance), ``kv_consumer`` loads only (a
decode instance), ``kv_both`` does both. The namespace is the model's (name, revision,
layers, KV heads per TP shard, head size, dtype) plus ``block_tokens`` and ``quant``; a
``cache_salt`` in the extra config separates tenants. The engine-neutral logic is
:mod:`kvclient.connector`; this module only translates vLLM's objects.

Supported caches: one tensor per layer in the ``[2, num_blocks, block_size, H, D]``
(FlashAttention) or ``[num_blocks, 2, block_size, H, D]`` (FlashInfer) layout, or vLLM
0.33's standardized ``[B, H, N, C]`` views (K then V along C): :func:`kv_first_view`.
``register_kv_caches`` refuses others (e.g. MLA's) with a clear error.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvstore.core.hashing import Namespace

from .connector import (
    ConnectorMetadata,
    ScheduledRequest,
    SchedulerConnector,
    WorkerConnector,
)
from .sync import SyncKVClient

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata", "kv_first_view", "namespace_of"]

logger = logging.getLogger("kvclient.vllm")

try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1 as _Base,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata as _MetaBase,
    )

    _HAVE_VLLM = True
except ImportError:
    _Base, _MetaBase, _HAVE_VLLM = object, object, False


class KVStoreConnectorMetadata(_MetaBase):  # type: ignore[misc, valid-type]
    """vLLM's metadata type around ours (vLLM passes it from scheduler to workers)."""

    def __init__(self, meta: ConnectorMetadata) -> None:
        self.meta = meta


def kv_first_view(t: torch.Tensor, head_dim: int, name: str = "KV cache") -> torch.Tensor:
    """A layer's paged cache as a ``[2, num_blocks, block_size, H, D]`` view (no copy).

    Accepts ``[2, num_blocks, block_size, H, D]`` (FlashAttention), ``[num_blocks, 2,
    block_size, H, D]`` (FlashInfer) and vLLM 0.33's standardized ``[B, H, N, C]`` views
    whose C is K's head then V's (``C == 2 * head_dim``), in any physical order: V is K
    shifted by ``head_dim`` along C, which one stride expresses. Raises ``ValueError`` for
    anything else (MLA's latent caches among them).
    """
    if t.dim() == 5 and t.shape[0] == 2:
        return t
    if t.dim() == 5 and t.shape[1] == 2:
        return t.transpose(0, 1)
    if t.dim() == 4 and t.shape[-1] == 2 * head_dim:
        B, H, N, _ = t.shape
        s = t.stride()
        strides = (head_dim * s[3], s[0], s[2], s[1], s[3])
        return t.as_strided((2, B, N, H, head_dim), strides, t.storage_offset())
    raise ValueError(
        f"{name} is {tuple(t.shape)}: kvstore's connector supports [2, num_blocks, block_size, "
        f"H, D], [num_blocks, 2, block_size, H, D] and [B, H, N, 2*D] (D={head_dim})"
    )


def _role_name(role: Any) -> str:
    return str(getattr(role, "name", role)).upper()


def namespace_of(vllm_config: Any, extra: dict[str, Any]) -> Namespace:
    """The pool namespace of the model vLLM serves."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    return Namespace(
        model=str(model.model),
        revision=str(getattr(model, "revision", None) or "main"),
        num_layers=int(model.get_num_layers(parallel)),
        num_kv_heads=int(model.get_num_kv_heads(parallel)),
        head_dim=int(model.get_head_size()),
        dtype=model.dtype,
        block_tokens=int(extra.get("block_tokens", 256)),
        quant=str(extra.get("quant", "int8")),
        cache_salt=extra.get("cache_salt"),
        tp_size=int(getattr(parallel, "tensor_parallel_size", 1)),
    )


class KVStoreConnector(_Base):  # type: ignore[misc, valid-type]
    """vLLM's connector interface over :class:`~kvclient.connector.SchedulerConnector`
    (role SCHEDULER) or :class:`~kvclient.connector.WorkerConnector` (role WORKER)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        if _HAVE_VLLM:  # pragma: no cover
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._bound: ConnectorMetadata | None = None
        self._blocks: dict[str, list[int]] = {}  # running requests' blocks, as they grew
        transfer = vllm_config.kv_transfer_config
        extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
        if "master" not in extra:
            raise ValueError("kv_connector_extra_config needs 'master' (the kvstore address)")
        kv_role = str(getattr(transfer, "kv_role", "kv_both"))
        ns = namespace_of(vllm_config, extra)
        timeout_s = float(extra.get("timeout_s", 10.0))
        kv = SyncKVClient.connect(str(extra["master"]), ns, timeout_s=timeout_s)
        self._kv = kv
        self.is_scheduler = _role_name(role) == "SCHEDULER"
        self.scheduler: SchedulerConnector | None = None
        self.worker: WorkerConnector | None = None
        if self.is_scheduler:
            self.scheduler = SchedulerConnector(
                kv,
                int(vllm_config.cache_config.block_size),
                load=kv_role in ("kv_consumer", "kv_both"),
                save=kv_role in ("kv_producer", "kv_both"),
                hold_s=float(extra.get("hold_s", 10.0)),
            )
        else:
            rank = int(getattr(vllm_config.parallel_config, "rank", 0))
            tp = ns.tp_size
            stream_s = float(extra.get("stream_timeout_s", 60.0))
            self.worker = WorkerConnector(
                kv, shard=rank % tp, timeout_s=timeout_s, stream_timeout_s=stream_s
            )

    # ------------------------------------------------------------ scheduler side

    def _sched(self) -> SchedulerConnector:
        if self.scheduler is None:
            raise RuntimeError("a scheduler-side call on the worker-side connector")
        return self.scheduler

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(
            request.request_id,
            request.prompt_token_ids or [],
            num_computed_tokens,
            getattr(request, "kv_transfer_params", None),
        )

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self._sched().update_state_after_alloc(request.request_id, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        scheduled: list[ScheduledRequest] = []
        counts = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            scheduled.append(
                ScheduledRequest(
                    new.req_id,
                    new.prompt_token_ids or [],
                    new.block_ids[0],
                    new.num_computed_tokens,
                    counts.get(new.req_id, 0),
                )
            )
        cached = scheduler_output.scheduled_cached_reqs
        sched = self._sched()
        for i, req_id in enumerate(cached.req_ids):
            prompt = sched.prompt_of(req_id)
            if prompt is None:
                continue
            new_ids = cached.new_block_ids[i]
            resumed = req_id in (getattr(cached, "resumed_req_ids", None) or ())
            kept = [] if resumed else self._blocks.get(req_id, [])  # resumed: all blocks anew
            blocks = list(kept) + (list(new_ids[0]) if new_ids else [])
            self._blocks[req_id] = blocks
            scheduled.append(
                ScheduledRequest(
                    req_id,
                    prompt,
                    blocks,
                    cached.num_computed_tokens[i],
                    counts.get(req_id, 0),
                )
            )
        for new in scheduler_output.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
        return KVStoreConnectorMetadata(sched.build_connector_meta(scheduled))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        status = str(getattr(getattr(request, "status", None), "name", ""))
        aborted = status == "FINISHED_ABORTED"
        self._blocks.pop(request.request_id, None)
        outputs = getattr(request, "output_token_ids", None)
        return self._sched().request_finished(
            request.request_id, aborted=aborted, output_token_ids=list(outputs or [])
        )

    # ------------------------------------------------------------ worker side

    def _work(self) -> WorkerConnector:
        if self.worker is None:
            raise RuntimeError("a worker-side call on the scheduler-side connector")
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        D = self._kv.ns.head_dim
        views = {name: kv_first_view(t, D, name) for name, t in kv_caches.items()}
        self._work().register_kv_caches(views, layout="kv_first")

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._bound = connector_metadata.meta
        self._work().bind_connector_metadata(connector_metadata.meta)

    def clear_connector_metadata(self) -> None:
        self._bound = None
        self._work().clear_connector_metadata()

    def has_connector_metadata(self) -> bool:
        return self._bound is not None

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        self._work().start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None, **kwargs: Any
    ) -> None:
        self._work().save_kv_layer(layer_name)  # the registered view of this very cache

    def wait_for_save(self) -> None:
        self._work().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, received = self._work().get_finished(finished_req_ids)
        return sent or None, received or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        self._kv.close()
