"""Pure shard planning: where each parameter's optimizer state goes, tested without disk."""

from __future__ import annotations

import torch

from ckpt_lesson.files.payload import BINDING_KEY, optimizer_state_with_bindings
from ckpt_lesson.files.shard_plan import plan_optimizer_shards, plan_shards


def _adamw_state(model: torch.nn.Module) -> dict:
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    return optimizer_state_with_bindings(model, opt)


def test_each_parameters_optimizer_state_goes_to_the_shard_holding_the_parameter() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    names = [n for n, _ in model.named_parameters()]  # 0.weight, 0.bias, 1.weight, 1.bias
    plan = plan_shards(model.state_dict(), 3, "param_group")
    placed = plan_optimizer_shards(_adamw_state(model), plan)
    for shard, (keys, pids) in enumerate(zip(plan, placed, strict=True)):
        assert sorted(names[pid] for pid in pids) == sorted(keys), shard


def test_every_parameter_id_is_placed_exactly_once() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    placed = plan_optimizer_shards(_adamw_state(model), plan_shards(model.state_dict(), 5))
    assert sorted(pid for pids in placed for pid in pids) == [0, 1, 2, 3]


def test_state_of_an_unnamed_parameter_goes_round_robin_by_its_id() -> None:
    sd = {"state": {0: {}, 1: {}, 2: {}}, "param_groups": [{"params": [0, 1, 2]}]}  # no binding record
    assert plan_optimizer_shards(sd, [["a"], ["b"]]) == [[0, 2], [1]]


def test_state_keyed_by_anything_but_ints_stays_out_of_the_shards() -> None:
    sd = {"state": {"w": {}}, "param_groups": [{"params": ["w"], BINDING_KEY: {"param_names": ["w"]}}]}
    assert plan_optimizer_shards(sd, [["w"], []]) == [[], []]
