"""``learner.graph`` (gearflow/learner/graph.py): each form of an agent's update captured in a CUDA
graph learns what the eager update learns. The reference agents take the update as an argument of
``learn``; on a CPU, or for an agent that does not, the learner learns eagerly and says so."""

from __future__ import annotations

import logging

import pytest
import torch

from gearflow.agent import make_agent
from gearflow.bench.learner import filled_table
from gearflow.config import load_config
from gearflow.learner import Learner, Progress
from gearflow.learner.graph import GraphedLearn, learn_function, takes_update
from gearflow.params import ParameterStore
from tests.test_learner_host_reads import AGENTS


def agent_and_batches(name: str, device: str, n: int = 8, *overrides: str):
    path, spec, small = AGENTS[name]
    cfg = load_config(path, [*small, f"learner.device={device}", "run.seed=3", *overrides])
    torch.manual_seed(3)
    agent = make_agent(cfg, spec, torch.device(device))
    agent.setup_learner()
    table = filled_table(cfg, agent, steps_per_partition=1024)
    try:
        batches = []
        for _ in range(n):
            s = table.sample(int(cfg.learner.batch_size))
            batches.append(type(s)({k: v.to(device).clone() for k, v in s.data.items()}, s.keys.clone(),
                                   s.weights.to(device).clone(), s.probabilities.clone()))  # fmt: skip
    finally:
        table.close()
    return cfg, agent, batches


def flat(agent) -> torch.Tensor:
    return torch.cat([p.detach().flatten().cpu() for p in agent.learner_network().parameters()])


@pytest.mark.parametrize("name", sorted(AGENTS))
def test_the_reference_agents_take_their_update_as_an_argument(name):
    """What a graph replays is the agent's own update: learn(batch, update=agent.update) is learn(batch),
    and the update's forms are the arguments it is called with (DPG: the policy every 2nd)."""
    _, a, batches = agent_and_batches(name, "cpu")
    _, b, _ = agent_and_batches(name, "cpu")
    assert takes_update(a)
    forms = []

    def update(batch, *args):
        forms.append(args)
        return b.update(batch, *args)

    for batch in batches:
        ma, pa = a.learn(batch)
        mb, pb = b.learn(batch, update=update)
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
        assert ma.keys() == mb.keys()
    assert torch.equal(flat(a), flat(b))
    assert forms == ([(False,), (True,)] * 4 if name == "dpg" else [()] * 8)


def test_on_a_cpu_learner_graph_learns_eagerly_and_says_so(caplog):
    cfg, agent, batches = agent_and_batches("dqn", "cpu", 6, "learner.graph=true")
    _, eager, _ = agent_and_batches("dqn", "cpu", 6)

    class Keys:
        def update_priorities(self, keys, priorities):
            pass

    with caplog.at_level(logging.INFO, logger="gearflow.runner"), ParameterStore.create(agent.online) as store:
        learner = Learner(cfg.learner, agent, Keys(), store, Progress(), run=cfg.run, env_steps=lambda: 0,
                          actor_version=lambda: 0)  # fmt: skip
        for batch in batches:
            learner.learn_step(batch)
            eager.learn(batch)
    assert "learner.graph=true: the learner is on cpu, not CUDA: it learns eagerly" in caplog.text
    assert torch.equal(flat(agent), flat(eager))


def test_an_agent_without_update_learns_eagerly(caplog):
    class Plain:
        def learn(self, batch):
            return {}, None

    with caplog.at_level(logging.INFO, logger="gearflow.runner"):
        plain = Plain()
        assert learn_function(plain, torch.device("cuda"), True) == plain.learn
    assert "takes no update=" in caplog.text


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(AGENTS))
def test_a_graphed_update_learns_what_the_eager_one_learns(name):
    _, eager, batches = agent_and_batches(name, "cuda", 12)
    _, graphed, _ = agent_and_batches(name, "cuda", 12)
    learn = GraphedLearn(graphed, torch.device("cuda"), warmup=2)
    for batch in batches:
        me, pe = eager.learn(batch)
        mg, pg = learn(batch)
        torch.testing.assert_close(pg, pe, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.as_tensor(mg["learner/loss"]), torch.as_tensor(me["learner/loss"]),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
    assert learn.replays >= 12 - 2 * len(learn.graphs) and learn.graphs
    torch.testing.assert_close(flat(graphed), flat(eager), rtol=1e-4, atol=1e-5)
