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

Caches: the pool holds canonical K and V, whatever the engine's pages look like.
``register_kv_caches`` learns each layer's page form from its attention layer (backend,
the CPU backend's ISA) and the tensor's shape and strides (:func:`page_form`), proves it
by writing a probe through the backend's own ``do_kv_cache_update`` into a scratch cache
(:func:`kvclient.layouts.certify`), and refuses anything it cannot map or prove (MLA,
fp8 caches, the CPU backend's ARM/Power/RISC-V kernels) with
:class:`~kvclient.layouts.LayoutError`.
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
from .layouts import FORMS, LayoutError, Writer, certify, halves
from .lazy import PoolLink

__all__ = [
    "KVStoreConnector",
    "KVStoreConnectorMetadata",
    "backend_of",
    "namespace_of",
    "page_form",
    "writer_of",
]

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


_BHNC_BACKENDS = frozenset(
    {"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "ROCM_ATTN", "ROCM_AITER_FA"}
)
"""Backends whose ``[B, H, N, 2*D]`` cache holds K in ``C[:D]`` and V in ``C[D:]`` (each
splits it with ``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` in vLLM 0.32)."""

_CPU_DN_ISAS = frozenset({"vec", "vec16"})
"""vLLM CPU backend ISAs whose pages hold K as ``[D, N]`` then V as ``[N, D]`` per head."""


def backend_of(layer: Any) -> str:
    """The attention backend's name of a vLLM attention layer ("" when it has none)."""
    backend = getattr(layer, "attn_backend", None)
    try:
        return str(backend.get_name()) if backend is not None else ""
    except Exception:  # a backend class that cannot name itself is not one we know
        return ""


def page_form(t: torch.Tensor, layer: Any, head_dim: int, name: str) -> tuple[str, str]:
    """(page form, description) of layer ``name``'s cache ``t``, from its attention layer
    (backend, and for vLLM's CPU backend the ISA its kernels were chosen for) and the
    tensor's shape. Raises :class:`~kvclient.layouts.LayoutError` naming the backend and
    shape for anything else: MLA's latent caches, quantized (fp8) caches, vLLM's CPU
    pages of ISAs other than vec, vec16 and amx, and a 4-D cache of a backend not known
    to keep K in ``C[:D]``."""
    backend = backend_of(layer)
    isa = getattr(layer, "isa", None)
    what = f"{name}: backend {backend or 'unknown'}{f' (isa {isa})' if isa else ''}, " + (
        f"cache {tuple(t.shape)} {t.dtype} strides {tuple(t.stride())}"
    )
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise LayoutError(f"{what}: kvstore stores float16, bfloat16 and float32 KV only")
    if t.dim() == 5 and t.shape[0] == 2 and t.shape[1] == 2 and t.shape[-1] == head_dim:
        raise LayoutError(f"{what}: 5-D with 2 at dims 0 and 1, K and V could be either")
    if t.dim() == 5 and t.shape[-1] == head_dim and t.shape[0] == 2:
        return "kv_first", what
    if t.dim() == 5 and t.shape[-1] == head_dim and t.shape[1] == 2:
        return "blocks_first", what
    if t.dim() == 4 and t.shape[-1] == 2 * head_dim:
        if backend == "CPU_ATTN" and isa in _CPU_DN_ISAS:
            return "cpu_dn", what
        if backend == "CPU_ATTN" and isa == "amx":
            return "cpu_amx", what
        if backend in _BHNC_BACKENDS:
            return "bhnc", what
        if backend == "CPU_ATTN":
            raise LayoutError(
                f"{what}: the CPU backend's {isa!r} kernels write pages kvstore does not map "
                "(it maps the vec, vec16 and amx ISAs' pages)"
            )
    raise LayoutError(
        f"{what}: not a page form kvstore maps onto K and V ({FORMS}); see "
        "docs/engine-integration.md, 'Layouts'"
    )


def writer_of(layer: Any) -> Writer | None:
    """The engine's own cache write of ``layer`` (its attention impl's
    ``do_kv_cache_update``), which :func:`~kvclient.layouts.certify` probes; None where the
    backend has none."""
    impl = getattr(layer, "impl", None)
    update = getattr(impl, "do_kv_cache_update", None)
    if update is None:
        return None

    def write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
              ) -> None:  # fmt: skip
        update(layer, key, value, cache, slots)

    return write


def _forward_context(vllm_config: Any) -> dict[str, Any]:
    """vLLM's attention layers by name (``compilation_config.static_forward_context``)."""
    compilation = getattr(vllm_config, "compilation_config", None)
    return dict(getattr(compilation, "static_forward_context", None) or {})


def _check_block_size(block_size: int, t: torch.Tensor, what: str) -> None:
    """The scheduler's block ids index the cache: refuse a cache whose blocks are vLLM's
    smaller kernel blocks (its mapping from scheduler blocks to them is the engine's).
    Every page form's tensor has its tokens per block at dim 2."""
    if int(t.shape[2]) != block_size:
        raise LayoutError(
            f"{what}: cache blocks of {int(t.shape[2])} tokens, scheduler blocks of "
            f"{block_size}: kernel block splitting is not supported; use a --block-size "
            "the attention backend supports as is"
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
        self._vllm_config = vllm_config
        self._bound: ConnectorMetadata | None = None
        self._blocks: dict[str, list[int]] = {}  # running requests' blocks, as they grew
        transfer = vllm_config.kv_transfer_config
        extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
        if "master" not in extra:
            raise ValueError("kv_connector_extra_config needs 'master' (the kvstore address)")
        kv_role = str(getattr(transfer, "kv_role", "kv_both"))
        ns = namespace_of(vllm_config, extra)
        timeout_s = float(extra.get("timeout_s", 10.0))
        kv = PoolLink(  # never raises for a pool that is down: the engine must start
            str(extra["master"]), ns, timeout_s=timeout_s,
            retry_s=float(extra.get("retry_s", 1.0)),
            max_retry_s=float(extra.get("max_retry_s", 30.0)),
        )  # fmt: skip
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
        """Map each layer's cache onto K and V views (:func:`page_form`), certify each
        distinct form once by a probe through the engine's own write (where the backend
        has one), and hand the views to the worker. Raises
        :class:`~kvclient.layouts.LayoutError` for a cache it cannot certify."""
        D = self._kv.ns.head_dim
        layers = _forward_context(self._vllm_config)
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        certified: set[tuple[Any, ...]] = set()
        bs = int(self._vllm_config.cache_config.block_size)
        for name, t in kv_caches.items():
            layer = layers.get(name)
            form, what = page_form(t, layer, D, name)
            pairs[name] = halves(t, form, D)
            _check_block_size(bs, t, what)
            sig = (form, backend_of(layer), tuple(t.shape[1:]), t.stride(), t.dtype)
            if sig in certified:
                continue
            write = writer_of(layer)
            if write is None:
                logger.info("%s: page form %s from the backend, no write path to probe", what, form)
            else:
                certify(t, form, D, write, what)
            certified.add(sig)
        self._work().register_kv_caches(pairs, layout="kv_pair")

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
