"""Tests of torchrl_grpo/loss/output.py: GRPOLossOutput read as torchrl's trainers and PPO code
read a loss; torchrl's PPO tutorial run with GRPOLoss in place of ClipPPOLoss."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from helpers.loss import (
    cartpole_actor,
    cartpole_batch,
)
from tensordict.nn import TensorDictModule
from tensordict.nn.distributions import NormalParamExtractor
from torch import nn
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement
from torchrl.envs import Compose, DoubleToFloat, StepCounter, TransformedEnv
from torchrl.envs.libs.gym import GymEnv
from torchrl.modules import ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import ClipPPOLoss, ValueEstimators
from torchrl.objectives.value import GAE

from torchrl_grpo import MCAdvantage, SameStartGroups
from torchrl_grpo.loss import (
    GRPOLoss,
)


class TestGRPOLossOutput:
    def test_string_indexing_and_items(self):
        actor = cartpole_actor()
        out = GRPOLoss(actor, kl_to_ref_coeff=None)(cartpole_batch(actor))
        assert out["loss_objective"] is out.loss_objective
        assert dict(out.items())["ESS"] is out.ESS
        with pytest.raises(KeyError, match="'loss_kl_to_ref' is not set"):
            out["loss_kl_to_ref"]

    def test_clip_ppo_loss_diagnostics(self):
        """Every entry of ClipPPOLoss's output that means something without a critic, with the
        same value on the same batch; a critic's entries say there is no critic."""
        actor = cartpole_actor()
        batch = cartpole_batch(actor)
        ref = ClipPPOLoss(actor)(batch.clone())
        out = GRPOLoss(actor)(batch.clone())
        for key in ref.keys():
            torch.testing.assert_close(out[key], ref[key], msg=key)
        assert set(ref.keys()) <= set(GRPOLoss(actor).out_keys)
        for key in ("loss_critic", "value_clip_fraction", "explained_variance"):
            with pytest.raises(KeyError, match=rf"'{key}': GRPO has no critic.*total_loss"):
                out[key]

    def test_mean_reduce_is_the_total_loss(self):
        """torchrl's recipe backpropagates ``loss.mean(reduce=True)``: it must not depend on
        how many metrics the output carries."""
        actor = cartpole_actor()
        batch = cartpole_batch(actor)
        loss = GRPOLoss(actor, entropy_coeff=0.05)
        params = list(actor.parameters())
        out = loss(batch.clone())
        total = out.loss_objective + out.loss_entropy
        torch.testing.assert_close(out.mean(reduce=True), total)
        by_mean = torch.autograd.grad(out.mean(reduce=True), params, retain_graph=True)
        by_sum = torch.autograd.grad(total, params)
        for a, b in zip(by_mean, by_sum, strict=True):
            torch.testing.assert_close(a, b)
        # other reductions keep TensorDict's meaning
        assert out.mean().loss_objective == out.loss_objective

    def test_torchrl_trainer_steps_sum_the_loss_terms(self):
        """torchrl's GRPOTrainer steps with MixedPrecisionOptimizationStepper, which sums the
        ``loss*`` entries of the output: one SGD step moves the policy by the gradient of
        ``loss_objective + loss_entropy``."""
        from torchrl.trainers import MixedPrecisionOptimizationStepper

        actor = cartpole_actor()
        batch = cartpole_batch(actor)
        loss = GRPOLoss(actor, entropy_coeff=0.05)
        params = list(loss.parameters())
        out = loss(batch.clone())
        grads = torch.autograd.grad(out.loss_objective + out.loss_entropy, params)
        expected = [(p - 0.1 * g).detach() for p, g in zip(params, grads)]

        class Trainer:  # the one method the stepper calls
            def compute_loss(self, sub_batch):
                return loss(sub_batch)

        stepper = MixedPrecisionOptimizationStepper(
            optimizer=torch.optim.SGD(params, lr=0.1), clip_norm=None
        )
        metrics = stepper.step(Trainer(), batch.clone())
        assert set(metrics.keys()) >= {"loss_objective", "loss_entropy", "ESS", "clip_fraction"}
        for p, e in zip(params, expected, strict=True):
            torch.testing.assert_close(p.detach(), e)


class TestPPOTutorial:
    """torchrl's PPO tutorial (pytorch/rl's sphinx tutorial ``coding_ppo.py``) with GRPOLoss in
    place of ClipPPOLoss, shrunk to a few seconds (Pendulum-v1 episodes of 20 steps, a 16-cell
    actor, two batches): every line that needs a critic fails and says what replaces it, and
    the rest runs as written, the advantage written by MCAdvantage in the replay buffer."""

    SETTINGS = dict(frames_per_batch=80, total_frames=160, sub_batch_size=20, num_epochs=2)

    def actor_and_critic(self, env):
        """The tutorial's policy and value networks (fewer cells, one hidden layer)."""
        actor_net = nn.Sequential(
            nn.LazyLinear(16),
            nn.Tanh(),
            nn.LazyLinear(2 * env.action_spec.shape[-1]),
            NormalParamExtractor(),
        )
        policy_module = ProbabilisticActor(
            module=TensorDictModule(actor_net, in_keys=["observation"], out_keys=["loc", "scale"]),
            spec=env.action_spec,
            in_keys=["loc", "scale"],
            distribution_class=TanhNormal,
            distribution_kwargs={
                "low": env.action_spec.space.low,
                "high": env.action_spec.space.high,
            },
            return_log_prob=True,
        )
        value_net = nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.LazyLinear(1))
        value_module = ValueOperator(module=value_net, in_keys=["observation"])
        policy_module(env.reset())
        value_module(env.reset())
        return policy_module, value_module

    @pytest.mark.parametrize(
        "keyword, value, match",
        [
            ("critic", "value_module", r"no critic.*torchrl_grpo\.MCAdvantage"),
            ("critic_network", "value_module", r"no critic.*torchrl_grpo\.MCAdvantage"),
            ("critic_coef", 1.0, "no critic"),
            ("critic_coeff", 1.0, "no critic"),
            ("loss_critic_type", "smooth_l1", "no critic"),
            ("value_target_key", "value_target", "no critic"),
            ("advantage_key", "advantage", r"set_keys\(advantage"),
            ("entropy_coef", 1e-4, "use entropy_coeff"),
            ("gamma", 0.99, r"MCAdvantage \(trajectory_return"),
        ],
    )
    def test_the_critic_lines_say_what_replaces_them(self, keyword, value, match):
        env = TransformedEnv(GymEnv("Pendulum-v1"), Compose(DoubleToFloat(), StepCounter()))
        policy_module, value_module = self.actor_and_critic(env)
        value = value_module if value == "value_module" else value
        with pytest.raises(TypeError, match=match):
            GRPOLoss(actor=policy_module, clip_epsilon=0.2, **{keyword: value})
        with pytest.raises(TypeError, match=r"ClipPPOLoss\(actor, critic\).*MCAdvantage"):
            GRPOLoss(policy_module, value_module)
        loss_module = GRPOLoss(actor=policy_module)
        gae = GAE(gamma=0.99, lmbda=0.95, value_network=value_module, average_gae=True)
        with pytest.raises(ValueError, match="reads no 'value_target' key: GRPO has no critic"):
            loss_module.set_keys(value_target=gae.value_target_key)
        with pytest.raises(NotImplementedError, match=r"\(GAE, .*torchrl_grpo\.MCAdvantage"):
            loss_module.make_value_estimator(ValueEstimators.GAE, gamma=0.99, lmbda=0.95)
        with pytest.raises(NotImplementedError, match="no critic and no value estimator"):
            _ = loss_module.value_estimator

    def test_the_training_loop_runs(self):
        s = self.SETTINGS
        torch.manual_seed(0)
        env = TransformedEnv(
            GymEnv("Pendulum-v1"),
            # episodes of 20 steps; SameStartGroups gives each seed to two episodes
            Compose(DoubleToFloat(), StepCounter(max_steps=20), SameStartGroups(group_size=2)),
        )
        policy_module, _ = self.actor_and_critic(env)
        collector = Collector(
            env,
            policy_module,
            frames_per_batch=s["frames_per_batch"],
            total_frames=s["total_frames"],
            split_trajs=False,
        )
        replay_buffer = ReplayBuffer(
            storage=LazyTensorStorage(s["frames_per_batch"]), sampler=SamplerWithoutReplacement()
        )
        # the tutorial's GAE(value_network=...): the group-relative advantage, at insertion
        replay_buffer.append_transform(MCAdvantage(grpo_size=2, prompt_key="reset_seed"))
        loss_module = GRPOLoss(
            actor=policy_module, clip_epsilon=0.2, entropy_bonus=True, entropy_coeff=1e-4
        )
        optim = torch.optim.Adam(loss_module.parameters(), 3e-4)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optim, 2, 0.0)
        before = [p.detach().clone() for p in policy_module.parameters()]
        logs = defaultdict(list)
        for tensordict_data in collector:
            replay_buffer.extend(tensordict_data.reshape(-1))  # advantages written here
            for _ in range(s["num_epochs"]):
                for _ in range(s["frames_per_batch"] // s["sub_batch_size"]):
                    subdata = replay_buffer.sample(s["sub_batch_size"])
                    loss_vals = loss_module(subdata)
                    with pytest.raises(KeyError, match="GRPO has no critic"):
                        loss_vals["loss_critic"]
                    loss_value = loss_vals["loss_objective"] + loss_vals["loss_entropy"]
                    loss_value.backward()
                    torch.nn.utils.clip_grad_norm_(loss_module.parameters(), 1.0)
                    optim.step()
                    optim.zero_grad()
            logs["reward"].append(tensordict_data["next", "reward"].mean().item())
            logs["step_count"].append(tensordict_data["step_count"].max().item())
            logs["lr"].append(optim.param_groups[0]["lr"])
            scheduler.step()
        assert len(logs["reward"]) == 2 and logs["step_count"] == [19, 19]  # counts from 0
        after = list(policy_module.parameters())
        assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
