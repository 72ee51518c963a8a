"""``KvferryConnector``: vLLM's KV connector (v1 API) over kvferry sidecars, loaded out of tree.

    --kv-transfer-config '{"kv_connector": "KvferryConnector", "kv_connector_module_path": "kvferry.vllm",
                           "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                           "kv_connector_extra_config": {"url": "http://127.0.0.1:7700", "codec": "auto"}}'

Only the glue between vLLM's hooks and ``kvferry.client.vllm_core`` lives here (the core is
tested without vLLM). A P/D proxy sends the prompt to the prefill with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``, then to the decode with the
``kv_transfer_params`` the prefill answered (``examples/vllm-pd/proxy.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvferry.client.sdk import Client
from kvferry.client.vllm_core import (
    PARAMS_KEY,
    ConnectorConfig,
    Consumer,
    Heartbeats,
    IncompatibleCache,
    KvCache,
    LoadSpec,
    Producer,
    PromMetrics,
    TransferStats,
    compat_record,
    remote_params,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvferry.vllm")

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
except ImportError:  # pragma: no cover (an older vLLM: no connector statistics)
    KVConnectorPromMetrics = KVConnectorStats = object

try:  # vLLM >= 0.32 reports failed loads per request; older ones per block only
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover (depends on the vLLM installed)
    KVConnectorTransferResults = None

_SENT = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


@dataclass
class KvferryMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers each step."""

    saves: list[tuple[str, list[int]]] = field(default_factory=list)  # prefill: prompts computed this step
    abandon: list[str] = field(default_factory=list)  # prefill: saved requests vLLM aborted (end their leases now)
    loads: list[LoadSpec] = field(default_factory=list)  # decode: pulls to start


def _first_group(block_ids: Any) -> list[int]:
    """vLLM passes block ids per KV cache group; kvferry carries single-group (full attention) models."""
    if block_ids is None:
        return []
    if len(block_ids) and isinstance(block_ids[0], (list, tuple)):
        if len(block_ids) > 1:
            raise IncompatibleCache("kvferry carries models with one KV cache group (full attention) only")
        return list(block_ids[0])
    return list(block_ids)


class KvferryStats(TransferStats, KVConnectorStats):
    """The connector's statistics as vLLM collects them from the workers (``TransferStats``)."""

    def __init__(self, data: dict[str, Any] | None = None):
        TransferStats.__init__(self, data)


class KvferryPromMetrics(PromMetrics, KVConnectorPromMetrics):
    """The statistics in vLLM's own ``/metrics`` (``vllm:kvferry_*``)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        KVConnectorPromMetrics.__init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues)
        PromMetrics.__init__(self, metric_types, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        PromMetrics.observe(self, transfer_stats_data, engine_idx)


def _compat(vllm_config) -> dict[str, Any]:
    """What a prefill and a decode must agree on, from vLLM's configuration (the same in vLLM's
    scheduler and worker processes; the block layout is checked against the prefill's region)."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    hf = getattr(model, "hf_config", None)
    architectures = ",".join(getattr(hf, "architectures", None) or ())
    name = str(getattr(model, "model", "")).rstrip("/").rsplit("/", 1)[-1]  # the same model from another path
    return compat_record(model=f"{name} ({architectures})" if architectures else name,
                         dtype=str(getattr(model, "dtype", "")), kv_cache_dtype=str(getattr(cache, "cache_dtype", "")),
                         block_size=cache.block_size, tp=parallel.tensor_parallel_size,
                         pp=parallel.pipeline_parallel_size, dp=parallel.data_parallel_size)


class KvferryConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.load(transfer.kv_connector_extra_config or {})
        self.compat = _compat(vllm_config)
        self.heartbeats = Heartbeats(self.config) if role == KVConnectorRole.SCHEDULER and transfer.is_kv_consumer \
            else None
        self.engine_id = transfer.engine_id or "engine"
        self.producer_role = transfer.is_kv_producer
        self.consumer_role = transfer.is_kv_consumer
        self.block_size = vllm_config.cache_config.block_size
        # scheduler side
        self._tracked: dict[str, tuple[Any, list[int]]] = {}  # prefill requests still computing their prompt
        self._saved: set[str] = set()
        self._meta = KvferryMetadata()
        # worker side
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.cache: KvCache | None = None
        self._failed: set[str] = set()
        self._failed_blocks: set[int] = set()

    # ---- scheduler side --------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        """A decode request with a prefill's lease: renew the lease while it waits in the queue."""
        params = request.kv_transfer_params
        if self.heartbeats is not None and params and params.get("do_remote_prefill") and PARAMS_KEY in params:
            self.heartbeats.track(request.request_id, dict(params[PARAMS_KEY]))

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and PARAMS_KEY in params:
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode") and self.producer_role:
            self._tracked.setdefault(request.request_id, (request, []))
        if params.get("do_remote_prefill") and PARAMS_KEY in params:
            if self.heartbeats is not None:
                self.heartbeats.untrack(request.request_id)  # the pull starts now
            local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
            # no blocks to fill (a local prefix hit covered the prompt): the pull just ends the lease
            self._meta.loads.append(LoadSpec(request.request_id, tuple(local), dict(params[PARAMS_KEY])))
            params["do_remote_prefill"] = False  # one pull per request

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

        for request_id, new_blocks, _ in yield_req_data(scheduler_output):
            entry = self._tracked.get(request_id)
            if entry is None:
                continue
            request, ids = entry
            ids.extend(_first_group(new_blocks))
            scheduled = scheduler_output.num_scheduled_tokens.get(request_id, 0)
            if request.num_computed_tokens + scheduled >= request.num_prompt_tokens:
                self._meta.saves.append((request_id, list(ids)))
                self._saved.add(request_id)
                del self._tracked[request_id]
        meta, self._meta = self._meta, KvferryMetadata()
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        request_id = request.request_id
        self._tracked.pop(request_id, None)
        if self.heartbeats is not None:
            self.heartbeats.untrack(request_id)
        if not params:
            return False, None
        if params.get("do_remote_prefill") and PARAMS_KEY in params:
            # finished (aborted) before any block was allocated: end the prefill's lease
            self._meta.loads.append(LoadSpec(request_id, (), dict(params[PARAMS_KEY])))
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode") or request_id not in self._saved:
            return False, None
        self._saved.discard(request_id)
        if request.status.name not in _SENT:
            # aborted: the worker deletes the lease now; vLLM frees the blocks once it is gone
            self._meta.abandon.append(request_id)
            return True, None
        blocks = _first_group(block_ids)
        ours = remote_params(request_id, blocks, self.config, num_tokens=request.num_computed_tokens,
                             compat=self.compat)
        ours["block_size"] = self.block_size
        if params.get("kvferry_codec"):  # the client's choice for this request, else the decode's setting
            ours["codec"] = str(params["kvferry_codec"])
        return True, {"do_remote_prefill": True, "do_remote_decode": False, PARAMS_KEY: ours}

    # ---- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the cache with the local sidecar once.

        Raises: IncompatibleCache (a layout kvferry cannot carry), EngineError or httpx errors
        (the sidecar is not there: vLLM should not start half-connected).
        """
        rank = _rank()
        client = Client(self.config.url, token=self.config.token)
        name = f"{self.config.region}-{self.engine_id}-r{rank}"[:128]
        num_blocks = self._kv_cache_config.num_blocks
        self.cache = KvCache(client, name, list(kv_caches.values()), num_blocks, self.config.shm_prefix,
                             self.config.in_place)
        layout = self.cache.layout
        log.info("kvferry: KV cache registered as %s (%d vLLM blocks as %d region blocks of %s %s, %s, %s)", name,
                 num_blocks, num_blocks * layout.planes, list(layout.block_shape), layout.dtype, self.cache.kind,
                 "vLLM's own memory" if layout.in_place else "a mirror")
        if self.producer_role:
            self.producer = Producer(self.config, self.cache, rank)
        if self.consumer_role:
            self.consumer = Consumer(self.config, self.cache, rank, compat=self.compat)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self.consumer is None or not isinstance(meta, KvferryMetadata):
            return
        for spec in meta.loads:
            self.consumer.start(spec)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete between steps (asynchronous loads)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # saved once per request, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self.producer is None or not isinstance(meta, KvferryMetadata):
            return
        for request_id, block_ids in meta.saves:
            self.producer.save(request_id, block_ids)
        self.producer.abandon(meta.abandon)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending = self.producer.finished_sending(finished_req_ids) if self.producer else set()
        received: set[str] = set()
        if self.consumer is not None:
            received, failed = self.consumer.poll()
            self._failed |= failed
            for request_id in failed:
                self._failed_blocks.update(self.consumer.failed_blocks.pop(request_id, ()))
            received |= failed  # failed loads are finished too; vLLM learns which failed below
        return sending or None, received or None

    def get_transfer_results(self, finished_req_ids: set[str]):
        sending, received = self.get_finished(finished_req_ids)
        failed, self._failed = self._failed, set()
        self._failed_blocks.clear()  # reported per request here
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(received or ()),
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        blocks, self._failed_blocks = self._failed_blocks, set()
        return blocks

    def get_kv_connector_stats(self) -> KvferryStats | None:
        """This worker's statistics since the last call (vLLM calls it after each step)."""
        if self.consumer is None:
            return None
        taken = self.consumer.interval.take()
        return None if taken is None else KvferryStats(taken.data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvferryStats:
        return KvferryStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KvferryPromMetrics:
        return KvferryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.heartbeats is not None:
            self.heartbeats.close()
        if self.producer is not None:
            self.producer.close()
        if self.consumer is not None:
            self.consumer.close()
        if self.cache is not None:
            self.cache.close()
            self.cache = None


if KVConnectorTransferResults is None:  # pragma: no cover (older vLLM: per-block failures)
    del KvferryConnector.get_transfer_results


def _rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 (no TP group: a single worker)
        return 0
