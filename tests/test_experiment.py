"""The CLI's experiment runner: every objective runs end to end, configs fail early, resume."""

import json
import os

import ml_collections
import pytest

from configs.default import get_config
from jaxrl_llm.run import config as config_lib
from jaxrl_llm.run import experiment, xla
from jaxrl_llm import objectives


def shrink(c, steps=2, eval_every=1):
    """A runlocal-sized version of any experiment config."""
    c.task.eval_size = 8
    c.model.update(dict(hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1, head_dim=8, num_layers=1))
    if c.aux_model.hidden_size:
        c.aux_model.update(dict(hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1, head_dim=4, num_layers=1))
    c.warm_start.steps = 5
    c.runtime.prompts_per_batch = 2
    c.sampler.num_samples = 4
    c.learner.num_minibatches = 2
    c.train.update(dict(steps=steps, eval_every=eval_every, save_every=eval_every, progress=False))
    return c


def _tiny(name="a3po", mode="sync"):
    c = shrink(get_config(name))
    c.runtime.mode = mode
    return c


@pytest.mark.parametrize("name", objectives.BUILTIN)
def test_every_objective_runs_and_writes_metrics(name, tmp_path):
    c = _tiny(name, mode="async" if name == "a3po" else "sync")
    c.sampler.temperature = 0.9  # the learner must read it, not have it written into config.learner
    given = c.to_dict()
    summary = experiment.run(c, str(tmp_path), log=lambda *_: None)
    assert summary["version"] == 2
    assert c.to_dict() == given and json.load(open(tmp_path / "config.json")) == json.loads(c.to_json())
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval/reward" in r]
    assert len(steps) == 2 and [r["step"] for r in evals] == [0, 1, 2]
    for key in ("loss", "clip_frac", "is_weight/max", "staleness/mean", "reward/mean", "tokens_per_s",
                "compile/programs", "compile/cache_hits", "compile/seconds"):
        assert key in steps[-1], key
    assert steps[0]["compile/programs"] >= 1  # the first step compiles (or loads) the step's programs
    for r in steps:  # rewards are in [0, 1]: some reward iff a positive mean
        assert 0.0 <= r["reward/nonzero"] <= 1.0 and (r["reward/nonzero"] > 0) == (r["reward/mean"] > 0)
    assert all(r["eval_set"] == "generated (seed 12345)" and r["eval/problems"] == c.task.eval_size for r in evals)


def test_resume_continues_from_the_workdir(tmp_path):
    c = _tiny()
    experiment.run(c, str(tmp_path), log=lambda *_: None)
    c.train.steps = 3
    lines = []
    summary = experiment.run(c, str(tmp_path), log=lines.append)
    assert summary["version"] == 3 and any("resumed" in line and "version 2" in line for line in lines)
    assert os.path.exists(tmp_path / "checkpoints")


@pytest.mark.parametrize("over,match", [
    (dict(task=dict(name="gsm8k")), "task.name='gsm8k': expected one of 'arithmetic', 'math'"),
    (dict(objective=dict(name="ppo2")), "objective.name='ppo2': expected a registered objective name"),
    (dict(runtime=dict(mode="hogwild")), "runtime.mode='hogwild': expected one of 'sync', 'iterative'"),
    (dict(runtime=dict(sampler_devices=8)), "sampler_devices=8 leaves no device for the learner: 8 available"),
    # Layouts that used to fail at the first step, after every compile (#51 item 7):
    (dict(mesh=dict(data=1, tensor=8)), r"mesh.tensor=8 does not divide the model's heads \[2\], vocab \[17\].*one of \[1\]"),
    (dict(runtime=dict(sampler_devices=1)), "8 rows do not split over the learner's data x fsdp x expert = 7 devices"),
    (dict(model=dict(matmul_precision="tf32")), "model.matmul_precision='tf32': expected one of 'default'"),
])
def test_bad_config_fails_at_startup(over, match, tmp_path):
    c = _tiny()
    c.update(over)
    with pytest.raises(ValueError, match=match):
        experiment.run(c, str(tmp_path))


def test_sampler_devices_split_learner_and_samplers(tmp_path):
    """runtime.sampler_devices=6 of the 8 fake devices: the learner's mesh has the first 2, the
    samplers split rows over the last 6 (8 rows, padded to 12) and receive each version there
    (one shared host copy)."""
    import jax

    c = _tiny(mode="async")
    c.runtime.sampler_devices = 6
    b = experiment.build(c)
    devices = jax.devices()
    assert list(b.learner.mesh.devices.flat) == devices[:2]
    assert list(b.orchestrator.sampler.mesh.devices.flat) == devices[2:]
    state = b.learner.init(jax.random.key(0))
    state, hist = b.orchestrator.run(state, 2)
    _, params = b.orchestrator.store.latest()
    leaf = jax.tree_util.tree_leaves(params)[0]
    assert leaf.sharding.device_set == set(devices[2:])
    # CPU sampler devices alias one host copy of each published version (sharding.put)
    assert len({s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards}) == 1
    assert int(state.version) == 2 and all(0 <= m["staleness/mean"] <= 1 for m in hist)


def test_jackpot_without_topk_capture_is_rejected():
    c = _tiny("jackpot")
    c.sampler.capture_topk = 0
    with pytest.raises(ValueError, match="set --config.sampler.capture_topk"):
        config_lib.validate(c)


def test_ctrl_c_saves_the_live_state(tmp_path, monkeypatch):
    from jaxrl_llm.runtime import orchestrator

    c = _tiny()
    c.train.update(dict(steps=6, eval_every=6, save_every=100))
    real = orchestrator.Orchestrator.train
    calls = []

    def interrupted(self, state, batch, **kw):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(1)
        return real(self, state, batch, **kw)

    monkeypatch.setattr(orchestrator.Orchestrator, "train", interrupted)
    summary = experiment.run(c, str(tmp_path), log=lambda *_: None)
    assert summary["version"] == 3
    monkeypatch.setattr(orchestrator.Orchestrator, "train", real)
    lines = []
    assert experiment.run(c, str(tmp_path), log=lines.append)["version"] == 6
    assert any("resumed" in line and "version 3" in line for line in lines)


def test_build_reads_the_config_and_writes_nothing_back():
    c = _tiny("jackpot")
    c.sampler.temperature = 0.7
    c.aux_model.update(dict(hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1, head_dim=4, num_layers=1))
    given = c.to_dict()
    b = experiment.build(c)
    assert c.to_dict() == given
    lrn = b.learner
    assert lrn.temperature == 0.7 and lrn.aux.name == "actor"
    assert b.orchestrator.sampler.model_cfg == lrn.rollout_model_cfg == b.aux_cfg  # the actor samples
    # After start-up only frozen sections travel: the learner, the runtime and its mode, the scorer.
    frozen = ml_collections.FrozenConfigDict
    assert all(isinstance(x, frozen) for x in (b.plan.config, lrn.cfg, b.orchestrator.cfg, b.orchestrator.mode.ctx.cfg))
    c.objective.name = "ppo"
    with pytest.raises(ValueError, match="config.aux_model sets a second model, but objective 'ppo' trains none; "
                                         "objectives that do: jackpot"):
        config_lib.validate(c)


def test_kill_9_and_resume_logs_every_step_once(tmp_path):
    import subprocess
    import sys
    import time

    from tests.test_distributed import ENV, ROOT, TINY

    cmd = [sys.executable, "-m", "jaxrl_llm.main", *TINY, f"--workdir={tmp_path}", "--config.runtime.mode=sync",
           "--config.train.save_every=2", "--config.train.eval_every=1000"]
    p = subprocess.Popen([*cmd, "--config.train.steps=1000"], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    path, deadline = tmp_path / "metrics.jsonl", time.monotonic() + 240
    while time.monotonic() < deadline and (not path.exists() or path.read_text().count('"loss"') < 5):
        time.sleep(0.2)
    p.kill()  # SIGKILL: no chance to save or clean up
    p.wait()
    logged = path.read_text().count('"loss"')
    assert logged >= 5
    r = subprocess.run([*cmd, f"--config.train.steps={logged + 3}"], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in open(path) if '"loss"' in line]
    assert steps == list(range(1, logged + 4))


def test_start_up_resolves_the_objective_once_and_hands_out_frozen_sections(monkeypatch):
    """`plan.resolve` validates the objective section once; the learner, the memory plan and
    the orchestrator take the resolved, immutable parts instead of reading the config again."""
    import importlib

    registry = importlib.import_module("jaxrl_llm.objectives.registry")  # the module, not objectives.registry()
    calls = []
    real = registry._validate
    monkeypatch.setattr(registry, "_validate", lambda c: (calls.append(c.name), real(c))[1])
    c = _tiny("decoupled_ppo")
    b = experiment.build(c)
    assert calls == ["decoupled_ppo"]
    plan, lrn, orch = b.plan, b.learner, b.orchestrator
    assert lrn.plan.obj_cfg is plan.objective and plan.passes == {"prox_logp"}
    with pytest.raises(AttributeError):  # immutable, unlike the user's config
        plan.config.learner.lr = 1.0
    assert orch.cfg is plan.config.runtime and lrn.cfg is plan.config.learner
    assert plan.sampler.num_samples == c.sampler.num_samples and plan.greedy.temperature == 0.0


def test_a_run_whose_first_batches_all_score_zero_is_warned_once():
    """`_StepRecords` warns (log and records) once the first `task.zero_reward_steps` batches all
    scored exactly 0; one rewarded sample disarms it, and a resumed run (which did not see its
    first batches) never warns."""
    from types import SimpleNamespace

    def records(nonzero, version=0, k=3):
        lines, written = [], []
        out = SimpleNamespace(writer=SimpleNamespace(write=written.append), log=lines.append,
                              progress=SimpleNamespace(update=lambda *a: None, enabled=True), compiles=xla.CompileLog())
        c = _tiny()
        c.task.zero_reward_steps = k
        on = experiment._StepRecords(c, out, None, SimpleNamespace(check=lambda: None), 0, 0.0, version)
        for step, z in enumerate(nonzero, version + 1):
            on({"version": step, "skipped_updates": 0, "reward/nonzero": z})
        return [w for w in written if "warning" in w], lines

    warned, lines = records([0.0] * 5)
    assert [w["step"] for w in warned] == [3] and len(lines) == 1
    assert lines[0].startswith("warning: every sample of the first 3 batches scored exactly 0")
    assert records([0.0, 0.25, 0.0, 0.0, 0.0])[0] == []
    assert records([0.0] * 5, version=2)[0] == []
    assert records([0.0] * 5, k=0)[0] == []


def test_a_checkpoint_is_read_straight_into_the_learners_shardings(tmp_path):
    """#51 item 8: an HF checkpoint goes tensor by tensor into the learner's mesh (fsdp=2 here),
    never whole onto one device."""
    from jax.sharding import PartitionSpec as P

    from tests import hf_fixtures as F

    F.save(F.make_hf_model("qwen2_tied", vocab=64), str(tmp_path / "m"))
    c = _tiny()
    c.model.hf_path, c.mesh.fsdp = str(tmp_path / "m"), 2
    b = experiment.build(c)
    gate = b.params["layers_0"]["mlp"]["gate"]["kernel"]
    assert gate.sharding == b.learner.layout.param_sh["layers_0"]["mlp"]["gate"]["kernel"]
    assert gate.sharding.spec == P("fsdp", "tensor") and len(gate.sharding.device_set) == 8


def test_evaluation_reads_the_samplers_copy_once_published(tmp_path, monkeypatch):
    """#51 item 8: after the first evaluation (nothing published yet) the greedy reward is
    computed from the weight store's copy of that version, and equals the masters' reward."""
    calls = []
    accuracy = experiment._Evaluator.accuracy

    def spy(self, params, sampler, local=False):
        got = accuracy(self, params, sampler, local)
        if local:  # the same version from the learner's float32 masters
            state = self.b.orchestrator.state
            calls.append(got == accuracy(self, self.b.learner.policy_params(state), sampler))
        else:
            calls.append(None)
        return got

    monkeypatch.setattr(experiment._Evaluator, "accuracy", spy)
    experiment.run(_tiny(), str(tmp_path), log=lambda *_: None)
    assert calls == [None, True, True]


def test_samplers_sharing_an_fsdp_learners_devices_get_whole_weights_once_per_version():
    """#51 item 8: with mesh.fsdp=2 and shared devices the store publishes a replicated copy on
    the sampler mesh, so no sampler call gathers the learner's shards."""
    import jax

    c = _tiny()
    c.mesh.fsdp = 2
    b = experiment.build(c)
    state = b.learner.init(jax.random.key(0))
    assert not b.learner.policy_params(state)["embed"].sharding.is_fully_replicated
    b.orchestrator.publish(state)
    _, params = b.orchestrator.store.latest()
    leaf = params["embed"]
    assert leaf.sharding.is_fully_replicated and leaf.sharding.device_set == set(b.orchestrator.sampler.mesh.devices.flat)


def test_model_dtype_auto_is_bfloat16_on_accelerators_and_float32_on_cpu():
    from jaxrl_llm.run import plan

    c = _tiny()
    assert c.model.dtype == "auto" and plan.resolve(c).model.dtype == "float32"  # this CPU
    for platform, want in (("gpu", "bfloat16"), ("tpu", "bfloat16"), ("cpu", "float32")):
        d = _tiny()
        plan.resolve_dtypes(d, platform)
        assert d.model.dtype == want and d.aux_model.dtype == want
    d = _tiny()
    d.model.dtype = "float32"  # asked for: kept on a GPU too
    plan.resolve_dtypes(d, "gpu")
    assert d.model.dtype == "float32"
