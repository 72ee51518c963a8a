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

try:  # vLLM's hybrid allocator (several KV cache groups) for connectors that declare it
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover (depends on the vLLM installed)
    SupportsHMA = object

from kvferry.client.sdk import Client
from kvferry.client.vllm_core import (
    FP8,
    PARAMS_KEY,
    ConnectorConfig,
    Consumer,
    Heartbeats,
    KvCache,
    LoadSpec,
    Producer,
    PromMetrics,
    RefusedPrefill,
    TransferStats,
    check_remote,
    compat_record,
    fresh_blocks,
    groups_of,
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


def _groups(block_ids: Any) -> list[list[int]]:
    """vLLM's block ids per KV cache group (a flat list is one group; None none)."""
    return [] if block_ids is None else groups_of(list(block_ids))


def _as_sent(groups: list[list[int]]) -> list[int] | list[list[int]]:
    """One group as a flat list (what older decodes read), several as one list per group."""
    return groups[0] if len(groups) == 1 else groups


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


def _layout_name(vllm_config, kv_cache_config) -> str:
    """vLLM's resolved KV cache layout name (``LBHNC``...), "" where this vLLM has none."""
    return str(getattr(kv_cache_config, "kv_cache_layout", None)
               or getattr(vllm_config.cache_config, "kv_cache_layout", None) or "")


def _group_names(kv_cache_config) -> list[str]:
    """The KV cache groups as the compatibility record names them: spec type and window."""
    names = []
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        names.append(type(spec).__name__ + (f":{window}" if window else ""))
    return names


def _compat(vllm_config, kv_cache_config=None) -> dict[str, Any]:
    """What a prefill and a decode must agree on, from vLLM's configuration (the same in vLLM's
    scheduler and worker processes; the block layout is checked against the prefill's region)."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    hf = getattr(model, "hf_config", None)
    architectures = ",".join(getattr(hf, "architectures", None) or ())
    name = str(getattr(model, "model", "")).rstrip("/").rsplit("/", 1)[-1]  # the same model from another path
    mla = bool(getattr(model, "use_mla", False))
    text = getattr(model, "hf_text_config", hf)
    return compat_record(model=f"{name} ({architectures})" if architectures else name,
                         dtype=str(getattr(model, "dtype", "")), kv_cache_dtype=str(getattr(cache, "cache_dtype", "")),
                         block_size=cache.block_size, tp=parallel.tensor_parallel_size,
                         pp=parallel.pipeline_parallel_size, dp=parallel.data_parallel_size,
                         kv_heads=1 if mla else model.get_total_num_kv_heads(), head_size=model.get_head_size(),
                         layers=int(getattr(text, "num_hidden_layers", 0) or 0),
                         layout=_layout_name(vllm_config, kv_cache_config) + ("+mla" if mla else ""),
                         groups=_group_names(kv_cache_config))


def _head_dim(layout: str, tensor) -> int | None:
    """Which dimension of a page (a layer tensor without its block dimension) counts KV heads,
    from vLLM's layout name; None where this vLLM names no layout (``CacheLayout.of`` looks for
    the one dimension of the right size)."""
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        order = list(KVCacheLayout[layout.split("+")[0]].layer_view_order)  # tensor dim -> logical [B, H, N, C]
    except (ImportError, KeyError, AttributeError):
        return None
    lead = tensor.dim() - len(order)  # a leading K/V dimension some backends add
    if lead < 0:
        return None
    head, block = order.index(1) + lead, order.index(0) + lead
    return head - (block < head)


class KvferryConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.load(transfer.kv_connector_extra_config or {})
        self.compat = _compat(vllm_config, kv_cache_config)
        self.vllm_config = vllm_config
        self.dp_rank = _dp_rank(vllm_config.parallel_config)
        self._shared: dict[str, tuple[str, list[str]]] = {}  # decode: request -> leases its ranks share
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
    def _remote(self, request) -> dict[str, Any] | None:
        """Our part of a decode request's ``kv_transfer_params`` while its pull is to come; None
        otherwise, and for one naming a prefill this decode does not call (``check_remote``): that
        request's prompt is computed here, and nothing is asked of that prefill."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or PARAMS_KEY not in params:
            return None
        try:
            check_remote(params[PARAMS_KEY], self.config)
        except RefusedPrefill as exc:
            log.error("kvferry: request %s computes its prompt here: %s", request.request_id, exc)
            params["do_remote_prefill"] = False
            return None
        return dict(params[PARAMS_KEY])

    def on_new_request(self, request) -> None:
        """A decode request with a prefill's lease: renew the lease while it waits in the queue."""
        ours = self._remote(request)
        if self.heartbeats is not None and ours is not None:
            self.heartbeats.track(request.request_id, ours)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if self._remote(request) is not None:
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
        ours = self._remote(request)
        if ours is not None:
            if self.heartbeats is not None:
                self.heartbeats.untrack(request.request_id)  # the pull starts now
            # no blocks to fill (a local prefix hit covered the prompt): the pull just ends the lease
            local: tuple = ()
            starts: tuple[int, ...] = ()
            if num_external_tokens > 0:  # the prompt's blocks its prefix cache did not hold, and where they start
                local, starts = fresh_blocks(blocks.blocks)
            self._meta.loads.append(LoadSpec(request.request_id, local, ours, len(request.prompt_token_ids or ()),
                                             starts))
            if local and self.heartbeats is not None:
                shared = self.heartbeats.shared_leases(ours, self.compat)
                if shared:
                    self._shared[request.request_id] = (ours["url"], shared)
            params["do_remote_prefill"] = False  # one pull per request

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

        for request_id, new_blocks, _ in yield_req_data(scheduler_output):
            entry = self._tracked.get(request_id)
            if entry is None:
                continue
            request, ids = entry
            for group in _groups(new_blocks):
                ids.extend(group)  # the groups overlay one cache: the mirror copies their blocks alike
            scheduled = scheduler_output.num_scheduled_tokens.get(request_id, 0)
            if request.num_computed_tokens + scheduled >= request.num_prompt_tokens:
                self._meta.saves.append((request_id, list(ids)))
                self._saved.add(request_id)
                del self._tracked[request_id]
        meta, self._meta = self._meta, KvferryMetadata()
        return meta

    def update_connector_output(self, connector_output) -> None:
        """Decode: a request loaded (or failed) on every rank ends the prefill leases its ranks
        shared (``Heartbeats.shared_leases``)."""
        if not self._shared or self.heartbeats is None:
            return
        ended = set(getattr(connector_output, "finished_recving", None) or ()) | set(
            getattr(connector_output, "failed_recving", None) or ())
        for request_id in ended:
            entry = self._shared.pop(request_id, None)
            if entry is not None:
                self.heartbeats.release_later(*entry)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        """Every group: a pull carries each group's blocks."""
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        request_id = request.request_id
        self._tracked.pop(request_id, None)
        if self.heartbeats is not None:
            self.heartbeats.untrack(request_id)
        if not params:
            return False, None
        ours = self._remote(request)
        if ours is not None:
            # finished (aborted) before any block was allocated: end the prefill's lease
            self._meta.loads.append(LoadSpec(request_id, (), ours))
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode") or request_id not in self._saved:
            return False, None
        self._saved.discard(request_id)
        if request.status.name not in _SENT:
            # aborted: the worker deletes the lease now; vLLM frees the blocks once it is gone
            self._meta.abandon.append(request_id)
            return True, None
        ours = remote_params(request_id, _as_sent(_groups(block_ids)), self.config,
                             num_tokens=request.num_computed_tokens, compat=self.compat, dp_rank=self.dp_rank)
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
        dp = f"-dp{self.dp_rank}" if self.dp_rank else ""
        name = f"{self.config.region}-{self.engine_id}{dp}-r{rank}"[:128]
        num_blocks = self._kv_cache_config.num_blocks
        layers = list(kv_caches.values())
        model, parallel = self.vllm_config.model_config, self.vllm_config.parallel_config
        mla = bool(getattr(model, "use_mla", False))
        heads = None if mla else model.get_num_kv_heads(parallel)
        head_dim = None if mla or not layers else _head_dim(_layout_name(self.vllm_config, self._kv_cache_config),
                                                              layers[0])
        self.cache = KvCache(client, name, layers, num_blocks, self.config.shm_prefix, self.config.in_place,
                             fp8=FP8.get(str(self.vllm_config.cache_config.cache_dtype)), heads=heads,
                             head_dim=head_dim, block_size=self.block_size)
        layout = self.cache.layout
        log.info("kvferry: KV cache registered as %s (%d vLLM blocks as %d region blocks of %s %s, %s, %s)", name,
                 num_blocks, num_blocks * layout.planes, list(layout.block_shape), layout.dtype, self.cache.kind,
                 "vLLM's own memory" if layout.in_place else "a mirror")
        if self.producer_role:
            self.producer = Producer(self.config, self.cache, rank, dp_rank=self.dp_rank)
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


def _dp_rank(parallel) -> int:
    """This engine's data-parallel rank. vLLM runs the DP ranks of a dense model as independent
    engines of DP size 1 (``data_parallel_rank`` 0 in each) and keeps the rank in
    ``data_parallel_index``; MoE ranks keep ``data_parallel_rank``."""
    index = getattr(parallel, "data_parallel_index", None)
    return int(index if index is not None else getattr(parallel, "data_parallel_rank", 0) or 0)


def _rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 (no TP group: a single worker)
        return 0
