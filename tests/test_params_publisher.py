"""Weights published without the learn step waiting (gearflow/params/publisher.py): a staged publish
snapshots the weights and hands them to a helper thread that writes the store; the learner goes on.
On a GPU the snapshot is a device copy and the staging pinned (``cuda`` test); on the CPU the same
helper path runs with the snapshot as the staging copy."""

from __future__ import annotations

import threading

import pytest
import torch

from gearflow.params import ParameterStore, WeightPublisher


class HeldStore:
    """A real store whose publish waits until the test lets it go (a slow copy, a far shard node)."""

    def __init__(self, store):
        self.store, self.entered, self.go = store, threading.Event(), threading.Event()

    def publish(self, state, version=None):
        self.entered.set()
        assert self.go.wait(60)
        return self.store.publish(state, version)

    def latest_version(self):
        return self.store.latest_version()


def test_a_staged_publish_is_a_snapshot_written_by_the_helper():
    net = torch.nn.Linear(3, 2)
    with ParameterStore.create(net) as store:
        pub = WeightPublisher(store, lambda: net, "cpu", staged=True)
        want = {k: v.clone() for k, v in net.state_dict().items()}
        pub.publish()
        with torch.no_grad():  # the next optimizer step, right after: not in what is published
            net.weight.add_(1.0)
        pub.flush()
        version, got = store.read()
        assert version == 1 and all(torch.equal(got[k], want[k]) for k in want)
        pub.publish()
        pub.flush()
        assert store.read()[0] == 2 and torch.equal(store.read()[1]["weight"], net.weight.detach())
        pub.close()
        assert pub.published == 2 and pub.skipped == 0


def test_the_learner_goes_on_while_a_publish_is_held_and_later_ones_are_skipped():
    from gearflow.config import load_config
    from gearflow.learner import Learner, Progress
    from tests.test_apex_dqn import batch, make

    agent = make(["agent.hidden_sizes=[8]"])
    agent.setup_learner()
    cfg = load_config(None, ["learner.publish_every=1"])

    class Keys:
        def update_priorities(self, keys, priorities):
            pass

        def stats(self):
            return {}

    with ParameterStore.create(agent.learner_network()) as real:
        held = HeldStore(real)
        learner = Learner(cfg.learner, agent, Keys(), held, Progress(), run=cfg.run, env_steps=lambda: 0,
                          actor_version=lambda: 0)  # fmt: skip
        learner._weights = pub = WeightPublisher(held, agent.learner_network, "cpu", staged=True)
        learner.learn_step(batch())  # publishes: the helper takes it and is held in the store
        assert held.entered.wait(60)
        for _ in range(3):  # each would publish; the learner is not held, these are skipped
            learner.learn_step(batch())
        assert learner.progress.updates == 4 and pub.skipped == 3 and real.latest_version() == 0
        held.go.set()
        pub.flush()
        assert real.latest_version() == 1
        learner.learn_step(batch())
        pub.flush()
        assert real.latest_version() == 2  # the newest weights, version numbers only growing
        assert torch.equal(real.read()[1]["torso.net.1.weight"], agent.online.torso.net[1].weight.detach())
        pub.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_publish_snapshots_on_the_device_and_copies_on_a_side_stream():
    net = torch.nn.Linear(64, 64).cuda()
    with ParameterStore.create(net) as store:
        pub = WeightPublisher(store, lambda: net, "cuda")
        assert pub.staged
        want = {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}
        pub.publish()
        with torch.no_grad():
            net.weight.add_(1.0)  # queued after the snapshot on the same stream
        pub.flush()
        _, got = store.read()
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert all(t.is_pinned() for t in pub._staging.values())
        pub.close()
