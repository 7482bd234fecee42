"""Start-up validation: every field of every shipped config has a declared constraint; one
invalid value per declared constraint, generated from the declarations, is rejected naming its
full key; several mistakes are reported together; cross-field rules."""

import glob
import importlib.util
import math
import os

import pytest

from configs.default import get_config
from configs.staleness_sweep import get_config as sweep_config
from jaxrl_llm.run import config as config_lib
from jaxrl_llm import validation
from jaxrl_llm.research import sweep
from jaxrl_llm.validation import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shipped_configs():
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
        if os.path.basename(path).startswith("_"):
            continue
        spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield os.path.basename(path), mod.get_config()


def test_every_field_of_every_shipped_config_has_a_declared_constraint():
    rules = sweep.config_rules()  # the experiment's, and a sweep config's own section
    seen = 0
    for name, config in _shipped_configs():
        if "learner" in config:  # an experiment config
            keys = set(validation.leaves(config))
            # and each shipped config is valid; one on a dataset and model the user names is
            # validated with them (configs/agent_math.py: tests/test_agents.py)
            if name != "agent_math.py":
                config_lib.validate(config)
        else:  # configs/objectives.py: the objective section alone
            keys = {f"objective.{k}" for k in validation.leaves(config)}
        missing = sorted(keys - set(rules))
        assert not missing, f"configs/{name}: no declared constraint for {missing}"
        seen += 1
    assert seen >= 5


def _set(config, key, value):
    *parents, leaf = key.split(".")
    node = config
    for p in parents:
        node = node[p]
    old = node[leaf]
    if isinstance(old, int) and not isinstance(old, bool) and isinstance(value, float) and value.is_integer():
        value = int(value)  # an int field gets the integer form of a float example
    node[leaf] = value


def test_one_generated_invalid_value_per_constraint_is_rejected_with_its_key():
    checked, by_type = 0, 0
    for key, rule in sweep.config_rules().items():
        if rule.allowed == "anything":
            continue  # paths: tests/test_paths.py
        assert rule.invalid_values, f"{key}: its rule has no invalid example"
        exercised = False
        for bad in rule.invalid_values:
            c = sweep_config() if key.startswith("sweep.") else get_config()
            try:
                _set(c, key, bad)
            except TypeError:  # the config's own type check refuses it (as the CLI override does)
                by_type += 1
                continue
            with pytest.raises(ConfigError) as e:
                (sweep.validate if key.startswith("sweep.") else config_lib.validate)(c)
            assert f"{key}={bad!r}" in str(e.value) or (isinstance(bad, float) and f"{key}=" in str(e.value)), (key, bad)
            exercised = checked = checked + 1
        if not exercised:  # every example was a wrong type: then the type check is the constraint
            assert by_type
    assert checked > 150


def test_several_mistakes_are_reported_together():
    c = get_config()
    c.learner.lr = -1.0
    c.sampler.top_p = 0.0
    c.runtime.max_staleness = -3
    c.objective.clip.eps_low = 1.5
    with pytest.raises(ConfigError) as e:
        config_lib.validate(c)
    msg = str(e.value)
    assert msg.startswith("invalid config values:")
    for part in ("learner.lr=-1.0: expected a finite number > 0", "sampler.top_p=0.0: expected a number in (0, 1]",
                 "runtime.max_staleness=-3: expected an integer >= 0 (or -1)",
                 "objective.clip.eps_low=1.5: expected a number in [0, 1)"):
        assert part in msg, part
    c = get_config()
    c.learner.lr = math.nan
    with pytest.raises(ConfigError, match="learner.lr=nan"):
        config_lib.validate(c)


def test_cross_field_rules():
    c = get_config()
    c.learner.num_minibatches = 3  # 32 prompts x 16 samples = 512 rows
    c.model.num_kv_heads = 3
    c.mesh.fsdp = 3
    with pytest.raises(ConfigError) as e:
        config_lib.validate(c)
    msg = str(e.value)
    assert "learner.num_minibatches=3 does not divide the batch's 512 rows" in msg
    assert "model.num_heads=4 is not a multiple of model.num_kv_heads=3" in msg
    assert "mesh / runtime.sampler_devices" in msg and msg.startswith("config problems:")


def test_cli_prints_a_refusal_as_one_line_and_lets_a_bug_keep_its_traceback(capsys):
    V = validation
    def refused():
        raise V.ConfigError("runtime.remote.port=70000: expected an integer in [0, 65535]")

    assert V.cli(refused, False, "tool") == 2
    assert capsys.readouterr().err.splitlines() == [
        "tool: error: runtime.remote.port=70000: expected an integer in [0, 65535]", "tool: (--verbose shows the traceback)"]
    with pytest.raises(V.ConfigError):
        V.cli(refused, True, "tool")
    with pytest.raises(ZeroDivisionError):
        V.cli(lambda: 1 // 0, False, "tool")
    assert V.cli(lambda: 0, False, "tool") == 0
