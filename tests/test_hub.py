"""`remote/hub.py`: versions, run ids, rewards, rooms, sizes and names checked; fuzzed groups never stop
a learner step."""

import time

import jax
import numpy as np
import pytest

from jaxrl_llm.remote import wire
from tests.remote_helpers import _group, _hub, _weights


def test_hub_checks_versions_run_ids_and_rewards_and_refuses_a_lying_node():
    from jaxrl_llm.remote.hub import MIN_VERIFIED

    hub, task = _hub()
    with pytest.raises(PermissionError, match=r"protocol 1 \(jaxrl_llm 0\.1\.0\); the node 0 \(jaxrl_llm 0\.0\.1\)"):
        hub.hello({"protocol": 0, "package": "0.0.1"})
    me = hub.hello({"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__, "name": "n"})
    s = {k: me[k] for k in ("run_id", "node", "session")}
    with pytest.raises(wire.Rejected, match="restarted"):
        hub.lease({"run_id": "old", "node": me["node"]})

    def make(lease, k, lie):
        prompt = hub.producer.draw(1, lease["draw"])[0][k]
        f = _group(rows=2, p=len(prompt) + 1, new=4, k=0, prompt=prompt, vocab=task.vocab_size, kept=False)
        f["versions"] = np.where(f["loss_mask"] > 0, 3, -1).astype(np.int32)
        honest = [task.reward(prompt, t[m > 0].tolist()) for t, m in zip(f["tokens"], f["loss_mask"])]
        f["rewards"] = (1.0 - np.asarray(honest) if lie else np.asarray(honest)).astype(np.float32)
        return f

    def group(lease, k, lie, claimed=None):
        f = make(lease, k, lie)
        return hub.put_group({**s, "lease": lease["id"], "group": k, "weights": weights if claimed is None else claimed,
                              "table": wire.encode_group(wire.group_batch(f))}), f

    weights = _weights(hub, s)
    for claimed, why in (({}, r"\(None\) are not the ones published"), ({"3": "0-1"}, r"\(0-1\) are not the ones")):
        lease = hub.lease({**s, "version": 3})["leases"][0]
        with pytest.raises(wire.Rejected, match=f"the weights the node used for version 3 {why}"):
            group(lease, 0, lie=False, claimed=claimed)  # weights that never arrived are not staleness
    lease = hub.lease({**s, "version": 3})["leases"][0]
    out, f = group(lease, 0, lie=False)
    assert out == {"accepted": True} and len(hub.queue) == 1
    item = hub.queue.get(3)[0]
    assert item.origin == (0, lease["draw"], (0,))
    np.testing.assert_array_equal(item.batch.rewards, f["rewards"])
    np.testing.assert_array_equal(item.batch.advantages, 0.0)  # the learner's own, per batch (RemoteMode)
    with pytest.raises(wire.Rejected, match="not held"):
        group(lease, 0, lie=False)  # once only
    for i in range(MIN_VERIFIED - 1):  # 1 honest + 4 lies: refused at the 5th check (4 / 5 > max_mismatch)
        (lease,) = hub.lease({**s, "version": 3})["leases"]
        with pytest.raises(wire.Rejected, match="differ from the learner's"):
            group(lease, 0, lie=True)
    with pytest.raises(PermissionError, match=f"{MIN_VERIFIED - 1} of {MIN_VERIFIED} verified groups"):
        hub.lease({**s, "version": 3})
    with pytest.raises(PermissionError, match="'n' was refused earlier in this run"):
        hub.hello({"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__, "name": "n"})
    assert hub.refusals == {"hello": 2, "session": 1, "weights": 2, "lease": 1, "reward": MIN_VERIFIED - 1,
                            "refused": 1}
    assert hub.rejected == 11 and len(hub.queue) == 0 and hub.leases.pending_groups() == 0


def test_each_node_leases_from_its_own_room_so_a_hoarding_node_starves_no_one():
    hub, _ = _hub(capacity=4)
    hi = {"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__}
    hog, honest = ({k: me[k] for k in ("run_id", "node", "session")} for me in (hub.hello({**hi, "name": "hog"}),
                                                                              hub.hello({**hi, "name": "honest"})))
    for _ in range(5):  # the hog asks again and again and uploads nothing
        hub.lease({**hog, "version": 3, "count": 8})
    assert hub.leases.pending_groups("hog") == 4  # its room: capacity groups leased or queued
    got = hub.lease({**honest, "version": 3, "count": 8})["leases"]
    assert sum(len(x["groups"]) for x in got) == 4 and hub.leases.pending_groups("honest") == 4


def test_oversized_groups_are_refused_before_decoding_and_gone_nodes_leave_the_table_and_metrics():
    import pyarrow as pa

    from jaxrl_llm.remote import hub as hub_lib

    hub, task = _hub(verify_fraction=0.0)
    hi = {"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__}
    rows = pa.table({n: pa.array([None] * 2_000_000, t) for n, t in zip(wire._SCHEMA.names, wire._SCHEMA.types)})
    for name in ("wide", "rows"):  # each refused before decoding, and its node for good: no honest node sends it
        me = hub.hello({**hi, "name": name})
        bad = {k: me[k] for k in ("run_id", "node", "session")}
        lease = hub.lease({**bad, "version": 3})["leases"][0]
        prompt = hub.producer.draw(1, lease["draw"])[0][lease["groups"][0]]
        wide = _group(rows=2, p=len(prompt) + 4000, new=4, k=0, prompt=prompt, vocab=task.vocab_size, kept=False)
        table = wire.encode_group(wire.group_batch(wide)) if name == "wide" else rows
        with pytest.raises(wire.Rejected, match=f"this run's groups take at most {len(wire.GROUP_FIELDS)} rows and"):
            hub.put_group({**bad, "lease": lease["id"], "group": lease["groups"][0], "table": table})
        with pytest.raises(PermissionError, match=f"node {name} was refused: it sent a group larger than"):
            hub.lease({**bad, "version": 3})
    assert hub.refusals == {"size": 2, "refused": 2} and hub.leases.pending_groups() == 0  # all leased again
    me = hub.hello({**hi, "name": "n"})
    s = {k: me[k] for k in ("run_id", "node", "session")}
    lease = hub.lease({**s, "version": 3})["leases"][0]
    hub._draw_prompts = lambda draw: 1 / 0  # a bug on the learner: the node hears "internal error", nothing more
    with pytest.raises(wire.Rejected, match=r"^internal error on the learner \(ZeroDivisionError\); it is logged there$"):
        hub.put_group({**s, "lease": lease["id"], "group": lease["groups"][0], "table": wire.encode_group(
            wire.group_batch(_group(rows=2, p=hub.max_width - 4, new=4, k=0, prompt=prompt, vocab=task.vocab_size,
                                    kept=False)))})
    assert hub.refusals["internal"] == 1 and hub.leases.pending_groups("n") == len(lease["groups"]) - 1
    for n in range(5):
        hub.hello({**hi, "name": f"gone{n}"})
    assert len([k for k in hub.metrics() if k.startswith("remote/gone")]) == 5 * 3
    for name in list(hub.nodes):
        if name != "n":
            hub.nodes[name].seen -= hub_lib.PRUNE_LEASES * hub.leases.lease_s + 1
    assert hub.lease({**s, "version": 3})["leases"]
    hub.nodes["n"].seen -= hub_lib.PRUNE_LEASES * hub.leases.lease_s + 1  # gone too, but it holds a lease
    hub.expire()
    assert sorted(hub.nodes) == ["n"] and not any(k.startswith("remote/gone") for k in hub.metrics())
    live = __import__("dataclasses").replace(hub.nodes["n"], seen=time.monotonic())
    hub.nodes.update({f"x{i}": live for i in range(hub_lib.MAX_NODES)})
    with pytest.raises(wire.Rejected, match=f"at most {hub_lib.MAX_NODES} nodes at once; try again later"):
        hub.hello({**hi, "name": "one-more"})


def test_node_names_are_bounded_labels_and_sessions_cannot_be_taken():
    from jaxrl_llm.remote import hub as hub_lib

    hub, _ = _hub()
    hi = {"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__}
    now = [0.0]
    hub.hellos.clock = lambda: now[0]
    for i in range(hub_lib.HELLO_BURST):  # new sessions per host: a burst, then one per HELLO_EVERY_S
        hub.hello({**hi, "name": "churn", "peer": f"ipv4:10.0.0.9:{4000 + i}"})
    with pytest.raises(wire.Rejected, match=r"too many new sessions from ipv4:10.0.0.9; try again in 10 s"):
        hub.hello({**hi, "name": "churn", "peer": "ipv4:10.0.0.9:5000"})
    hub.hello({**hi, "name": "other-host", "peer": "ipv4:10.0.0.8:4000"})
    now[0] = hub_lib.HELLO_EVERY_S
    hub.hello({**hi, "name": "churn", "peer": "ipv4:10.0.0.9:5001"})
    assert hub.refusals == {"throttled": 1}
    hub.nodes.clear()
    for bad in ("x" * 65, "a b", "a/b", "\u00e9t\u00e9", 7):
        with pytest.raises(PermissionError, match="node names are 1 to 64 characters"):
            hub.hello({**hi, "name": bad})
    names = [hub.hello({**hi, "name": n})["node"] for n in ("a", "a", "a-1", "a")]
    assert names == ["a", "a-1", "a-1-1", "a-2"] and len(hub.nodes) == 4  # unique, whatever the order
    me, other = hub.hello({**hi, "name": "me"}), hub.hello({**hi, "name": "other"})
    assert me["session"] != other["session"] and len(me["session"]) == 32
    mine = {k: me[k] for k in ("run_id", "node", "session")}
    assert hub.heartbeat(mine)["version"] == 3
    for forged in (dict(mine, node="other"), dict(mine, session=""), {k: mine[k] for k in ("run_id", "node")}):
        with pytest.raises(wire.Rejected, match="session key does not match"):
            hub.release(forged)  # nobody else's leases can be heartbeaten or released


def test_hub_plays_a_multi_turn_group_again_and_refuses_a_forged_observation():
    from jaxrl_llm.tasks import arithmetic
    from jaxrl_llm.tasks.tool_arithmetic import ToolArithmetic

    task = ToolArithmetic()
    hub, _ = _hub(task=task, max_new_tokens=task.max_answer_len)
    try:
        me = hub.hello({"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__, "name": "n"})
        s = {k: me[k] for k in ("run_id", "node", "session")}

        def put(forge):
            lease = hub.lease({**s, "version": 3})["leases"][0]
            prompt = hub.producer.draw(1, lease["draw"])[0][0]
            # the warm start's trace of this prompt: two calls, their values as observations, the answer
            _, episode, keep = task.trace(arithmetic.decode(prompt))
            n, p = task.max_answer_len, task.max_prompt_len
            f = _group(rows=2, p=p, new=n, k=0, prompt=prompt, vocab=task.vocab_size, kept=False)
            f["tokens"][:, p:] = 0
            f["tokens"][:, p:p + len(episode)] = episode
            f["loss_mask"][:] = 0
            f["loss_mask"][:, p:p + len(episode)] = keep
            f["input_mask"] = (f["tokens"] > 0).astype(np.float32)
            f["versions"] = np.where(f["loss_mask"] > 0, 3, -1).astype(np.int32)
            f["rewards"] = np.ones(2, np.float32)
            if forge:  # the first observation's first digit, changed
                at = p + keep.index(0.0)
                f["tokens"][1, at] = 3 + (f["tokens"][1, at] - 2) % 10
            return hub.put_group({**s, "lease": lease["id"], "group": 0, "weights": _weights(hub, s),
                                  "table": wire.encode_group(wire.group_batch(f))})

        assert put(forge=False) == {"accepted": True}
        with pytest.raises(wire.Rejected, match="episode replay: the observation at token .* is not the environment's"):
            put(forge=True)
        assert hub.rejected == 1
        hub._replay = lambda *a: 1 / 0  # the learner's own environment fails: unverified, not held against the node
        assert put(forge=True) == {"accepted": True} and hub.replay_failures == 1 and hub.rejected == 1
    finally:
        task.close()


def _table(f: dict):
    """A group table of exactly the fields, dtypes and shapes in `f` (unlike `wire.encode_group`,
    which starts from a well-formed batch)."""
    import pyarrow as pa

    rows = [(n, x.dtype.name, list(x.shape), np.ascontiguousarray(x).tobytes()) for n, x in f.items()]
    return pa.Table.from_pylist([dict(zip(wire._SCHEMA.names, r)) for r in rows], schema=wire._SCHEMA)


_POISON = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "huge": 3e38, "neg": -5, "big": 2**31 - 1}


def _mutate(f: dict, mutations) -> dict:
    """`f` with each (field, kind, u, v) applied: a field dropped, retyped, cut by a row or a
    column, or one value (at position u of its flat array) poisoned; an unknown field added."""
    f = dict(f)
    for field, kind, u, v in mutations:
        if field not in f:
            continue
        x = f[field]
        if kind == "drop":
            del f[field]
        elif kind == "dtype":
            f[field] = x.astype(np.float64 if x.dtype != np.float64 else np.int32)
        elif kind == "rows":
            f[field] = x[:-1] if v < 0.5 else np.concatenate([x, x[:1]])
        elif kind == "width" and x.ndim > 1:
            f[field] = x[:, 1:] if v < 0.5 else np.concatenate([x, x[:, :1]], 1)
        elif kind == "extra":
            f["logits"] = x
        elif kind in _POISON and x.size and x.dtype != bool:
            y = x.copy().reshape(-1)
            value = _POISON[kind]
            if np.issubdtype(y.dtype, np.integer):  # its own extremes: no float cast of inf or 3e38
                value = -1 if not np.isfinite(value) else int(min(max(value, -2**31), 2**31 - 1))
            y[min(int(u * y.size), y.size - 1)] = np.array(value).astype(y.dtype) if np.isfinite(value) else value
            f[field] = y.reshape(x.shape)
    return f


def test_fuzzed_groups_through_the_hub_never_stop_a_learner_step_and_no_refused_group_is_trained():
    """>= 500 groups with random fields missing, retyped or reshaped, NaN / inf / huge values at
    any position, rows and widths off by one, through `Hub.put_group`: the hub answers each one
    with acceptance or a `wire.Rejected` (never an internal error), refused groups never reach
    the queue, and every batch of accepted groups trains one real learner step with finite
    metrics and no skipped update."""
    from hypothesis import example, given, settings
    from hypothesis import strategies as st

    from jaxrl_llm.learner import learner as L
    from jaxrl_llm.parallel import sharding
    from jaxrl_llm.batch import TrajectoryBatch
    from jaxrl_llm.remote.mode import _widen

    hub, task = _hub(verify_fraction=0.0)
    mcfg, new = hub.producer.sampler.model_cfg, hub.producer.sampler.cfg.max_new_tokens
    c = L.default_config()
    c.num_minibatches, c.packing = 1, "off"
    lrn = L.Learner(mcfg, {"name": "ppo"}, c, mesh=sharding.make_mesh(devices=jax.devices()[:1]))
    state = [lrn.init(jax.random.key(0))]
    from jaxrl_llm.remote.throttle import Buckets

    hub.hellos = Buckets(10**6, 1.0)  # a node refused for an oversized group comes back as a new one
    hi = {"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__}
    me = hub.hello({**hi, "name": "fuzz"})
    node = [{k: me[k] for k in ("run_id", "node", "session")}]
    weights = _weights(hub, node[0])
    seen = {"accepted": 0, "refused": 0, "steps": 0, "nodes_refused": 0}
    fields = sorted(wire.GROUP_FIELDS)
    mutation = st.tuples(st.sampled_from(fields), st.sampled_from(["drop", "dtype", "rows", "width", "extra",
                                                                   *_POISON]),
                         st.floats(0, 1), st.floats(0, 1))

    @settings(max_examples=500, deadline=None, derandomize=True, database=None)
    @given(st.lists(mutation, max_size=3), st.floats(0, 1))
    @example([("tokens", "width", 0.0, 0.9)], 0.5)  # rows wider than the run's: its node is refused for good
    def one(mutations, reward):
        s = node[0]
        lease = hub.lease({**s, "version": 3})["leases"][0]
        prompt = hub.producer.prompts(1, lease["draw"])[lease["groups"][0]]
        f = _group(rows=2, p=hub.max_width - new, new=new, k=0, prompt=prompt, vocab=task.vocab_size, kept=False)
        f["versions"] = np.where(f["loss_mask"] > 0, 3, -1).astype(np.int32)
        f["rewards"] = np.float32([reward, 1 - reward])
        queued = len(hub.queue)
        try:
            hub.put_group({**s, "lease": lease["id"], "group": lease["groups"][0], "weights": weights,
                           "table": _table(_mutate(f, mutations))})
            seen["accepted"] += 1
        except wire.Rejected as e:
            assert "internal error" not in str(e), (mutations, e)
            assert len(hub.queue) == queued
            seen["refused"] += 1
        if hub.nodes[s["node"]].refused:  # an oversized group: no honest node sends one
            seen["nodes_refused"] += 1
            me = hub.hello({**hi, "name": f"fuzz{seen['nodes_refused']}"})  # its name stays refused
            node[0] = {k: me[k] for k in ("run_id", "node", "session")}
            return
        hub.release(s)
        if len(hub.queue) == 2:
            got = []
            for _ in range(2):
                item = hub.queue.get(3)[0]
                hub.made_by.pop((item.origin.draw, *item.origin.groups))  # trained: out of the node's room
                got.append(item.batch)
            width = max(b.shape[1] for b in got)
            batch = TrajectoryBatch.concat([_widen(b, width, 0) for b in got])
            state[0], m = lrn.train_step(state[0], hub.producer.with_rewards(batch, np.asarray(batch.rewards)))
            m = jax.device_get(m)
            assert m["skipped_updates"] == 0 and all(np.isfinite(v).all() for v in jax.tree_util.tree_leaves(m)), m
            seen["steps"] += 1

    one()
    assert seen["accepted"] + seen["refused"] >= 500 and seen["refused"] >= 250 and seen["steps"] >= 20, seen
    assert seen["nodes_refused"] > 0 and hub.leases.pending_groups() == 0, seen  # their leases went back


def test_dynamic_sampling_consumes_a_group_whose_rewards_are_all_equal():
    """`runtime.dynamic_sampling` in the remote mode: the hub's gate keeps a group whose rewards
    differ and hands one whose rewards are all equal to the data position as consumed."""
    from jaxrl_llm.runtime import dynamic

    hub, task = _hub(verify_fraction=0.0)
    consumed = []
    hub.gate, hub.consumed = dynamic.Gate(2, 0.0, limit=8), consumed.append
    me = hub.hello({"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__, "name": "n"})
    s = {k: me[k] for k in ("run_id", "node", "session")}
    weights = _weights(hub, s)
    got = []
    for rewards in ([0.0, 0.0], [1.0, 0.0]):
        lease = hub.lease({**s, "version": 3})["leases"][0]
        prompt = hub.producer.draw(1, lease["draw"])[0][lease["groups"][0]]
        f = _group(rows=2, p=len(prompt) + 1, new=4, k=0, prompt=prompt, vocab=task.vocab_size, kept=False)
        f["versions"] = np.where(f["loss_mask"] > 0, 3, -1).astype(np.int32)
        f["rewards"] = np.asarray(rewards, np.float32)
        got.append(hub.put_group({**s, "lease": lease["id"], "group": lease["groups"][0], "weights": weights,
                                  "table": wire.encode_group(wire.group_batch(f))}))
        got.append((lease["draw"], lease["groups"][0]))
    assert got[0] == {"accepted": True, "dropped": True} and got[2] == {"accepted": True}
    assert consumed == [(0, *got[1][:1], (got[1][1],))] and len(hub.queue) == 1
    assert (hub.gate.seen, hub.gate.dropped) == (2, 1)


def test_a_mixture_of_experts_groups_experts_are_checked_and_queued():
    """A run whose samplers record routing: a node's group carries its experts to the learner's
    queue (for replay); a group with a forged expert id, or without routing, is refused and its
    group leased again."""
    hub, task = _hub(experts=4)
    assert hub.routing == (1, 2, 4)
    me = hub.hello({"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__, "name": "n"})
    s = {k: me[k] for k in ("run_id", "node", "session")}
    weights = _weights(hub, s)

    def put(k, routing):
        prompt = hub.producer.draw(1, lease["draw"])[0][k]
        f = _group(rows=2, p=len(prompt) + 1, new=4, k=0, prompt=prompt, vocab=task.vocab_size, kept=False)
        f["versions"] = np.where(f["loss_mask"] > 0, 3, -1).astype(np.int32)
        f["rewards"] = np.float32([task.reward(prompt, t[m > 0].tolist()) for t, m in zip(f["tokens"], f["loss_mask"])])
        if routing is not None:
            f["routing"] = routing(f["tokens"].shape)
        return hub.put_group({**s, "lease": lease["id"], "group": k, "weights": weights,
                              "table": wire.encode_group(wire.group_batch(f))}), f

    honest = lambda shape: np.broadcast_to(np.int16([[[0, 3]]]), shape + (1, 2)).copy()  # noqa: E731
    lease = hub.lease({**s, "version": 3})["leases"][0]
    for why, routing in (("expert ids outside", lambda shape: honest(shape) + 1), ("routing missing", None)):
        with pytest.raises(wire.Rejected, match=why):
            put(0, routing)
        lease = hub.lease({**s, "version": 3})["leases"][0]  # leased again at once
    out, f = put(0, honest)
    assert out == {"accepted": True}
    np.testing.assert_array_equal(hub.queue.get(3)[0].batch.routing, f["routing"])
    assert hub.refusals == {"malformed": 2}


def test_agents_groups_keep_their_own_prompt_and_reward_and_everything_else_is_checked():
    """`task.name=agent` on the nodes: a row starts with what its agent sent and carries the
    agent's reward, so neither is compared with the learner's (with every group drawn for
    verification); ids, versions, the reward range and the weights are checked as for any
    group. The same group for the task itself is refused: it does not answer the leased prompt."""
    import types

    from jaxrl_llm.gateway.agents import AgentTask
    from jaxrl_llm.tasks.arithmetic import Arithmetic

    for agents in (True, False):
        task = AgentTask(Arithmetic(), "", types.SimpleNamespace(external=True)) if agents else None
        hub, task = _hub(task=task)
        me = hub.hello({"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__, "name": "n"})
        s = {k: me[k] for k in ("run_id", "node", "session")}
        weights = _weights(hub, s)

        def group(**change):
            lease = hub.lease({**s, "version": 3})["leases"][0]
            f = _group(rows=2, p=hub.producer.prompt_width, new=4, k=0, prompt=(1, 5, 6, 7, 8, 9),
                       vocab=task.vocab_size, kept=False)
            f["versions"] = np.where(f["loss_mask"] > 0, 3, -1).astype(np.int32)
            f["rewards"] = np.asarray([1.0, 1.0], np.float32)  # whatever the task would say
            for name, fix in change.items():
                f[name] = fix(f[name])
            return hub.put_group({**s, "lease": lease["id"], "group": 0, "weights": weights,
                                  "table": wire.encode_group(wire.group_batch(f))})

        if not agents:
            with pytest.raises(wire.Rejected, match="do not answer the leased prompt"):
                group()
            continue
        assert group() == {"accepted": True} and hub.refusals["reward"] == 0
        with pytest.raises(wire.Rejected, match="rewards span"):
            group(rewards=lambda r: r + 5)
        with pytest.raises(wire.Rejected, match="outside the vocabulary"):
            group(tokens=lambda t: t + task.vocab_size)
        with pytest.raises(wire.Rejected, match="token versions span"):
            group(versions=lambda v: v + 1)
        assert len(hub.queue) == 1


def test_heartbeats_carry_the_nodes_episode_counts_checked_field_by_field():
    """A node's heartbeat adds what its episodes (multi-turn, agents) added since its last beat
    to the learner's episode totals (the run's `episode/*` metrics); a malformed field is refused
    naming it, and a busy share outside [0, 1] is clipped."""
    from jaxrl_llm.tasks import envs

    hub, _ = _hub()
    me = hub.hello({"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__, "name": "n"})
    s = {k: me[k] for k in ("run_id", "node", "session")}
    delta = np.arange(len(envs.TOTALS), dtype=np.float64)
    for _ in range(2):
        hub.heartbeat({**s, "version": 3, "busy": 7.0, "episodes": delta.tolist()})
    np.testing.assert_array_equal(hub.producer.episode_totals(), 2 * delta)
    assert hub.nodes[me["node"]].busy == 1.0
    hub.heartbeat({**s, "version": 3, "busy": 0.5})  # a single-turn task's node sends none
    for bad in (delta[:-1].tolist(), [float("nan")] * len(delta), (-delta).tolist(), [1e12] * len(delta), "x"):
        with pytest.raises(wire.Rejected, match="heartbeat: episodes must be"):
            hub.heartbeat({**s, "version": 3, "busy": 0.5, "episodes": bad})
    with pytest.raises(wire.Rejected, match="heartbeat: version must be an integer"):
        hub.heartbeat({**s, "version": "three"})
    np.testing.assert_array_equal(hub.producer.episode_totals(), 2 * delta)


def test_heartbeats_carry_the_nodes_gateway_counters_and_latencies():
    """An agent node's beat adds its gateway's counter increments and request latencies to the
    run's `gateway/*` (summed over nodes; percentiles over every node's requests since the last
    step); a malformed report is refused naming the field and adds nothing."""
    from jaxrl_llm.gateway import tally

    hub, _ = _hub()
    assert not any(k.startswith("gateway/") for k in hub.metrics())  # no agent node: no gateway metrics
    s = [{k: me[k] for k in ("run_id", "node", "session")} for me in (
        hub.hello({"protocol": wire.PROTOCOL, "package": __import__("jaxrl_llm").__version__, "name": n})
        for n in ("a", "b"))]
    counts = np.arange(1, len(tally.COUNTS) + 1, dtype=np.float64)
    hub.heartbeat({**s[0], "version": 0, "gateway": {"counts": counts.tolist(), "ms": [10.0, 20.0, 30.0]}})
    hub.heartbeat({**s[1], "version": 0, "gateway": {"counts": (2 * counts).tolist(), "ms": [40.0]}})
    m = hub.metrics()
    assert [m[f"gateway/{k}"] for k in tally.COUNTS] == (3 * counts).tolist()
    assert m["gateway/slot_occupancy"] == counts[-2] / counts[-1]  # every node's slots: their tokens / capacity
    assert m["gateway/request_p50_ms"] == 25.0 and m["gateway/request_p99_ms"] == np.percentile([10, 20, 30, 40], 99)
    hub.heartbeat({**s[0], "version": 0, "gateway": {"counts": [0.0] * len(counts), "ms": []}})
    m = hub.metrics()  # latencies are the step's, counters the run's so far
    assert "gateway/request_p50_ms" not in m and m["gateway/sessions_opened"] == 3.0
    ok = {"counts": counts.tolist(), "ms": [1.0]}
    for bad, field in [({"counts": counts.tolist()}, "must be"), ([1.0], "must be"),
                       ({**ok, "extra": 1}, "must be"), ({**ok, "counts": counts[:-1].tolist()}, "counts"),
                       ({**ok, "counts": (-counts).tolist()}, "counts"),
                       ({**ok, "counts": ["x"] * len(counts)}, "counts"),
                       ({**ok, "ms": [float("nan")]}, "ms"), ({**ok, "ms": [-1.0]}, "ms"), ({**ok, "ms": "1"}, "ms"),
                       ({**ok, "ms": [1.0] * (tally.MAX_LATENCIES + 1)}, "ms")]:
        with pytest.raises(wire.Rejected, match=f"heartbeat: gateway.*{field}"):
            hub.heartbeat({**s[0], "version": 0, "gateway": bad})
    assert hub.metrics()["gateway/sessions_opened"] == 3.0
