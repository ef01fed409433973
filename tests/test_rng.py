"""Each rank's random streams (``engine/rng.py``) and ``model.dropout``: seeded from the step and
the rank's coordinates, saved by every rank into checkpoints and snapshots, restored exactly on
the same mesh (an interrupted and resumed run with dropout equals the uninterrupted one), and
derived on another mesh."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from trainmesh.checkpoint.rng_states import job_states
from trainmesh.cli.loading import load_spec
from trainmesh.engine.rng import RankStreams, derived_seed
from trainmesh.models.llama.model import LlamaArgs, TransformerBlock
from trainmesh.spec.problems import SpecError
from trainmesh.spec.validate import Layout, problems

CPU = torch.device("cpu")
LAYOUT = {"pp": 1, "dp": 2, "tp": 2, "world_size": 4}


def _rank(dp: int, tp: int, layout=LAYOUT, seed: int = 7) -> RankStreams:
    return RankStreams(seed, {"pp": 0, "dp": dp, "cp": 0, "tp": tp}, dict(layout), CPU)


def _draws(streams: RankStreams) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(4), torch.rand(4, generator=streams.replica)


def test_streams_are_distinct_per_rank_and_the_replica_stream_is_shared_by_tp_peers():
    seen = {}
    for dp in (0, 1):
        for tp in (0, 1):
            r = _rank(dp, tp)
            r.seeded(step=3)
            seen[dp, tp] = _draws(r)
    own = [seen[k][0] for k in seen]
    assert all(not torch.equal(a, b) for i, a in enumerate(own) for b in own[i + 1:])
    assert torch.equal(seen[0, 0][1], seen[0, 1][1]) and torch.equal(seen[1, 0][1], seen[1, 1][1])
    assert not torch.equal(seen[0, 0][1], seen[1, 0][1])
    # the step and the seed move every stream
    c = {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    assert len({derived_seed(7, 3, c, "rank"), derived_seed(7, 4, c, "rank"),
                derived_seed(8, 3, c, "rank"), derived_seed(7, 3, c, "replica")}) == 4


def test_a_restore_on_the_same_mesh_continues_each_ranks_streams_exactly():
    ranks = [_rank(dp, tp) for dp in (0, 1) for tp in (0, 1)]
    states, after = [], []
    for r in ranks:  # each rank draws a different amount before the save
        r.seeded(step=0)
        for _ in range(r.coords["dp"] + 2 * r.coords["tp"] + 1):
            _draws(r)
        states.append(r.state())
        after.append(_draws(r))  # what the uninterrupted rank draws next
    saved = job_states(states)
    for r, want in zip(reversed(ranks), reversed(after), strict=True):  # new processes, any order
        fresh = _rank(r.coords["dp"], r.coords["tp"])
        torch.manual_seed(12345)
        assert fresh.restore(saved, step=5) is True
        got = _draws(fresh)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_restore_on_another_mesh_derives_each_ranks_streams_from_the_step_and_its_coordinates():
    r = _rank(0, 1)
    r.seeded(step=0)
    saved = job_states([r.state()])
    other = {"pp": 1, "dp": 4, "tp": 1, "world_size": 4}
    moved = _rank(1, 0, layout=other)
    assert moved.restore(saved, step=6) is False
    got = _draws(moved)
    again = _rank(1, 0, layout=other)
    again.seeded(step=6)
    want = _draws(again)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert _rank(0, 0).restore(None, step=6) is False  # a checkpoint without the file: derived


def test_states_of_two_meshes_in_one_save_are_refused():
    a, b = _rank(0, 0), _rank(0, 0, layout={"dp": 4})
    with pytest.raises(ValueError, match="2 meshes"):
        job_states([a.state(), b.state()])
    assert set(json.loads(job_states([a.state()]))["ranks"]) == {"pp0.dp0.cp0.tp0"}


def _block(dropout: float, replica: torch.Generator | None) -> TransformerBlock:
    args = LlamaArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=64, vocab_size=64,
                     max_seq_len=16, dropout=dropout)
    torch.manual_seed(0)
    block = TransformerBlock(args)
    block.replica_rng = replica
    return block


@pytest.mark.parametrize("replica", [False, True], ids=["torch-stream", "replica-stream"])
def test_a_recomputed_block_drops_what_its_forward_dropped(replica):
    """Activation checkpointing replays the forward in backward: the masks must be the same,
    from torch's streams (checkpoint restores them) and from the replica stream (its seeds are
    drawn before the checkpointed region)."""
    from trainmesh.models.llama.model import rope_tables

    cos, sin = rope_tables(8, 16, 10000.0)
    x = torch.randn(2, 16, 32)
    out = {}
    for recompute in (False, True):
        g = torch.Generator().manual_seed(3) if replica else None
        block = _block(0.3, g)
        block.recompute = recompute
        torch.manual_seed(1)
        xi = x.clone().requires_grad_(True)
        y = block(xi, cos, sin)
        y.square().sum().backward()
        out[recompute] = (y.detach(), xi.grad, block.attention.wq.weight.grad)
    for a, b in zip(out[False], out[True], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # dropout acted: the block without it gives another output; in eval mode nothing is dropped
    plain = _block(0.0, None)
    assert not torch.allclose(plain(x, cos, sin), out[False][0])
    dropped = _block(0.3, torch.Generator() if replica else None).eval()
    torch.testing.assert_close(dropped(x, cos, sin), plain(x, cos, sin), rtol=0, atol=0)


def test_dropout_beside_context_parallel_or_document_masks_is_refused_naming_the_field(tmp_path):
    for extra in (["parallelism.cp=2"], ["data.document_mask=true"]):
        with pytest.raises(SpecError) as err:
            load_spec(None, ["model.preset=tiny", "model.dropout=0.1", "training.seq_len=32",
                             f"runtime.output_dir={tmp_path}", *extra])
        [found] = [p for p in err.value.problems if p.path == "model.dropout"]
        assert "model.dropout=0" in found.fix, extra
    # the planner never picks such a layout for a spec that leaves cp open
    spec = load_spec(None, ["model.preset=tiny", "model.dropout=0.1", "training.seq_len=32"])
    assert [p.path for p in problems(spec, Layout(cp=2, microbatch_size=2))] == ["model.dropout"]
    with pytest.raises(Exception, match="dropout"):
        load_spec(None, ["model.dropout=1.0"])


RUN = ["model.preset=tiny", "model.dropout=0.2", "training.global_batch_size=8",
       "training.microbatch_size=2", "training.seq_len=32", "optimizer.warmup_steps=1",
       "tracking.enabled=false", "runtime.device=cpu", "runtime.collective_timeout_s=60",
       "elastic.ready_ranks_per_node=0", "checkpoint.async_save=false"]


@pytest.mark.cluster
@pytest.mark.timeout(400)
def test_a_dropout_run_resumed_from_storage_equals_the_uninterrupted_run_tp2(ray_local, tmp_path):
    """tp 2 without sequence parallel: torch's streams differ per tp rank (their heads), the
    residual's masks come from the shared replica stream. The run resumed from its step-2
    checkpoint draws what the uninterrupted run drew: the same losses, bit for bit."""
    from reference import reference_run

    from trainmesh.controller.launch import run_job

    spec = load_spec(None, [*RUN, "parallelism.tp=2", "training.steps=4", "checkpoint.every=2",
                            f"runtime.output_dir={tmp_path}"])
    first = run_job(spec, environ={}, show_progress=False)
    assert first["status"] == "FINISHED" and first["mesh"]["tp"] == 2
    no_dropout = spec.model_copy(update={"model": spec.model.model_copy(update={"dropout": 0.0})})
    ref, _ = reference_run(no_dropout, str(tmp_path / "data" / "tiny-corpus"), steps=4)
    assert all(abs(a - b) > 1e-4 for a, b in zip(first["losses"], ref, strict=True))  # it dropped
    shutil.rmtree(tmp_path / "checkpoints" / "step-000004")
    resumed = run_job(spec, environ={}, show_progress=False)
    assert resumed["resumed_at"] == 2 and resumed["steps_done"] == 4
    assert resumed["losses"] == first["losses"]
