"""examples/llm_grpo.py: its task and reward, the torchrl components it uses, a tiny run."""

import copy
import csv
import dataclasses
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.examples import load_example
from tensordict import TensorDict

from torchrl_grpo.checkpoint import load_checkpoint

try:
    import transformers  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise  # CI installs the `llm` extra (make test): without it this is a failure, not a skip
    pytest.skip("needs the llm extra: pip install -e '.[llm]'", allow_module_level=True)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llm_grpo.py"
RESULT = re.compile(r"RESULT acc_before=(\d+\.\d+) acc_after=(\d+\.\d+) wall_s=(\d+\.\d+)")
TINY = ["--prompts-per-step", "4", "--group-size", "4", "--minibatch", "8", "--eval-prompts", "50"]


@pytest.fixture(scope="module")
def ex():
    return load_example(EXAMPLE, "llm_grpo")


@pytest.fixture(scope="module")
def tokenizer(ex):
    return ex.make_tokenizer()


class TestTask:
    def test_reward_is_the_exact_answer_then_end_of_sequence(self, ex):
        assert ex.reward("17<eos>", "17") == 1.0
        assert ex.reward("17<eos><pad>", "17") == 1.0  # padding after the end is ignored
        assert ex.reward("17", "17") == 0.0  # right digits, never ended
        assert ex.reward("017<eos>", "17") == 0.0
        assert ex.reward("1<eos>", "17") == 0.0
        assert ex.reward("17<eos>", "1") == 0.0
        assert ex.reward("0<eos>", "0") == 1.0

    def test_tokenizer_is_character_level(self, tokenizer):
        ids = tokenizer("3 9 1 4=")["input_ids"]
        assert len(ids) == 8
        assert tokenizer.decode(ids) == "3 9 1 4="
        assert tokenizer.decode(tokenizer("17<eos>")["input_ids"]) == "17<eos>"
        assert tokenizer("17<eos>")["input_ids"][-1] == tokenizer.eos_token_id
        assert len(tokenizer) == 14 and tokenizer.pad_token_id != tokenizer.eos_token_id

    def test_training_prompts_never_hit_the_evaluation_set(self, ex):
        gen, task = torch.Generator().manual_seed(0), ex.digit_sum_task(4)
        held_out = set(ex.draw_problems(task, gen, 500, set())["query"])
        train = ex.draw_problems(task, gen, 5000, held_out)
        assert train.shape == (5000,) and len(held_out) > 450  # few repeats among 10^4 prompts
        assert not held_out & set(train["query"])
        for query, answer in zip(train["query"][:50], train["answer"][:50]):
            digits = [int(d) for d in query[:-1].split()]
            assert len(digits) == 4 and query.endswith("=") and answer == str(sum(digits))

    def test_digit_sum_task(self, ex):
        task = ex.digit_sum_task(3)
        assert (task.prompt_length, task.answer_length) == (6, 2)  # "9 9 9=", "27"
        assert ex.parse_args(["--digits", "3"]).max_new_tokens == 3  # two digits and the end
        assert ex.parse_args(["--digits", "2", "--max-new-tokens", "5"]).max_new_tokens == 5
        assert ex.digit_sum_task(1).answer_length == 1

    def test_running_sum_task(self, ex):
        task = ex.running_sum_task(4)
        assert (task.prompt_length, task.answer_length) == (8, 10)  # "9 9 9 9=", "9 18 27 36"
        problems = task.draw(torch.Generator().manual_seed(0), 200)
        for query, answer in problems:
            digits = [int(d) for d in query[:-1].split()]
            sums = [sum(digits[: k + 1]) for k in range(4)]
            assert answer == " ".join(map(str, sums)) and len(answer) <= task.answer_length
        assert max(len(a) for _, a in problems) >= 8  # the digit sum's are 1 or 2 long
        assert task.reward("3 12 13 17" + ex.EOS, "3 12 13 17") == 1.0
        assert task.reward("3 12 13 18" + ex.EOS, "3 12 13 17") == 0.0

    def test_the_task_flag(self, ex, capsys):
        [field] = [f for f in dataclasses.fields(ex.Settings) if f.name == "task"]
        assert field.metadata["choices"] == tuple(ex.TASKS)  # --help lists every task
        cfg = ex.parse_args(["--task", "running-sum", "--digits", "3"])
        assert ex.make_task(cfg).name == "running_sum" and cfg.max_new_tokens == 8  # "9 18 27"
        assert ex.make_task(ex.parse_args([])).name == "digit_sum"
        with pytest.raises(SystemExit):
            ex.parse_args(["--task", "sum"])
        assert "invalid choice: 'sum'" in capsys.readouterr().err

    def test_completions_are_cut_at_the_end_of_sequence(self, ex, tokenizer):
        """What the task's reward reads: the response up to its first end-of-sequence, then
        ``EOS`` whatever the tokenizer's own text for it; padding never reaches the reward."""
        scorer = ex.TaskReward(tokenizer, ex.digit_sum_task())
        texts = ["17<eos><pad>", "0<pad><pad>", "12<eos>"]
        responses = [torch.tensor(tokenizer(t)["input_ids"]) for t in texts]
        assert scorer.completions(responses) == ["17<eos>", "0<pad><pad>", "12<eos>"]

    def test_env_rewards_the_responses(self, ex, tokenizer):
        """The env's reward transform scores what the policy wrote, per row, as [B, 1, 1]; the
        accuracy is the mean reward, and evaluating does not change the stored prompts."""
        responses = ["17<eos>", "0<pad><pad>", "5<eos><pad>"]  # right; never ended; wrong
        response = torch.tensor([tokenizer(r)["input_ids"] for r in responses])

        def policy(td):  # writes fixed responses where a sampler writes its completions
            td["tokens", "response"] = response
            td["tokens", "full"] = torch.cat([td["tokens", "prompt"], response], -1)
            return td

        problems = TensorDict(
            query=["3 9 1 4=", "0 0 0 0=", "1 1 1 1="], answer=["17", "0", "4"], batch_size=[3]
        )
        accuracy = ex.GreedyAccuracy(tokenizer, ex.digit_sum_task(), problems, policy)
        assert accuracy.prompts["query"] == ["3 9 1 4=", "0 0 0 0=", "1 1 1 1="]
        out = accuracy.env.step(policy(accuracy.prompts.copy()))
        assert out["next", "reward"].shape == (3, 1, 1)
        assert out["next", "reward"].flatten().tolist() == [1.0, 0.0, 0.0]
        assert out["next", "done"].all()  # one step per episode
        assert accuracy() == pytest.approx(1 / 3)
        assert accuracy() == pytest.approx(1 / 3)
        assert ("tokens", "response") not in accuracy.prompts.keys(True)


@pytest.fixture
def pipeline(ex, tokenizer):
    cfg, task = ex.parse_args(TINY), ex.digit_sum_task()
    torch.manual_seed(0)
    model = ex.make_model(cfg, tokenizer, task.prompt_length + cfg.max_new_tokens)
    gen = torch.Generator().manual_seed(0)
    collector, rb = ex.make_collector(cfg, task, model, copy.deepcopy(model), tokenizer, gen, set())
    loss_fn = ex.make_loss(ex.make_scorer(model, tokenizer, cfg), cfg)
    return cfg, model, collector, rb, loss_fn


class TestPipeline:
    def test_built_from_torchrl_llm_components(self, ex, pipeline):
        from torchrl.collectors.llm import LLMCollector
        from torchrl.data import LazyStackStorage
        from torchrl.envs.llm import ChatEnv, RetrieveLogProb
        from torchrl.modules.llm import TransformersWrapper
        from torchrl.trainers.algorithms.grpo import GRPOTrainer

        import torchrl_grpo

        cfg, model, collector, rb, loss_fn = pipeline
        assert isinstance(collector, LLMCollector)
        assert isinstance(collector.env.base_env, ChatEnv)
        assert isinstance(collector.policy, TransformersWrapper) and collector.policy.generate
        assert collector.policy.model is model
        assert isinstance(rb.storage, LazyStackStorage)
        (advantage,) = [t for t in rb.transform if isinstance(t, torchrl_grpo.MCAdvantage)]
        assert advantage.prompt_key == "query" and advantage.grpo_size == cfg.group_size
        assert isinstance(loss_fn, torchrl_grpo.GRPOLoss)
        # the log-probs of the loss, the sampling policy and the reference: the lean wrapper
        assert isinstance(loss_fn.actor_network, torchrl_grpo.LeanTransformersWrapper)
        assert not loss_fn.actor_network.generate and loss_fn.actor_network.model is model
        score = getattr(collector.postproc, "__wrapped__", collector.postproc)  # under no_grad
        scorers = [t.model for t in score if isinstance(t, RetrieveLogProb)]
        assert [type(s) for s in scorers] == [torchrl_grpo.LeanTransformersWrapper] * 2
        assert scorers[0].model is model and scorers[1].model is not model
        plain = ex.make_scorer(model, scorers[0].tokenizer, ex.parse_args([*TINY, "--no-lean"]))
        assert type(plain) is TransformersWrapper
        source = EXAMPLE.read_text()
        assert "GRPOTrainer(" in source and ex.GRPOTrainer is GRPOTrainer
        assert ex.RetrieveLogProb is RetrieveLogProb
        # no hand-written sampler, padding or tokenizer
        for banned in ("past_key_values", "multinomial", "pad_sequence", "class CharTokenizer"):
            assert banned not in source

    def test_collected_batch_groups_completions_and_starts_on_policy(self, ex, pipeline):
        """One collection: each prompt group_size times, advantages per group, padding only
        after the end of a response; before any update the ratio is 1 and the KL to the
        reference (a copy of the policy) is 0."""
        cfg, model, collector, rb, loss_fn = pipeline
        next(iter(collector))
        batch = rb[:]
        rows = cfg.prompts_per_step * cfg.group_size
        assert batch.shape == (rows,)
        queries = batch["query"] if "query" in batch.keys() else None
        assert queries is None  # the strings are dropped before storage
        advantage = batch["advantage"].reshape(cfg.prompts_per_step, cfg.group_size)
        reward = batch["next", "reward"].reshape(cfg.prompts_per_step, cfg.group_size)
        mean, std = reward.mean(-1, keepdim=True), reward.std(-1, keepdim=True).clamp_min(1e-6)
        expected = (reward - mean) / std
        torch.testing.assert_close(advantage, expected)

        response = batch["tokens", "response"]
        tokenizer = collector.policy.tokenizer
        ended = (response == tokenizer.eos_token_id).cumsum(-1) > 0
        after_end = torch.cat([torch.zeros_like(ended[:, :1]), ended[:, :-1]], -1)
        assert torch.equal(response == tokenizer.pad_token_id, after_end)

        out = loss_fn(batch)
        torch.testing.assert_close(out.ESS, torch.tensor(1.0))
        assert out.clip_fraction.item() == 0.0
        assert abs(out.kl_approx.item()) < 1e-5
        assert abs(out.kl_to_ref.item()) < 1e-5
        assert 0.0 < out.entropy.item() < math.log(len(tokenizer))

    def test_no_torchrl_future_warning(self, ex, tokenizer):
        """torchrl 0.14's collectors warn (``FutureWarning``: "missing transforms required by
        the policy (InitTracker)") on an env without ``"is_init"``; the example's env has
        torchrl's ``InitTracker``, whose entry the buffer does not store."""
        import warnings

        cfg, task = ex.parse_args(TINY), ex.digit_sum_task()
        model = ex.make_model(cfg, tokenizer, task.prompt_length + cfg.max_new_tokens)
        gen = torch.Generator().manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            collector, rb = ex.make_collector(
                cfg, task, model, copy.deepcopy(model), tokenizer, gen, set()
            )
            next(iter(collector))
        future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        assert not future, future
        assert "is_init" not in rb[:].keys() and ("next", "is_init") not in rb[:].keys(True)


def copy_letters(ex):
    """A task whose prompts differ in length: ``"cab>"`` is answered ``"cab"`` (1 to 4 letters)."""

    def draw(gen, n):
        rows = []
        for _ in range(n):
            length = int(torch.randint(1, 5, (), generator=gen))
            word = "".join("abcd"[i] for i in torch.randint(0, 4, (length,), generator=gen))
            rows.append((word + ">", word))
        return rows

    return ex.Task(
        name="copy_letters",
        alphabet="abcd>",
        prompt_length=5,
        answer_length=4,
        draw=draw,
        reward=lambda completion, answer: float(completion == answer + ex.EOS),
    )


def test_prompts_of_different_lengths(ex):
    """A task whose prompts differ in token length (torchrl 0.14.1's ChatEnv failed to stack
    them at the first reset): the batch keeps each prompt's own tokens, groups by prompt, and
    the loss starts on-policy (ratio 1, no KL to the copied reference)."""
    task = copy_letters(ex)
    tokenizer = ex.make_tokenizer(task.alphabet)
    cfg = ex.parse_args([*TINY, "--max-new-tokens", "5"], task)
    torch.manual_seed(0)
    model = ex.make_model(cfg, tokenizer, task.prompt_length + cfg.max_new_tokens)
    gen = torch.Generator().manual_seed(0)
    collector, rb = ex.make_collector(cfg, task, model, copy.deepcopy(model), tokenizer, gen, set())
    next(iter(collector))
    batch = rb[:]
    prompts = batch["tokens", "prompt"]  # (B, P): the sampler pads the prompts on the left
    real = prompts != tokenizer.pad_token_id
    assert len(set(real.sum(-1).tolist())) > 1  # prompts of different lengths
    assert torch.equal(real, real.cumsum(-1) > 0) or torch.equal(real, real.flip(-1).cumprod(-1))
    texts = [tokenizer.decode(p[r]) for p, r in zip(prompts, real)]
    groups = [texts[i : i + cfg.group_size] for i in range(0, len(texts), cfg.group_size)]
    assert all(len(set(g)) == 1 for g in groups)  # a group: one prompt
    # the stored log-probs are the model's on each row without its pads
    full, stored = batch["tokens", "full"], batch["next", "log_probs", "full"]
    answered = (batch["tokens", "response"] != tokenizer.pad_token_id).sum(-1)  # up to EOS
    width = prompts.shape[1]
    with torch.no_grad():
        for row, mask, logp, n in zip(full, real, stored, answered):
            ids = row[(~mask).sum() : width + n]  # the row without its pads
            truth = model(ids[None]).logits[0, :-1].log_softmax(-1)
            truth = truth.gather(-1, ids[1:, None]).squeeze(-1)[mask.sum() - 1 :]
            torch.testing.assert_close(logp[width : width + n], truth, atol=1e-5, rtol=0)
    loss_fn = ex.make_loss(ex.make_scorer(model, tokenizer, cfg), cfg)
    out = loss_fn(batch)
    torch.testing.assert_close(out.ESS, torch.tensor(1.0))
    assert abs(out.kl_to_ref.item()) < 1e-5


def test_no_reference_is_scored_at_kl_coeff_0(ex, tokenizer):
    """``--kl-coeff 0``: the collector scores the sampling policy only (no reference pass, no
    ``ref_log_probs`` in the batch), the loss has no KL term and trains on that batch; above 0
    the reference is scored and the loss weighs it."""
    from torchrl.envs.llm import RetrieveLogProb

    task, gen = ex.digit_sum_task(), torch.Generator().manual_seed(0)
    for coeff in (0.0, 0.02):
        cfg = ex.parse_args([*TINY, "--kl-coeff", str(coeff)])
        torch.manual_seed(0)
        model = ex.make_model(cfg, tokenizer, task.prompt_length + cfg.max_new_tokens)
        reference = copy.deepcopy(model)
        scorers = ex.log_prob_scorers(cfg, model, reference, tokenizer)
        assert all(isinstance(s, RetrieveLogProb) for s in scorers)
        assert len(scorers) == (2 if coeff else 1)
        collector, rb = ex.make_collector(cfg, task, model, reference, tokenizer, gen, set())
        next(iter(collector))
        collector.shutdown()
        batch = rb[:]
        assert (("next", "ref_log_probs", "full") in batch.keys(True)) == bool(coeff)
        out = ex.make_loss(ex.make_scorer(model, tokenizer, cfg), cfg)(batch)
        assert (out.kl_to_ref is None) == (coeff == 0) and torch.isfinite(out.total_loss())
        if coeff:
            assert abs(out.kl_to_ref.item()) < 1e-5  # the reference: the policy, unchanged


class TestLearningRateSchedule:
    class Clock:  # one second per GRPO step
        now = 0.0

        def __call__(self):
            return self.now

    def _factors(self, ex, deadline_s: float, steps: int = 20, warmup: int = 4) -> list[float]:
        cfg = ex.parse_args([*TINY, "--steps", str(steps), "--warmup-steps", str(warmup)])
        optim = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        clock = self.Clock()
        schedule = ex.lr_schedule(optim, cfg, deadline=deadline_s, clock=clock)
        factors = [optim.param_groups[0]["lr"]]
        for _ in range(steps):
            optim.step()
            clock.now += 1.0
            schedule.step()
            factors.append(optim.param_groups[0]["lr"])
        return factors

    @staticmethod
    def expected(progress: list[float], warmup: float) -> list[float]:
        """Warm-up from 0.05 over the first ``warmup`` of the progress, then the cosine."""
        return [
            0.05 + 0.95 * p / warmup
            if p < warmup
            else 0.5 * (1 + math.cos(math.pi * (p - warmup) / (1 - warmup)))
            for p in progress
        ]

    def test_follows_the_steps_with_time_to_spare(self, ex):
        """Warm-up from 0.05 over 4 steps, then the cosine over the other 16: the reference."""
        factors = self._factors(ex, deadline_s=3600.0)
        expected = [0.05 + 0.95 * k / 4 for k in range(4)]
        expected += [0.5 * (1 + math.cos(math.pi * k / 16)) for k in range(17)]
        assert factors == pytest.approx(expected, abs=1e-6)

    def test_shrinks_with_the_time_limit(self, ex):
        """Time for half the steps: the warm-up takes 2 steps, not 4, and the cosine reaches 0
        at step 10, where the time runs out (the issue's --time-limit 30 spent all 12 of its GRPO
        steps warming up)."""
        factors = self._factors(ex, deadline_s=10.0)
        assert factors[:11] == pytest.approx(self.expected([k / 10 for k in range(11)], 0.2))
        assert factors[1] == pytest.approx(0.05 + 0.95 / 2) and factors[2] == 1.0
        assert factors[10:] == [0.0] * 11

    def test_no_time_left(self, ex):
        assert self._factors(ex, deadline_s=0.0) == [0.0] * 21

    def _resumed(self, ex, deadline_s: float, stop: int, more_time: float = 0.0) -> list[float]:
        """The rates of a schedule of 20 steps stopped after ``stop`` (1 s per step) and
        restored in a new process (its clock elsewhere, its deadline its own), as the example's
        checkpoint does; the rates from the stop on, the restored one first."""
        cfg = ex.parse_args([*TINY, "--steps", "20", "--warmup-steps", "4"])
        optim = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        clock = self.Clock()
        schedule = ex.lr_schedule(optim, cfg, deadline=deadline_s, clock=clock)
        for _ in range(stop):
            optim.step()
            clock.now += 1.0
            schedule.step()
        progress = ex.schedule_progress(schedule)
        saved = (optim.state_dict(), schedule.state_dict(), progress.state_dict())
        cfg.time_limit += more_time  # the resumed run's --time-limit
        optim = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        clock = self.Clock()
        clock.now = 5000.0
        schedule = ex.lr_schedule(optim, cfg, deadline=clock.now + 7.0, clock=clock)
        optim.load_state_dict(saved[0])
        schedule.load_state_dict(saved[1])
        ex.schedule_progress(schedule).load_state_dict(saved[2])
        rates = [optim.param_groups[0]["lr"]]
        for _ in range(stop, 20):
            optim.step()
            clock.now += 1.0
            schedule.step()
            rates.append(optim.param_groups[0]["lr"])
        return rates

    @pytest.mark.parametrize("deadline_s", [3600.0, 10.0], ids=["steps", "time"])
    def test_a_resume_continues_the_curve(self, ex, deadline_s):
        """Stopped at step 6 (a kill, --stop-at-step): the restored rate is the stop's, and
        the next ones the uninterrupted run's, whether the steps or the time limit lead (the
        time's share counts the seconds before the checkpoint, not the new process's clock)."""
        whole = self._factors(ex, deadline_s=deadline_s)
        assert self._resumed(ex, deadline_s, stop=6) == pytest.approx(whole[6:], abs=1e-12)

    def test_a_spent_time_limit_stays_spent_unless_raised(self, ex):
        """Stopped by the time limit (step 10 of 20, the rate 0): resumed with the same limit,
        the rate stays 0 and the run is out of time; with 10 s more, the rest of the curve
        stretches over the new budget, as a raised --steps does."""
        assert self._resumed(ex, 10.0, stop=10) == [0.0] * 11
        stretched = self._resumed(ex, 10.0, stop=10, more_time=10.0)
        assert stretched[0] == 0.0  # the stop's rate, restored
        assert stretched[1:] == pytest.approx(self.expected([k / 20 for k in range(11, 21)], 0.2))


def test_help_describes_every_setting_with_its_default(ex):
    """``--help`` as the CartPole example's: every flag with a description and its default."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    for f in ex.dataclasses.fields(ex.Settings):
        flag = "--" + f.name.replace("_", "-")
        assert flag in out, flag
        assert f.metadata.get("help"), flag
    assert "(default: 0.0005)" in out and "(default: runs/llm_grpo)" in out


def copy_two_letters(ex):
    """A task of 16 prompts: ``"ab>"`` is answered ``"ab"``."""

    def draw(gen, n):
        pairs = torch.randint(0, 4, (n, 2), generator=gen).tolist()
        return [("abcd"[i] + "abcd"[j] + ">", "abcd"[i] + "abcd"[j]) for i, j in pairs]

    return ex.Task(
        name="copy",
        alphabet="abcd>",
        prompt_length=3,
        answer_length=2,
        draw=draw,
        reward=lambda completion, answer: float(completion == answer + ex.EOS),
    )


def test_another_task_and_model(ex, tmp_path, capsys):
    """``main(task=..., model_and_tokenizer=...)``: copy two letters, on a one-layer Qwen2 built by
    the caller; the run trains, evaluates and saves that model and its tokenizer."""

    copy_task = copy_two_letters(ex)
    built = []

    def one_layer(cfg, task):
        tokenizer = ex.make_tokenizer(task.alphabet)
        model = ex.make_model(ex.dataclasses.replace(cfg, n_layer=1), tokenizer, 8)
        built.append(model)
        return model, tokenizer

    args = ["--steps", "2", "--eval-every", "1", *TINY, "--eval-prompts", "4"]
    args += ["--sft-max-steps", "2", "--time-limit", "1e6", "--out", str(tmp_path)]
    result = ex.main(args, task=copy_task, model_and_tokenizer=one_layer)
    printed = capsys.readouterr().out  # the task names no metric: its mean reward
    assert "greedy mean reward" in printed and "greedy accuracy" not in printed
    (model,) = built
    assert result["run_dir"].parent == tmp_path and result["run_dir"].name.startswith("copy")
    assert 0.0 <= result["acc_after"] <= 1.0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(result["run_dir"] / "model")
    assert loaded.config.num_hidden_layers == 1
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value.cpu()), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(result["run_dir"] / "tokenizer")
    assert tokenizer("ab>")["input_ids"] == ex.make_tokenizer("abcd>")("ab>")["input_ids"]


def test_a_task_with_too_few_prompts_is_refused(ex):
    """Every prompt held out for evaluation: drawing training problems stops with an error
    (it looped for ever)."""
    task = copy_two_letters(ex)
    every_prompt = {a + b + ">" for a in "abcd" for b in "abcd"}
    gen = torch.Generator().manual_seed(0)
    assert len(ex.draw_problems(task, gen, 5, every_prompt - {"ab>"})) == 5  # one is enough
    with pytest.raises(ValueError, match="too few distinct prompts for this --eval-prompts"):
        ex.draw_problems(task, gen, 5, every_prompt)


def test_tiny_run_prints_a_result_line(ex, tmp_path, device):
    """The script end to end on a tiny budget, on every available device (``--device``): one
    RESULT line, consistent with its own logs."""
    args = ["--steps", "4", "--eval-every", "2", *TINY, "--out", str(tmp_path)]
    args += ["--device", str(device)]
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert sum(line.startswith("RESULT") for line in lines) == 1
    match = RESULT.fullmatch(lines[-1])
    assert match, lines[-1]
    acc_before, acc_after, wall_s = map(float, match.groups())
    # the warm start stops at 30% on its validation prompts; chance is about 1 in 37
    assert 0.1 <= acc_before <= 1.0 and 0.0 <= acc_after <= 1.0
    assert 0.0 < wall_s <= elapsed

    (run_dir,) = tmp_path.iterdir()
    assert (run_dir / "llm_grpo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(any(p.iterdir()) for p in run_dir.rglob("*") if p.is_dir())  # no empty folder
    # the trained model and tokenizer, saved: greedy on the held-out prompts, as at the end
    model = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(run_dir / "tokenizer")
    cfg, task = ex.parse_args(TINY), ex.digit_sum_task()
    assert tokenizer("12 3=")["input_ids"] == ex.make_tokenizer()("12 3=")["input_ids"]
    problems = ex.draw_problems(task, torch.Generator().manual_seed(1234), 50, set())
    greedy = ex.make_sampler(model, tokenizer, cfg, greedy=True)
    accuracy = ex.GreedyAccuracy(tokenizer, task, problems, greedy)()
    assert accuracy == pytest.approx(acc_after, abs=1e-4)
    logged = {}
    names = ("reward", "ESS", "clip_fraction", "kl_to_ref", "entropy", "loss_objective", "accuracy")
    for name in names:
        with open(run_dir / "scalars" / f"{name}.csv") as f:
            logged[name] = [(int(s), float(v)) for s, v in csv.reader(f)]
    rows = 4 * 4  # prompts per step x group size: the trainer logs at the completions collected
    assert [s for s, _ in logged["reward"]] == [rows, 2 * rows, 3 * rows, 4 * rows]
    assert [s for s, _ in logged["ESS"]] == [rows, 2 * rows, 3 * rows, 4 * rows]
    assert [s for s, _ in logged["accuracy"]] == [2 * rows, 4 * rows]
    assert logged["accuracy"][-1][1] == pytest.approx(acc_after, abs=1e-4)
    assert all(0.0 < v <= 1.0 + 1e-6 for _, v in logged["ESS"])
    assert all(0.0 <= v <= 1.0 for _, v in logged["clip_fraction"] + logged["reward"])
    assert all(math.isfinite(v) for _, v in logged["kl_to_ref"] + logged["entropy"])


def test_lora_rank_trains_adapters_against_the_base_model(ex, tmp_path):
    """``--lora-rank``: after the warm start the policy gets LoRA adapters (peft) and only they
    train; the reference is the same model with its adapters disabled, so the first step's KL to
    it is 0 (the adapters start at zero); the adapters are saved."""
    built = []

    def keep(cfg, task):
        model, tokenizer = ex.tiny_qwen2(cfg, task)
        built.append(model)
        return model, tokenizer

    args = ["--steps", "2", "--eval-every", "2", *TINY, "--sft-max-steps", "20"]
    args += ["--lora-rank", "4", "--lr", "1e-3", "--time-limit", "1e6", "--out", str(tmp_path)]
    result = ex.main(args, model_and_tokenizer=keep)
    run_dir = result["run_dir"]
    assert (run_dir / "model" / "adapter_config.json").is_file()
    (model,) = built  # the adapters were injected into it in place
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    with open(run_dir / "scalars" / "kl_to_ref.csv") as f:
        kl = [float(v) for _, v in csv.reader(f)]
    assert abs(kl[0]) < 1e-6 and len(kl) == 2
    with pytest.raises(SystemExit):
        ex.parse_args(["--lora-rank", "-1"])


def test_a_model_whose_special_ids_disagree_with_the_tokenizer_is_refused(ex):
    """LlamaConfig's default eos id (2) is the digit "2" of this tokenizer: generation would stop
    at every "2". Refused, both ids named."""
    cfg, task = ex.parse_args(TINY), ex.digit_sum_task()
    model, tokenizer = ex.tiny_qwen2(cfg, task)
    ex.check_special_ids(model, tokenizer)  # the example's own model agrees
    model.generation_config.eos_token_id = 2
    with pytest.raises(ValueError, match=r"generation_config.eos_token_id=2 but the tokenizer's"):
        ex.check_special_ids(model, tokenizer)


def test_main_twice_in_one_process_each_has_its_own_clock(ex, tmp_path):
    """A second main() call starts its own clock (the first one's counts the imports)."""
    args = ["--steps", "1", "--eval-every", "1", *TINY, "--sft-max-steps", "2"]
    args += ["--time-limit", "1e6", "--out", str(tmp_path)]
    ex.main(args)
    start = time.perf_counter()
    second = ex.main(args)
    assert second["wall_s"] <= time.perf_counter() - start


def test_a_saved_run_evaluated_with_model_and_eval_only(ex, tmp_path):
    """``--model <run>/model --eval-only``: the saved model and tokenizer (found beside it) give
    the run's final greedy accuracy again; nothing trains, no run folder."""
    args = ["--steps", "2", "--eval-every", "2", *TINY, "--sft-max-steps", "20"]
    result = ex.main([*args, "--time-limit", "1e6", "--out", str(tmp_path)])
    model_dir = result["run_dir"] / "model"
    again = ex.main([*TINY, "--model", str(model_dir), "--eval-only", "--out", str(tmp_path)])
    assert again["acc_before"] == again["acc_after"] == pytest.approx(result["acc_after"], abs=1e-4)
    assert again["run_dir"] is None and len(list(tmp_path.iterdir())) == 1
    with pytest.raises(SystemExit):  # the multi-turn and async examples do not take them
        ex.parse_args(["--eval-only"], settings_cls=type("Other", (ex.Settings,), {}))


def test_logger_choice(ex, tmp_path, monkeypatch):
    """``--logger none`` runs without metrics files (the plot and model still saved); a logger
    whose package is missing is a clear error naming the extra to install."""
    args = ["--steps", "1", "--eval-every", "1", *TINY, "--sft-max-steps", "2"]
    result = ex.main([*args, "--logger", "none", "--time-limit", "1e6", "--out", str(tmp_path)])
    assert (result["run_dir"] / "llm_grpo.png").is_file()
    assert not (result["run_dir"] / "scalars").exists()

    def no_tensorboard(*args, **kwargs):
        raise ImportError("No module named 'tensorboard'")

    monkeypatch.setattr(ex, "get_logger", no_tensorboard)
    with pytest.raises(SystemExit, match=r"--logger tensorboard needs .*\[tensorboard\]"):
        ex.main([*args, "--logger", "tensorboard", "--out", str(tmp_path)])


@pytest.mark.parametrize("lora", [[], ["--lora-rank", "2"]], ids=["weights", "lora"])
def test_resume_goes_on_from_the_checkpoint(ex, tmp_path, lora):
    """A run of 4 steps stopped at step 2 (``--stop-at-step``), then ``--resume`` to step 3: the
    steps, curves, logger steps and the transform's counters go on from the checkpoint, the
    learning rate continues the curve of 4 steps, the reference is the first run's warm start,
    a resume with no step left changes no weight, and a setting that shapes the model is
    refused."""
    args = ["--eval-every", "1", *TINY, "--sft-max-steps", "3", "--time-limit", "1e6", *lora]
    args += ["--steps", "4", "--checkpoint-every", "1"]
    first = ex.main([*args, "--stop-at-step", "2", "--out", str(tmp_path / "first")])["run_dir"]
    saved = load_checkpoint(first / "checkpoint", weights_only=False)
    assert saved.stamp == saved.values["state"]["progress"]["seen"]["step"] == 2
    rates = [5e-4 * f for f in TestLearningRateSchedule.expected([2 / 4, 3 / 4], 3 / 4)]
    assert saved.values["state"]["schedule"]["_last_lr"] == pytest.approx([rates[0]])
    more = [*args, "--stop-at-step", "3", "--resume", str(first)]
    second = ex.main([*more, "--out", str(tmp_path / "b")])
    resumed = load_checkpoint(second["run_dir"] / "checkpoint", weights_only=False)
    state = resumed.values["state"]
    progress = state["progress"]
    assert progress["seen"]["step"] == 3 and progress["history"]["step"] == [1, 2, 3]
    assert state["schedule"]["_last_lr"] == pytest.approx([rates[1]])  # the curve of 4 steps
    assert progress["seen"]["completions"] == 3 * 16  # the transform's counters went on
    assert second["acc_before"] == saved.values["state"]["progress"]["acc_before"]
    reference, again = saved.values["reference"], resumed.values["reference"]
    assert all(torch.equal(reference[k], again[k]) for k in reference)
    with open(second["run_dir"] / "scalars" / "reward.csv") as f:  # the trainer's frames go on
        steps = [int(row[0]) for row in csv.reader(f)]
    with open(first / "scalars" / "reward.csv") as f:
        before = [int(row[0]) for row in csv.reader(f)]
    assert len(steps) == 1 and steps[0] > before[-1]

    same = [*args, "--stop-at-step", "2", "--resume", str(first), "--out", str(tmp_path / "c")]
    kept = load_checkpoint(ex.main(same)["run_dir"] / "checkpoint", weights_only=False)
    policy = saved.values["state"]["policy"]
    assert all(torch.equal(policy[k], kept.values["state"]["policy"][k]) for k in policy)
    # a time limit the checkpoint's seconds of GRPO already spent: nothing trains, same rate
    spent = [*args, "--time-limit", "0", "--resume", str(first), "--out", str(tmp_path / "d")]
    spent = load_checkpoint(ex.main(spent)["run_dir"] / "checkpoint", weights_only=False)
    assert spent.stamp == 2 and spent.values["state"]["schedule"]["_last_lr"] == [rates[0]]
    with pytest.raises(SystemExit, match="--group-size 4"):
        ex.main([*args, "--group-size", "2", "--resume", str(first), "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--kl-coeff is 0 in one of the two runs"):
        ex.main([*args, "--kl-coeff", "0", "--resume", str(first), "--out", str(tmp_path)])
