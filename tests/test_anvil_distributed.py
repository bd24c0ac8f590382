"""AnvilAndAdam and track_1_short.distributed across processes: gloo on CPU.

Scope: W ranks (2 and 4), each computing gradients on its slice of the same global batch, end with
the parameters one process gets on the whole batch (within 1e-5 relative, fp32), over 6 steps that
cover ANVIL banks (wide, square, tall 2-slot), sharded Adam tables with and without dim-0 padding,
replicated scalars, the value_embeds gradient buffer, the tied embed/lm_head and the untie. Also:
a dead rank is named by lost_ranks, the single-process fallback.
Hardware: CPU only, spawns processes (~30 s on 2 cores).
Run: `.venv/bin/python -m pytest tests/test_anvil_distributed.py -q`.
"""

import os

import pytest

from tests.mp_utils import free_port, gloo_worker, set_rank_env, single_thread
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from track_1_short.distributed import destroy_distributed, init_distributed, lost_ranks
from track_1_short.optim.anvil import AnvilAndAdam, AnvilConfig, build_param_cfgs
from track_1_short.schedule import Schedule, ScheduleConfig

VOCAB, DIM, LAYERS, GLOBAL_BATCH, SEQ, STEPS, UNTIE_STEP = 50, 16, 4, 8, 6, 6, 1
SPEEDRUN = Schedule(ScheduleConfig())  # every step's momentum and Adam cadence


class Net(nn.Module):
    """Synthetic model with the real parameter kinds: banks of N=4 matrices (a multiple of 2 and 4),
    embed with 50 rows (padded to 52 on 4 ranks), value_embeds with 102 rows (padded on 4)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        r = lambda *s, scale=0.3: nn.Parameter(torch.randn(*s, generator=gen) * scale)
        self.qk_bank = r(LAYERS, 8, DIM)
        self.vo_bank = r(LAYERS, DIM, DIM)
        self.mlp_bank = r(LAYERS, 2, 2 * DIM, DIM)
        self.lm_head = r(DIM, VOCAB)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.embed.weight = nn.Parameter(self.lm_head.data.T.contiguous())
        self.value_embeds = nn.Embedding(2 * VOCAB + 2, DIM)
        self.value_embeds.weight = r(2 * VOCAB + 2, DIM)
        self.scalars = nn.Parameter(torch.tensor([0.5, 0.7, 0.9]))
        self.smear_gate = r(1, 4)

    def forward(self, ids, targets):
        pos = torch.arange(ids.size(1), device=ids.device) % 2
        x = self.embed(ids) + self.scalars[0] * self.value_embeds(ids + VOCAB * pos)  # [B, T, D]
        for i in range(LAYERS):
            x = x + self.scalars[1] * torch.tanh(x @ self.vo_bank[i].T)
            x = x + 0.1 * (x @ self.qk_bank[i].T) @ self.qk_bank[i]
            x = x + self.scalars[2] * torch.relu(x @ self.mlp_bank[i, 0].T) @ self.mlp_bank[i, 1]
            x = x * torch.sigmoid(x[..., :4] @ self.smear_gate.T)
        logits = x @ self.lm_head  # [B, T, V]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train(rank: int, world_size: int, device: str = "cpu", **anvil: str) -> dict[str, torch.Tensor]:
    """STEPS optimizer steps; this rank's gradient comes from its slice of each global batch.
    `anvil`: AnvilConfig overrides. Returns the parameters on the CPU."""
    model = Net().to(device)
    names = {p: n for n, p in model.named_parameters()}
    opt = AnvilAndAdam(build_param_cfgs(model.named_parameters()), AnvilConfig(**anvil), names=names,
                       tied_embed_head=(model.embed.weight, model.lm_head))
    ve = model.value_embeds.weight
    grad_accum = torch.zeros_like(ve)  # stands in for ValueEmbedPull.grad_accum
    opt.set_grad_buffer(ve, grad_accum)
    per_rank = GLOBAL_BATCH // world_size
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
        mine = ids[rank * per_rank:(rank + 1) * per_rank].to(device)
        model(mine[:, :-1], mine[:, 1:]).backward()
        grad_accum.add_(ve.grad)
        ve.grad = None
        plan = SPEEDRUN.plan(step)
        opt.step(step, 1.0 - 0.1 * step, plan.momentum, plan.adam_step)
        if step == UNTIE_STEP:
            opt.untie_embed_head()
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}




@pytest.fixture(scope="module")
def single_process_result():
    return single_thread(train, 0, 1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_matches_single_process(world_size, single_process_result, tmp_path):
    mp.spawn(gloo_worker, args=(world_size, free_port(), str(tmp_path), train), nprocs=world_size)
    start = Net()
    for rank in range(world_size):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for name, ref in single_process_result.items():
            got = result[name]
            moved = (ref - dict(start.named_parameters())[name]).norm()
            assert moved > 0, f"{name} never updated"
            err = ((got - ref).norm() / ref.norm()).item()
            assert err < 1e-5, f"rank {rank}/{world_size}: {name} relative error {err:.2e}"


def _liveness_worker(rank: int, port: int, out_dir: str):
    set_rank_env(rank, 2, port)
    ctx = init_distributed(timeout_s=30, device_type="cpu")
    if rank == 1:
        os._exit(0)  # a dead rank: never checks in
    with open(os.path.join(out_dir, "liveness.txt"), "w") as f:
        f.write(repr(lost_ranks(ctx, "probe", wait_s=2.0)))


def test_lost_ranks_names_the_dead_rank(tmp_path):
    mp.spawn(_liveness_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    assert (tmp_path / "liveness.txt").read_text() == "[1]"


def test_single_process_fallback(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = init_distributed(timeout_s=10, device_type="cpu")
    assert (ctx.rank, ctx.world_size, ctx.backend, ctx.device.type) == (0, 1, None, "cpu")
    destroy_distributed()
    with pytest.raises(ValueError, match="timeout_s"):
        init_distributed(timeout_s=0)


def _strided_embed_worker(rank: int, world_size: int):
    model = Net()
    model.embed.weight = nn.Parameter(model.lm_head.data.T.clone())  # clone keeps the transpose
    try:
        AnvilAndAdam(build_param_cfgs(model.named_parameters()), AnvilConfig(),
                     names={p: n for n, p in model.named_parameters()})
    except ValueError as e:
        return str(e)
    return "no error"


def test_strided_sharded_parameter_is_refused(tmp_path):
    """NCCL cannot all_gather into a strided tensor (gloo can): refuse it at construction."""
    mp.spawn(gloo_worker, args=(2, free_port(), str(tmp_path), _strided_embed_worker), nprocs=2)
    message = torch.load(tmp_path / "rank0.pt")
    assert "sharded Adam parameter embed.weight" in message and "contiguous" in message, message

