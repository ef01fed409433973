"""What one rank trains: its model part wrapped for the mesh, optimizer, data, checkpoint IO.

No Ray here: :class:`trainmesh.actors.rank_worker.RankWorker` hosts an Engine inside an actor.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from trainmesh.checkpoint import dcp_io, snapshot_io
from trainmesh.checkpoint.memory_fs import MemoryStore
from trainmesh.data.dataset import Prefetcher, open_datasets
from trainmesh.engine.memory import SavedActivations, peak_process_bytes, state_bytes
from trainmesh.engine.rng import RankStreams
from trainmesh.engine.step import (
    StepHooks,
    StepStats,
    build_lr_scheduler,
    build_optimizer,
    finish_step,
    train_step,
)
from trainmesh.engine.step_timing import ForwardTimer, StepClock
from trainmesh.models.hooks import ModelHooks
from trainmesh.models.llama.model import Llama, LlamaArgs, mtp_blocks
from trainmesh.models.llama.parallelize import (
    apply_activation_checkpointing,
    apply_compile,
    apply_context_parallel,
    apply_float8,
    apply_tensor_parallel,
    embedding_style,
    sum_partial_grads_over_tp,
    tp_partial_params,
)
from trainmesh.models.llama.stage import PipelineStage, rank_model
from trainmesh.parallel.clock import WaitLog
from trainmesh.parallel.context import ContextParallel, local_positions, local_spans
from trainmesh.parallel.dims import AXES, Axis, replicates
from trainmesh.parallel.expert import (
    ExchangeLog,
    apply_expert_parallel,
    expert_divide_factor,
    is_moe,
    sum_over_token_ranks,
)
from trainmesh.parallel.mesh import Mesh
from trainmesh.parallel.pipeline.executor import P2PSpec, PipelineExecutor
from trainmesh.parallel.pipeline.ir import PipeShape, splits_backward
from trainmesh.parallel.pipeline.schedules import build_schedule, forward_only, pairs_of, pipe_shape
from trainmesh.parallel.pipeline.shared import LocalCopy, SharedAcrossStages, embedding_across_stages
from trainmesh.parallel.zero import (
    ExpertSharding,
    ReplicatePolicy,
    ZeroPolicy,
    apply_replicate,
    apply_zero3,
)
from trainmesh.spec.job import JobSpec
from trainmesh.spec.mesh_rules import consecutive_nodes, float8_device_problems, microbatches_per_replica


def build_model(spec: JobSpec, device: torch.device) -> Llama:
    """The whole single-device model, initialised from ``training.seed`` (or
    ``model.init_from``)."""
    model = Llama(LlamaArgs.from_config(spec.model, device.type))
    init_weights(model, spec)
    return model.to(device)


def init_weights(model: Llama, spec: JobSpec) -> int:
    """Fill a (possibly sharded) model part: from ``model.init_from`` (returns the bytes read),
    or the seeded init (0)."""
    if spec.model.init_from:
        from trainmesh.interop.hf_import import load_into

        if getattr(model, "mtp", None) is not None:  # seeded first: modules the directory
            model.init_weights(spec.training.seed)  # does not hold keep these
        return load_into(model, spec.model.init_from)
    model.init_weights(spec.training.seed)
    return 0


def _microbatches(dataset, seed: int, global_batch: int, dp_rank: int, dp: int,
                  microbatch_size: int, spans, step: int) -> list:
    return dataset.microbatches(seed, step, global_batch, dp_rank, dp, microbatch_size, spans)


class Engine:
    """Model + optimizer + data for one rank of ``mesh``."""

    def __init__(self, spec: JobSpec, mesh: Mesh, data_dir: str, device: torch.device,
                 on_phase: Callable[[str], None] = lambda phase: None,
                 p2p: Callable[[timedelta], Callable] | None = None):
        """``on_phase`` hears each phase of a step as it begins (``actors/progress.py``);
        ``p2p`` makes, from the collective timeout, what posts the pipeline's and the ring's
        point-to-point batches (None: ``dist.batch_isend_irecv``). The composition root: each
        step below is one method, in the order parallelisms compose (TP, then activation
        checkpointing, then compile, then ZeRO-3)."""
        self.spec, self.mesh, self.device, self.on_phase = spec, mesh, device, on_phase
        self._p2p_factory = p2p
        tr = spec.training
        self._batch_geometry()
        eos = self._open_data(data_dir)
        stage_ids = self._build_on_meta()
        # Every shard group one rank (dp_replicate = dp): plain replication, DDP's all-reduce.
        self.replicated = replicates(mesh.dims.dp, mesh.dp_replicate, mesh.size(Axis.PP),
                                     mesh.size(Axis.TP), mesh.size(Axis.CP), is_moe(self.model))
        experts = self._parallelize(eos)
        model_hooks = self._model_hooks()
        self._shard(stage_ids, experts, model_hooks.before_microbatch)
        # Each block's own forward time (hooks after ZeRO-3's: its gathers are not counted).
        self.forward_timer = ForwardTimer(self.model.layers.values(), self._wait_logs())
        self._materialise(model_hooks)
        # (the parameters as ZeRO-3 left them: it replaces the ones it shards)
        partial = tp_partial_params(self.model) if mesh.size(Axis.TP) > 1 else []
        shared = self._shared_across_stages()

        def before_clip() -> None:
            sum_partial_grads_over_tp(partial, mesh[Axis.TP] if partial else None)
            if shared is not None:
                shared.sum_grads()
            if self.lookup is not None:
                self.lookup.sum_grads()

        if self.lookup is not None:  # (the copy follows the embedding after each update)
            model_hooks = model_hooks.then_after_update(self.lookup.sync_values)
        self.hooks = StepHooks(model=model_hooks, before_clip=before_clip,
                               uncounted=(shared.param,) if shared and not shared.counted else ())
        self.optimizer = build_optimizer(self.model, spec.optimizer)
        self.scheduler = build_lr_scheduler(self.optimizer, spec.optimizer, tr.steps)
        self.step = 0  # optimizer steps done
        self.rng = self._random_streams()
        self.rng.seeded(self.step)
        self.activation_peak = 0  # bytes saved for backward, from the last measured step
        self._bubble_s = 0.0  # the last step's pipeline idle time

    def _shared_across_stages(self) -> SharedAcrossStages | None:
        """Multi-token prediction under a pipeline: the embedding's copies on the first and the
        last stage's ranks, kept equal (``parallel/pipeline/shared.py``)."""
        if self.shape is None:
            return None
        mesh, dims = self.mesh, self.mesh.dims
        c = dims.coords(mesh.rank)
        timeout = timedelta(seconds=self.spec.runtime.collective_timeout_s)
        return embedding_across_stages(
            self.model, self.shape.rank_of(0), self.shape.rank_of(self.shape.num_stages - 1),
            mesh.coord(Axis.PP), lambda pp: dims.rank_of(pp, c[Axis.DP], c[Axis.TP], c[Axis.CP]),
            mesh[Axis.PP].get_group(), self._post(timeout))

    def _random_streams(self) -> RankStreams:
        """This rank's random streams (``engine/rng.py``); the blocks' residual dropout draws
        from the replica stream where tensor parallel replicates the activations."""
        mesh = self.mesh
        streams = RankStreams(self.spec.training.seed, {a.value: mesh.coord(a) for a in AXES},
                              mesh.dims.as_dict(), self.device)
        if mesh.size(Axis.TP) > 1 and not self.spec.parallelism.sequence_parallel:
            for block in self.model.layers.values():
                block.replica_rng = streams.replica
        if mesh.size(Axis.TP) > 1:  # multi-token modules' activations: whole on every tp rank
            for block in mtp_blocks(self.model):
                block.replica_rng = streams.replica
        return streams

    def _batch_geometry(self) -> None:
        """Microbatches per replica, a real microbatch's weight, the pipeline's shape."""
        spec, mesh, tr = self.spec, self.mesh, self.spec.training
        pp = mesh.size(Axis.PP)
        self.vpp = spec.parallelism.vpp if pp > 1 else 1
        # Every replica runs n_micro microbatches; one whose share of the batch is a microbatch
        # smaller runs a padding microbatch of weight 0 (microbatches_per_replica). A real one
        # weighs its tokens' share of the step's, × dp because gradients are averaged over the
        # dp × cp ranks that reduce them (cp ranks hold parts of the same sequences: their
        # losses are parts of one mean).
        self.n_micro = microbatches_per_replica(tr.global_batch_size, tr.microbatch_size,
                                                mesh.size(Axis.DP))
        self.weight = mesh.size(Axis.DP) * tr.microbatch_size / tr.global_batch_size
        self.shape = (pipe_shape(spec.schedule.name, pp, self.vpp, self.n_micro) if pp > 1
                      else None)

    def _open_data(self, data_dir: str) -> int | None:
        """The training and held-out data, and this rank's context-parallel chunks of each
        sequence (read, embedded, attended); returns the dataset's end-of-document token."""
        spec, mesh, tr = self.spec, self.mesh, self.spec.training
        cp = mesh.size(Axis.CP)
        self.spans = local_spans(tr.seq_len, mesh.coord(Axis.CP), cp) if cp > 1 else None
        self.dataset, self.eval_set = open_datasets(data_dir, tr.seq_len, spec.data.eval_path,
                                                    spec.data.eval_fraction)
        # the next step's windows read while this one trains (``data/dataset.Prefetcher``; its
        # reads hold the dataset and this rank's coordinates, not the engine)
        self.batches = Prefetcher(functools.partial(
            _microbatches, self.dataset, tr.seed, tr.global_batch_size, mesh.coord(Axis.DP),
            mesh.size(Axis.DP), tr.microbatch_size, self.spans))
        meta = self.dataset.tokens.meta
        if meta["vocab_size"] > spec.model.vocab_size:
            raise ValueError(f"model.vocab_size {spec.model.vocab_size} is smaller than the "
                             f"{meta['vocab_size']} tokens of the dataset at {data_dir}")
        return meta.get("eos_id")

    def _build_on_meta(self) -> list[int]:
        """The Llama holding this rank's layers (all of them without PP), with global names,
        built on the meta device: no process ever holds more than its own shards. Returns the
        pipeline stages this rank runs."""
        mesh, pp = self.mesh, self.mesh.size(Axis.PP)
        with torch.device("meta"):
            self.model, stage_ids = rank_model(
                LlamaArgs.from_config(self.spec.model, self.device.type), mesh.coord(Axis.PP), pp,
                self.vpp, self.shape.stages_of(mesh.coord(Axis.PP)) if self.shape else None,
                self.spec.parallelism.stage_layers)
        return stage_ids

    def _parallelize(self, eos: int | None) -> ExpertSharding | None:
        """float8 linears, context parallel (and document masks), TP (+ SP), EP, activation
        checkpointing, compile: each wraps what the one before it made. Returns how ZeRO-3
        shards the experts (None: with the rest)."""
        spec, mesh, device, tr = self.spec, self.mesh, self.device, self.spec.training
        cp = mesh.size(Axis.CP)
        if tr.float8 != "none":  # before TP and ZeRO-3: the linears they wrap are float8's
            cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
            broken = float8_device_problems(tr.float8, device.type, cap, compiled=spec.model.compile)
            if broken:
                raise ValueError(broken[0])
            apply_float8(self.model, tr.float8, device.type,
                         all_gather_in_float8=mesh.replicas > 1 and not self.replicated,
                         capability=cap)
        self.context = None
        self.exchanges = ExchangeLog()  # the MoE blocks' waits on their all-to-alls, and bytes
        if cp > 1 or spec.data.document_mask:
            self.context = self._context(eos)
            apply_context_parallel(self.model, self.context, local_positions(
                tr.seq_len, mesh.coord(Axis.CP), cp) if cp > 1 else None)
        self.loss_context = contextlib.nullcontext
        if mesh.size(Axis.TP) > 1:
            apply_tensor_parallel(self.model, mesh[Axis.TP], spec.parallelism.sequence_parallel)
            self.loss_context = loss_parallel
        experts = None
        if is_moe(self.model):
            par = spec.parallelism
            nodes = (consecutive_nodes(mesh.dims.world_size, par.ep_node_ranks)
                     if par.ep_node_ranks else mesh.nodes)
            apply_expert_parallel(self.model, mesh, tr.seq_len, par.ep_overlap, self.exchanges,
                                  par.ep_dispatch, nodes)
            if mesh.dims.ep > 1:
                experts = ExpertSharding(mesh.expert_mesh, expert_divide_factor(mesh))
        apply_activation_checkpointing(self.model, spec.activation_checkpoint.mode,
                                       spec.activation_checkpoint.stride)
        if spec.model.compile:
            apply_compile(self.model, mesh.size(Axis.PP) > 1 and splits_backward(spec.schedule.name),
                          prediction_blocks=mesh.size(Axis.TP) == 1)
        return experts

    def _model_hooks(self) -> ModelHooks:
        """The model family's step hooks (``models/hooks.py``) over this rank's mesh; with
        float8's sharded all-gather, each weight's scale for the next step is found after the
        optimizer, in one all-reduce of the amaxes (torchao's; without it each unit's gather
        waits for its own)."""
        hooks = self.model.step_hooks(sum_over_token_ranks(self.mesh), self.mesh.replicas)
        if (self.spec.training.float8 == "tensorwise" and self.mesh.replicas > 1
                and not self.replicated):
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            hooks = hooks.then_after_update(
                functools.partial(precompute_float8_dynamic_scale_for_fsdp, self.model))
        return hooks

    def _shard(self, stage_ids: list[int], experts: ExpertSharding | None,
               before_microbatch: Callable[[float], None] | None) -> None:
        """Data parallel: DDP where every shard group is one rank, else ZeRO-3 (FSDP2) — per
        pipeline stage, whose executor runs the schedule (telling ``before_microbatch`` each
        microbatch's weight)."""
        spec, mesh, device, par = self.spec, self.mesh, self.device, self.spec.parallelism
        dtype = getattr(torch, spec.training.dtype)
        pp = mesh.size(Axis.PP)
        self.executor = self.eval_executor = None
        self.lookup: LocalCopy | None = None  # the multi-token modules' copy of the embedding
        # A split backward (zero-bubble schedules) keeps each stage gathered through the step:
        # its deferred W's need the parameters the forward used.
        split = pp > 1 and splits_backward(spec.schedule.name)
        self.zero = ReplicatePolicy() if self.replicated else ZeroPolicy(
            keep_gathered=split or par.keep_gathered is not False, param_dtype=dtype,
            reduce_dtype=getattr(torch, par.reduce_dtype))
        if self.replicated:
            if spec.model.compile:  # compiled blocks inside DDP: not split at its buckets
                torch._dynamo.config.optimize_ddp = False
            apply_replicate(self.model, mesh[Axis.DP].get_group(), device,
                            getattr(torch, par.reduce_dtype))
            if dtype != torch.float32:  # DDP keeps one dtype: the compute's by autocast
                self.loss_context = functools.partial(torch.autocast, device.type, dtype=dtype)
        elif pp == 1:
            apply_zero3(self.model, mesh.zero_mesh, self.zero, experts)
        else:
            last = pp * par.vpp - 1
            if self.model.mtp is not None and 0 in stage_ids and last in stage_ids:
                # (a V schedule: the multi-token modules' stage beside the first, on this rank)
                args = self.model.args
                copy = nn.Embedding(args.vocab_size, args.dim, device="meta")
                if mesh.size(Axis.TP) > 1:  # (split as the embedding is)
                    parallelize_module(copy, mesh[Axis.TP], embedding_style(par.sequence_parallel))
                object.__setattr__(self.model, "mtp_lookup", copy)
                self.lookup = LocalCopy(self.model.tok_embeddings, copy)
            stages = {s: PipelineStage(self.model, s, pp * par.vpp, par.stage_layers)
                      for s in stage_ids}
            # FSDP2 at dp = 1 shards nothing, it only casts (mixed precision): a stage that needs
            # neither is not wrapped, its hooks would be overhead on every microbatch.
            wrap = mesh.replicas > 1 or dtype != torch.float32
            for stage in stages.values() if wrap else ():
                apply_zero3(stage, mesh.zero_mesh, self.zero, experts)
            self.executor = self._build_executor(self.shape, stages, dtype,
                                                 self.zero if wrap else None, before_microbatch)

    def _materialise(self, hooks: ModelHooks) -> None:
        """The local shards only, filled from each parameter's global name (or read from
        ``model.init_from``), and the buffers."""
        self.model.to_empty(device=self.device)
        self.model.init_buffers()  # (first: an import may fill some, e.g. a routing bias)
        self.imported_bytes = init_weights(self.model, self.spec)  # read from model.init_from
        if self.lookup is not None:
            self.lookup.copy.to_empty(device=self.device)
            self.lookup.sync_values()
        if hooks.before_microbatch is not None:  # e.g. a balancing loss's weight
            hooks.before_microbatch(self.weight)

    def _context(self, eos: int | None) -> ContextParallel:
        """Attention over the context-parallel ring (and/or within documents)."""
        spec, mesh = self.spec, self.mesh
        if spec.data.document_mask and eos is None:
            raise ValueError("data.document_mask: the dataset names no end-of-document token "
                             "(dataset.json eos_id); prepare it again with trainmesh data prepare")
        cp = mesh.size(Axis.CP)
        timeout = timedelta(seconds=spec.runtime.collective_timeout_s)
        ops = self.model.ops
        return ContextParallel(
            cp=cp, rank=mesh.coord(Axis.CP), group=mesh[Axis.CP].get_group() if cp > 1 else None,
            mode=spec.parallelism.cp_mode, eos=eos if spec.data.document_mask else None,
            # (a split backward's weight pass would run the ring's backward a second time;
            # float8's wkv_b is a float8 linear)
            compressed=(spec.parallelism.cp_latent and not splits_backward(spec.schedule.name)
                        and spec.training.float8 == "none"),
            post=self._post(timeout),
            block=ops.attention_block, block_backward=ops.attention_block_backward)

    def _post(self, timeout: timedelta) -> Callable:
        return self._p2p_factory(timeout) if self._p2p_factory is not None else dist.batch_isend_irecv

    def _build_executor(self, shape: PipeShape, stages: dict, dtype: torch.dtype,
                        zero: ZeroPolicy | None,
                        before_microbatch: Callable[[float], None] | None) -> PipelineExecutor:
        par, tr, mesh = self.spec.parallelism, self.spec.training, self.mesh
        dims, c = mesh.dims, mesh.dims.coords(mesh.rank)
        self._schedule = build_schedule(self.spec.schedule.name, shape.pp, shape.vpp,
                                        shape.microbatches)
        timeout = timedelta(seconds=self.spec.runtime.collective_timeout_s)
        seq = tr.seq_len // dims.cp
        seq = seq // dims.tp if par.sequence_parallel else seq
        p2p = P2PSpec(group=mesh[Axis.PP].get_group(),
                      peers=[dims.rank_of(i, c[Axis.DP], c[Axis.TP], c[Axis.CP])
                             for i in range(dims.pp)],
                      act_shape=(tr.microbatch_size, seq, self.spec.model.dim), dtype=dtype,
                      device=self.device, timeout=timeout,
                      post=self._post(timeout))
        self._shape, self._stages, self._p2p = shape, stages, p2p  # for the eval executor
        # (the multi-token modules' stage: torch's split backward fails on their lookup of the
        # tokens ahead, shared by the modules)
        unsplit = frozenset(s for s, m in stages.items() if getattr(m, "mtp", None) is not None)
        # DualPipeV's pairs: on two threads taking turns where MoE exchanges run across ranks
        overlap = self.spec.schedule.pair_overlap and dims.ep > 1 and is_moe(self.model)
        return PipelineExecutor(shape, self._schedule[c[Axis.PP]], stages, p2p, self.loss_context,
                                zero, self.on_phase, before_microbatch, unsplit,
                                pairs_of(self.spec.schedule.name, shape)[c[Axis.PP]], overlap)

    def _wait_logs(self) -> list[WaitLog]:
        """Where this rank waits on communication inside its blocks, timed each step."""
        return [self.exchanges] + ([self.context] if self.context is not None else [])

    def train_step(self, measure_activations: bool = False) -> StepStats:
        """One optimizer step. ``measure_activations``: count the bytes autograd saves for
        backward (``memory_report``'s ``activations``) — for dry runs, not every step."""
        if measure_activations:
            with SavedActivations() as meter:
                stats = self.train_step()
            self.activation_peak = meter.peak
            return stats
        clock = StepClock(self.device, self.on_phase)
        self.forward_timer.start(clock.clock)
        for log in self._wait_logs():
            log.start(clock.clock)
        mbs = self.batches.get(self.step)
        mbs, weights = self._padded([(x.to(self.device), y.to(self.device)) for x, y in mbs])
        clock.lap("data")
        if self.executor is None:
            stats = train_step(self.model, self.optimizer, self.scheduler, mbs,
                               self.spec.optimizer.grad_clip,
                               lambda last: self.zero.before_backward(self.model, last),
                               self.loss_context, clock.phase, self.hooks, weights,
                               keep_grads=isinstance(self.zero, ReplicatePolicy))
        else:
            stats = self._pipeline_step(mbs, weights, clock)
        clock.lap("optimizer")
        loss = self._dp_mean(stats.loss)
        clock.lap("loss")
        self.step += 1
        ring = self.context.waited_s() if self.context is not None else 0.0
        breakdown = clock.breakdown(ring, self.exchanges.waited_s(), self._bubble_s,
                                    self.forward_timer.seconds())
        if self.context is not None and self.context.cp > 1:  # what this rank sent on the ring
            breakdown["cp_sent_mib"] = self.context.sent / 2**20
        if self.mesh.dims.ep > 1:  # ... and to its experts' ranks, inside its node and out
            breakdown["a2a_intranode_mib"] = self.exchanges.within_nodes / 2**20
            breakdown["a2a_internode_mib"] = self.exchanges.between_nodes / 2**20
        if self.executor is not None and self.executor.overlap:  # DualPipeV's pairs taking
            # turns, and how often their forwards and backwards let the other half run
            breakdown["pairs_overlapped"] = self.executor.pairs_overlapped
            breakdown["pair_handovers_forward"], breakdown["pair_handovers_backward"] = (
                self.executor.handovers)
        self.forward_timer.start(None)  # evaluations between steps are not timed
        for log in self._wait_logs():
            log.start(None)
        losses = self._dp_means(stats.losses) if stats.losses else None
        return StepStats(loss=loss, grad_norm=stats.grad_norm, lr=stats.lr, tokens=stats.tokens,
                         experts=stats.experts, losses=losses, breakdown=breakdown)

    def _padded(self, mbs: list) -> tuple[list, list[float]]:
        """This replica's microbatches and their weights, padded to the step's ``n_micro``
        with copies of its last one at weight 0: they keep every collective aligned with the
        replicas whose share is a microbatch larger, and add nothing to the step."""
        pad = self.n_micro - len(mbs)
        return mbs + mbs[-1:] * pad, [self.weight] * len(mbs) + [0.0] * pad

    def _pipeline_step(self, mbs, weights: list[float], clock: StepClock) -> StepStats:
        self.optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = self.executor.step(mbs, weights).detach().double()
        # The schedule's idle time: its wall time less what its actions took (compute, and
        # posting messages); what is left is waiting for another stage — the bubble.
        spans = sum(end - start for _, start, end in self.executor.timeline)
        self._bubble_s = max(0.0, time.perf_counter() - t0 - spans)
        pp_group = self.mesh[Axis.PP].get_group()
        mtp = self.model.mtp_losses  # the multi-token modules' losses (zeros elsewhere)
        if mtp.numel():  # only the last stage holds a loss: one all-reduce for both
            both = torch.cat([loss.reshape(1), mtp])
            dist.all_reduce(both, group=pp_group)
            loss = both[0]
            mtp.copy_(both[1:])
        else:
            dist.all_reduce(loss, group=pp_group)
        tokens = sum(y.numel() for (_, y), w in zip(mbs, weights, strict=True) if w)
        return finish_step(self.model, self.optimizer, self.scheduler,
                           self.spec.optimizer.grad_clip, float(loss), tokens, across=pp_group,
                           on_phase=clock.phase, hooks=self.hooks)

    @torch.no_grad()
    def evaluate(self, batches: int) -> float:
        """Collective: the mean loss over the first ``batches`` held-out batches (the same
        windows for every mesh and every call)."""
        tr, pp, dp = self.spec.training, self.mesh.size(Axis.PP), self.mesh.size(Axis.DP)
        total = 0.0
        self.model.eval()  # no dropout, and no draws from the training's random streams
        for b in range(batches):
            mbs = self.eval_set.eval_microbatches(b, tr.global_batch_size, self.mesh.coord(Axis.DP),
                                                  dp, tr.microbatch_size, self.spans)
            mbs, weights = self._padded([(x.to(self.device), y.to(self.device)) for x, y in mbs])
            if self.executor is None:
                with self.loss_context():
                    loss = sum(self.model(x, y) * w for (x, y), w in zip(mbs, weights, strict=True))
                loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
            else:
                if self.eval_executor is None:  # the schedule's forwards alone, built once
                    rank = self.mesh.coord(Axis.PP)
                    self.eval_executor = PipelineExecutor(
                        self._shape, forward_only(self._shape, self._schedule)[rank], self._stages,
                        self._p2p, self.loss_context)
                loss = self.eval_executor.step(mbs, weights).detach().double()
                if pp > 1:
                    dist.all_reduce(loss, group=self.mesh[Axis.PP].get_group())
            total += float(loss)
        for m in self.model.modules():  # forwards without backwards leave ZeRO-3 units gathered
            if isinstance(m, FSDPModule):
                m.reshard()
        self.model.train()
        return self._dp_mean(total / batches)

    def memory_report(self) -> dict[str, int]:
        """Exact bytes of this rank's parameter, gradient and optimizer-state shards, the
        activation peak of the last measured step, the process's peak, and what the build read
        of ``model.init_from``."""
        return {**state_bytes(self.model, self.optimizer), "activations": self.activation_peak,
                "peak": peak_process_bytes(self.device), "imported": self.imported_bytes}

    def timeline(self) -> list[tuple[str, float, float]]:
        """The last step's measured actions (name, start, end), for the pipeline trace."""
        return list(self.executor.timeline) if self.executor is not None else []

    def _dp_mean(self, value: float) -> float:
        """The mean over the replicas and their context-parallel peers: each cp rank's loss is
        the mean over its equal share of every sequence's tokens."""
        return self._dp_means({"": value})[""]

    def _dp_means(self, values: dict[str, float]) -> dict[str, float]:
        """``_dp_mean`` of each value (the same names on every rank), in one all-reduce."""
        group = self.mesh.replica_group()
        if group is None:
            return dict(values)
        t = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=group)
        return {k: v / self.mesh.replicas for k, v in zip(values, t.tolist(), strict=True)}

    def save(self, directory: str) -> dcp_io.Saved:
        return dcp_io.save(directory, self.model, self.optimizer)

    def async_save(self, directory: str, group) -> Future:
        return dcp_io.async_save(directory, self.model, self.optimizer, group,
                                 on_write=lambda: self.on_phase("write"))

    def load(self, directory: str, step: int, rng_states: bytes | None,
             snapshot: tuple[list[str], MemoryStore] | None = None) -> None:
        """Restore model + optimizer shards, then the schedule position and this rank's random
        streams (``rng_states``: every rank's, ``rng.job_states``; None: derived).
        ``snapshot``: an in-memory snapshot's per-rank metadata files (``snapshot_io.snapshot``) and
        the rank's store that reads them."""
        if snapshot:
            metadata_files, store = snapshot
            snapshot_io.load_snapshot(directory, metadata_files, self.model, self.optimizer, store)
        else:
            dcp_io.load(directory, self.model, self.optimizer)
        if self.lookup is not None:
            self.lookup.sync_values()
        self.step = step
        self.scheduler.last_epoch = step
        for group, base, fn in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                   self.scheduler.lr_lambdas, strict=True):
            group["lr"] = base * fn(step)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        self.rng.restore(rng_states, step)
