"""In-process checks of the mesh arithmetic, the plan, sharded reads, refusals and the LSE math (no processes)."""
from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F

from omni.build_options import BuildOptions
from omni.parallel.comm import Comm
from omni.parallel.mesh import (
    AXES, Degrees, Mesh, MeshError, axis_groups, coords_of, dispatch_groups, expert_layout, rank_of,
)
from omni.parallel.ring import merge, resolve_lse_kernel
from omni.parallel.runtime import ParallelRuntime
from omni.parallel.sequence import split_sizes
from omni.parallel.styles import Replicate, glob_matches
from omni.parallel.tp import Shard
from omni.platform_manager import select
from omni.specs import AttentionSpec
from omni.models.hunyuan_image3.config import TINY_GOLDEN
from omni.models.hunyuan_image3.parallel import PLANS, TP_PLAN
from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer

pytestmark = pytest.mark.timeout(60)


def fake_mesh(degrees: Degrees, rank: int = 0) -> Mesh:
    """A mesh whose comms know their sizes but never communicate (for build-time checks only)."""
    comms = {}
    for axis in AXES:
        ranks = next(g for g in axis_groups(degrees, (axis,)) if rank in g)
        comms[axis] = Comm(axis, None, ranks, rank)
    for axis, axes in (("sp", ("ulysses", "ring")), ("replica", ("cfg", "ulysses", "ring", "tp"))):
        comms[axis] = Comm(axis, None, next(g for g in axis_groups(degrees, axes) if rank in g), rank)
    comms["dispatch"] = Comm("dispatch", None, next((g for g in dispatch_groups(degrees) if rank in g), [rank]), rank)
    comms["world"] = Comm("world", None, list(range(degrees.world_size)), rank)
    return Mesh(degrees, rank, comms)


# ---------------------------------------------------------------- degrees and coordinates


def test_degrees_validate_with_reasons():
    assert Degrees(cfg=2, tp=2).world_size == 4 and Degrees(dp=3, tp=2).replica_size == 2
    with pytest.raises(MeshError, match="USP"):
        Degrees(ulysses=2, ring=2)
    with pytest.raises(MeshError, match="cfg is 1 or 2"):
        Degrees(cfg=3)
    with pytest.raises(MeshError, match="replicas .dp. are independent"):
        Degrees(dp=2, ep=2)
    with pytest.raises(MeshError, match="one must divide the other"):
        Degrees(cfg=2, tp=3, ep=2)
    assert Degrees.parse("cfg2xtp2xep4") == Degrees(cfg=2, tp=2, ep=4)
    assert Degrees.parse("single") == Degrees() and Degrees(ulysses=2, tp=2).label() == "ulysses2xtp2"
    with pytest.raises(MeshError, match="bad layout"):
        Degrees.parse("tp2xpp2")


def test_coordinates_are_row_major_tp_fastest():
    d = Degrees(dp=2, cfg=2, tp=2)
    assert coords_of(5, d) == {"dp": 1, "cfg": 0, "ulysses": 0, "ring": 0, "tp": 1}
    assert all(rank_of(coords_of(r, d), d) == r for r in range(d.world_size))
    assert axis_groups(d, ("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(d, ("cfg",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(d, ("cfg", "ulysses", "ring", "tp")) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_expert_layouts():
    inside = Degrees(tp=4, ep=2)  # ep group inside the tp group: no all-to-all
    assert [expert_layout(inside, r) for r in range(4)][3].__dict__ == \
        dict(groups=2, group_index=1, expert_tp=2, expert_tp_index=1, dispatch=1)
    assert dispatch_groups(inside) == []
    across = Degrees(cfg=2, tp=2, ep=4)  # spans both cfg groups: tokens differ, all-to-all per tp index
    assert expert_layout(across, 3).__dict__ == dict(groups=2, group_index=1, expert_tp=2, expert_tp_index=1,
                                                     dispatch=2)
    assert dispatch_groups(across) == [[0, 2], [1, 3]]
    assert expert_layout(across, 3).expert_range(64) == range(32, 64)
    with pytest.raises(MeshError, match="cannot be split"):
        expert_layout(across, 0).expert_range(5)


def test_split_sizes_are_contiguous_and_even():
    assert split_sizes(73, 2) == [37, 36] and split_sizes(5, 4) == [2, 1, 1, 1] and split_sizes(2, 4) == [1, 1, 0, 0]
    assert sum(split_sizes(4097, 3)) == 4097


# ---------------------------------------------------------------- the plan


def test_plan_covers_every_parameter():
    """Each parameter sits under an entry of the plan (sharded or explicitly replicated): the plan is complete."""
    model = HunyuanImage3Transformer(TINY_GOLDEN, select("cpu"), BuildOptions(dtype=torch.float32))
    for name, _ in model.named_parameters():
        owners = [name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)]
        assert any(glob_matches(g, o) for g in TP_PLAN for o in owners), f"{name} is not in TP_PLAN"
    assert all(isinstance(s, Replicate) for g, s in TP_PLAN.items() if g.endswith("layernorm") or g == "model.wte")


PAGED_FP32 = BuildOptions(dtype=torch.float32, paged_kv=True, page_size=4)


def _meta_model():
    with torch.device("meta"):
        return HunyuanImage3Transformer(TINY_GOLDEN, select("cpu"), PAGED_FP32)


def _shard(degrees: Degrees, rank: int = 0):
    model = _meta_model()
    with torch.device("meta"):
        plan = ParallelRuntime(fake_mesh(degrees, rank), select("cpu")).shard_model(
            model, PLANS, cfg=TINY_GOLDEN, opts=PAGED_FP32)
    return model, plan


def test_tp2_local_shapes_keep_whole_kv_groups():
    model, plan = _shard(Degrees(tp=2), rank=1)
    attn = model.model.layers[0].self_attn
    assert attn.shape_NKH == (2, 1, 16) and attn.qkv_proj.weight.shape == (64, 64)  # (2 q + k + v) x 16
    assert attn.o_proj.weight.shape == (64, 32)
    mlp = model.model.layers[0].mlp
    assert (mlp.shared_mlp.gate_and_up_proj.weight.shape == (32, 64)
            and mlp.experts.down_proj.weight.shape == (4, 64, 16))
    qkv = plan.shards["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.ranges(128) == [(64, 128)]  # KV group 1 = packed rows 64..127
    gate_up = plan.shards["model.layers.0.mlp.experts.gate_and_up_proj.weight"]
    assert gate_up.ranges(64) == [(16, 32), (48, 64)]  # rank 1's half of gate and of up


def test_tp_beyond_kv_heads_is_refused_with_the_reason():
    with pytest.raises(MeshError) as err:
        _shard(Degrees(tp=4))
    msg = str(err.value)
    assert "parallel.tp=4" in msg and "num_key_value_heads=2" in msg and "whole KV groups" in msg
    assert "[q x 2, k, v]" in msg and "one of [1, 2]" in msg and "cfg, ulysses, ring or dp" in msg


def test_ulysses_degree_that_does_not_split_heads_is_refused():
    with pytest.raises(MeshError, match="ulysses=3 must divide the query heads per tp rank"):
        _shard(Degrees(ulysses=3))


def test_ep_model_split_refusal():
    with pytest.raises(MeshError, match="4 experts cannot be split into 8"):
        _shard(Degrees(cfg=2, ulysses=4, ep=8))


def test_ring_refuses_a_kernel_without_lse():
    class NoLse:
        name = "fast-but-no-lse"

    class Plat:
        name = "someplatform"

        def attention(self, spec):
            return NoLse()

    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, mask="dense", return_lse=True)
    with pytest.raises(MeshError, match="log-sum-exp.*'someplatform'.*fast-but-no-lse.*parallel.ulysses"):
        resolve_lse_kernel(Plat(), spec)
    assert resolve_lse_kernel(select("cpu"), spec).returns_lse


# ---------------------------------------------------------------- sharded reads


def test_shard_reads_only_its_slices_from_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    w = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    save_file({"w": w}, str(tmp_path / "x.safetensors"))
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        sl = f.get_slice("w")
        assert torch.equal(Shard(0, 2, 1, blocks=2).take(sl), torch.cat([w[2:4], w[6:8]]))  # [gate | up] halves
        assert torch.equal(Shard(0, 2, 1, blocks=4, whole_blocks=True).take(sl), w[4:8])  # whole KV groups
        assert torch.equal(Shard(1, 3, 2).take(sl), w[:, 4:6])  # row-parallel input columns

    class Recorder:
        def __init__(self, t):
            self.t, self.reads = t, []

        def get_shape(self):
            return list(self.t.shape)

        def __getitem__(self, idx):
            self.reads.append(idx)
            return self.t[idx]

    rec = Recorder(w)
    Shard(0, 4, 3).take(rec)
    assert rec.reads == [slice(6, 8)]  # a contiguous quarter, never the whole tensor


def test_expert_parallel_experts_build_their_kernel_for_the_single_rows_they_are_fed():
    """An EP shard feeds its experts one (token, expert) assignment a row: the MoE spec ``finalize()`` builds from
    says k = 1 (the cuda platform compiles that sort at build), while a layout without EP keeps the router's k."""
    k = TINY_GOLDEN.moe_topk[0]
    for degrees, want in ((Degrees(tp=2, ep=2), 1), (Degrees(tp=2), k)):
        model, _ = _shard(degrees, rank=1)
        specs = [layer.mlp.experts._spec() for layer in model.model.layers]
        assert k > 1 and {s.topk for s in specs} == {want}, degrees
    assert {s.num_experts for s in specs} == {TINY_GOLDEN.num_experts}  # tp: every expert, sliced
    model, _ = _shard(Degrees(tp=2, ep=2), rank=1)
    assert {layer.mlp.experts._spec().num_experts for layer in model.model.layers} == {TINY_GOLDEN.num_experts // 2}


def test_expert_parallel_name_map_skips_other_ranks_experts():
    _, plan = _shard(Degrees(cfg=2, ep=2), rank=1)
    assert plan.name_map("model.layers.1.mlp.experts.3.down_proj.weight") == \
        ("model.layers.1.mlp.experts.down_proj.weight", 1)
    assert plan.name_map("model.layers.1.mlp.experts.0.down_proj.weight") == (None, None)
    assert plan.name_map("model.layers.1.mlp.gate.wg.weight") == ("model.layers.1.mlp.gate.wg.weight", None)


# ---------------------------------------------------------------- LSE attention and the ring merge


def test_reference_lse_kernel_matches_sdpa_and_logsumexp():
    torch.manual_seed(0)
    q, k, v = torch.randn(7, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    mask = torch.rand(7, 9) > 0.4
    mask[3] = False  # a query that sees nothing
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, mask="dense", return_lse=True)
    from omni.attention_context import dense_meta

    o, lse = select("cpu").attention(spec)(q, k, v, dense_meta(mask))
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = torch.einsum("tnh,snh->nts", q, kk) / 4.0
    s = s.masked_fill(~mask, -math.inf)
    ok = mask.any(-1)
    assert torch.allclose(lse[ok], torch.logsumexp(s, -1).T[ok], atol=1e-5) and torch.isinf(lse[3]).all()
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None],
                                          attn_mask=mask)[0].transpose(0, 1)
    assert torch.allclose(o[ok], want[ok], atol=1e-5) and (o[3] == 0).all()


def test_merge_of_key_halves_equals_full_attention():
    from omni.attention_context import dense_meta

    torch.manual_seed(1)
    q, k, v = torch.randn(5, 4, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    mask = torch.rand(5, 12) > 0.3
    mask[:, :6] &= torch.tensor([True, True, False, True, True])[:, None]  # query 2 sees only the second half
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, mask="dense", return_lse=True)
    kern = select("cpu").attention(spec)
    full, _ = kern(q, k, v, dense_meta(mask))
    o, lse = merge(None, None, *kern(q, k[:6], v[:6], dense_meta(mask[:, :6])))
    o, lse = merge(o, lse, *kern(q, k[6:], v[6:], dense_meta(mask[:, 6:])))
    assert torch.allclose(o, full, atol=1e-6)


def test_expert_shard_routes_glue_quantized_rows_as_their_rows():
    """Under EP the routed experts may receive ``RowQuantized`` rows (a kernel that takes them): the shard routes the
    rows they carry, as it routes plain rows."""
    from omni.parallel.ep import ExpertShard
    from omni.quant import quantize_fp8
    from omni.specs import RowQuantized

    class Weighted(torch.nn.Module):  # the routed-experts contract: weighted rows summed over the k choices
        def forward(self, x_TD, w_Tk, e_Tk):
            return x_TD * (w_Tk * (e_Tk + 1)).sum(-1, keepdim=True)

    module = Weighted()
    ExpertShard(range(2, 4), 4, types.SimpleNamespace(size=1)).attach(module)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=g)
    w, e = torch.rand(6, 2, generator=g), torch.tensor([[0, 2], [3, 1], [2, 3], [0, 1], [1, 2], [3, 0]])
    q, s = quantize_fp8(x, per_row=True)
    plain = module(x, w, e)
    assert plain.abs().sum() > 0 and torch.equal(module(RowQuantized(q, s, x), w, e), plain)
