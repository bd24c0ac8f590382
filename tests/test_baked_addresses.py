"""Census of baked addresses: an in-place reset passes, every kind of rebind fails naming its role.

CPU only, reuses the fakes and harness of tests/test_step_graphs.py (StepGraphs over the CPU
stand-in backend); ~2 s. Run: `.venv/bin/python -m pytest tests/test_baked_addresses.py -q`.
"""

import json

import pytest
import torch

from test_step_graphs import Harness
from track_1_short.perf.cuda_graphs.baked_addresses import CensusError, compare, take_census


@pytest.fixture(scope="module")
def sealed_harness() -> Harness:
    h = Harness()
    h.warmup_and_seal()
    return h


def _census(h: Harness):
    return take_census(h.model, h.runner)


def test_in_place_reset_passes(sealed_harness):
    h = sealed_harness
    before = _census(h)
    with torch.no_grad():
        for p in h.model.parameters():
            p.mul_(1.0)
        h.model.fp8_scale.fill_(1.0)
        h.value_embeds.grad_accum.zero_()
    compare(before, _census(h))
    roles = before.entries.keys()
    assert "param:bank_qk" in roles and "buffer:ngram.cache" in roles
    assert "buffer:yarn_wide.table" in roles and "baked:value_embeds.grad_accum" in roles
    assert json.loads(before.to_json())["param:embed"]["shape"] == [16, 8]


def _rebind_param(h):
    h.model.bank_mlp.data = h.model.bank_mlp.data.clone()


def _rebind_buffer(h):
    h.model.yarn.table = h.model.yarn.table.clone()


def _rebind_sink(h):
    h.model.ngram.sinks[24] = torch.zeros(48, 8, requires_grad=True)


def _rebind_grad_accum(h):
    h.value_embeds.grad_accum = torch.zeros_like(h.value_embeds.grad_accum)


@pytest.mark.parametrize("rebind, role", [
    (_rebind_param, "param:bank_mlp"),
    (_rebind_buffer, "buffer:yarn.table"),
    (_rebind_sink, "baked:ngram_table.sinks[24]"),
    (_rebind_grad_accum, "baked:value_embeds.grad_accum"),
])
def test_rebind_is_caught_naming_the_role(rebind, role):
    h = Harness()
    h.warmup_and_seal()
    before = _census(h)
    rebind(h)
    with pytest.raises(CensusError, match=rf"changed {role.replace('[', '.').replace(']', '.')}: "
                                          rf"ptr 0x[0-9a-f]+ shape .* -> ptr"):
        compare(before, _census(h))


def test_missing_and_added_roles(sealed_harness):
    h = sealed_harness
    before = _census(h)
    extra = _census(h)
    extra.add("extra:optimizer.exp_avg[embed]", torch.zeros(3))
    with pytest.raises(CensusError, match=r"added extra:optimizer\.exp_avg\[embed\]"):
        compare(before, extra)
    with pytest.raises(CensusError, match=r"missing extra:optimizer\.exp_avg\[embed\]"):
        compare(extra, before)


def test_every_changed_role_is_listed():
    h = Harness()
    h.warmup_and_seal()
    before = _census(h)
    _rebind_param(h)
    _rebind_buffer(h)
    with pytest.raises(CensusError, match=r"2 baked address") as info:
        compare(before, _census(h))
    assert "param:bank_mlp" in str(info.value) and "buffer:yarn.table" in str(info.value)


def test_duplicate_role_rejected(sealed_harness):
    census = _census(sealed_harness)
    with pytest.raises(CensusError, match="listed twice"):
        census.add("param:bank_qk", torch.zeros(1))
