"""Plain NumPy (float64) references for every objective, written from the papers.

Each reference is `ref(x, xs, s, cfg) -> loss` where `x` is log pi_theta (the differentiated
input) and `xs` the same values seen through stop_gradient; the test takes the gradient by
central finite differences in x with xs fixed. `s` is a `jaxrl_llm.testing.Synthetic`.
"""

from __future__ import annotations

import numpy as np


def f64(a):
    return np.asarray(a, dtype=np.float64)


def agg(l, m, mode, norm_len=0):
    b, L = l.shape
    if mode == "token_mean":
        return float((l * m).sum() / max(m.sum(), 1.0))
    if mode == "seq_mean_token_sum_norm":
        return float((l * m).sum() / (b * (norm_len or L)))
    if mode == "token_sum_norm":  # verl's seq-mean-token-sum-norm: sum(seq sums) / L
        return float((l * m).sum(-1).sum() / (norm_len or L))
    per_seq = []
    for i in range(b):
        n = m[i].sum()
        if n == 0:
            continue
        total = (l[i] * m[i]).sum()
        per_seq.append(total / n if mode == "seq_mean_token_mean" else total)
    return float(np.mean(per_seq)) if per_seq else 0.0


def clip_loss(r, a, lo, hi, dual=0.0):
    """-min(rA, clip(r, lo, hi)A) [+ dual clip], elementwise."""
    loss = -np.minimum(r * a, np.clip(r, lo, hi) * a)
    if dual > 0:
        loss = np.where(a < 0, np.minimum(loss, -a * dual), loss)
    return loss


def kl(x, ref, est):
    lr = ref - x
    return {"k1": -lr, "k2": 0.5 * lr**2, "k3": np.exp(lr) - 1 - lr}[est]


def F(w, ic):
    if ic.kind == "tis":
        return np.minimum(w, ic.cap)
    if ic.kind == "icepop":
        return np.where((w >= ic.low) & (w <= ic.high), w, 0.0)
    return w


def finish(tok, x, s, cfg, kl_scale=1.0, mask=None, mode=None):
    bt = s.batch
    m = f64(bt.loss_mask) if mask is None else mask
    if cfg.kl.coef > 0:
        tok = tok + cfg.kl.coef * kl(x, f64(bt.ref_logp), cfg.kl.estimator) * kl_scale
    return agg(tok, m, mode or cfg.loss_agg, cfg.loss_agg_norm_len)


def ppo(x, xs, s, cfg):
    bt = s.batch
    r = np.exp(x - f64(bt.behav_logp))
    c = cfg.clip
    return finish(clip_loss(r, f64(bt.advantages), 1 - c.eps_low, 1 + c.eps_high, c.dual_clip), x, s, cfg)


def _decoupled(x, prox, s, cfg):
    bt = s.batch
    raw = np.exp(prox - f64(bt.behav_logp))
    w = F(raw, cfg.is_correction)
    r = np.exp(x - prox)
    c, ic = cfg.clip, cfg.is_correction
    mask = None
    if cfg.loss_agg_rejected == "drop" and ic.kind == "icepop":  # verl: rejected tokens leave the mask
        mask = f64(bt.loss_mask) * ((raw >= ic.low) & (raw <= ic.high))
    return finish(w * clip_loss(r, f64(bt.advantages), 1 - c.eps_low, 1 + c.eps_high, c.dual_clip), x, s, cfg,
                  mask=mask)


def decoupled_ppo(x, xs, s, cfg):
    return _decoupled(x, f64(s.batch.prox_logp), s, cfg)


def a3po_alpha(version, versions):
    """Weight of log pi_behav in log pi_prox: 1/d for d >= 1, 1 (pi_prox = pi_behav) on fresh
    tokens, as the A-3PO paper's prose and AReaL's loglinear approximation agree."""
    alpha = np.ones(versions.shape)
    for idx, v in np.ndenumerate(versions):
        d = version - v
        if v >= 0 and d >= 1:
            alpha[idx] = 1.0 / d
    return alpha


def a3po(x, xs, s, cfg):
    alpha = a3po_alpha(int(s.policy.version), np.asarray(s.batch.versions))
    prox = alpha * f64(s.batch.behav_logp) + (1 - alpha) * xs
    return _decoupled(x, prox, s, cfg)


def _seq_mean(v, m):
    return (v * m).sum(-1) / np.maximum(m.sum(-1), 1)


def gspo(x, xs, s, cfg):
    bt = s.batch
    m, a = f64(bt.loss_mask), f64(bt.advantages)
    lo, hi = 1 - cfg.gspo.eps_low, 1 + cfg.gspo.eps_high
    if cfg.gspo.variant == "seq":
        s_i = np.exp(_seq_mean(x - f64(bt.behav_logp), m))
        tok = clip_loss(s_i, _seq_mean(a, m), lo, hi, cfg.clip.dual_clip)[:, None] * np.ones_like(m)
    else:
        log_si = _seq_mean(xs - f64(bt.behav_logp), m)
        s_it = np.exp(log_si[:, None] + x - xs)
        tok = clip_loss(s_it, a, lo, hi, cfg.clip.dual_clip)
    return finish(tok, x, s, cfg, mode=cfg.gspo.loss_agg)


def gepo_expectation(q, gid, valid):
    """E_q[q] = sum q^2 / sum q per group, over valid members, by explicit loops."""
    out = np.zeros_like(q)
    for i in range(len(q)):
        members = [j for j in range(len(q)) if gid[j] == gid[i] and valid[j]]
        qs = np.array([q[j] for j in members])
        out[i] = (qs**2).sum() / qs.sum()
    return out


def gepo(x, xs, s, cfg):
    bt = s.batch
    m, gid = f64(bt.loss_mask), np.asarray(bt.group_ids)
    valid = m.sum(-1) > 0
    p = np.exp(_seq_mean(x, m))
    p_sg = np.exp(_seq_mean(xs, m))
    q = np.exp(_seq_mean(f64(bt.behav_logp), m))
    eq = gepo_expectation(q, gid, valid)
    g = cfg.gepo
    if g.eps_mode == "const":
        eps = np.full_like(p, g.eps)
    else:
        eps = np.zeros_like(p)
        for i in range(len(p)):
            members = [j for j in range(len(p)) if gid[j] == gid[i] and valid[j]]
            eps[i] = min(max(g.eps_var_coef * np.var(q[members]), 0.0), g.eps_max)
    w = p / (eps * p_sg + (1 - eps) * eq)
    c = cfg.clip
    l_i = clip_loss(w, _seq_mean(f64(bt.advantages), m), 1 - c.eps_low, 1 + c.eps_high, c.dual_clip)
    return finish(l_i[:, None] * np.ones_like(m), x, s, cfg)


def zero_variance_keep(rewards, gid):
    keep = np.ones(len(rewards))
    for i in range(len(rewards)):
        rs = [rewards[j] for j in range(len(rewards)) if gid[j] == gid[i]]
        keep[i] = float(max(rs) - min(rs) > 1e-6)
    return keep


def offpolicy_grpo(x, xs, s, cfg):
    bt = s.batch
    alpha = f64(bt.behav_logp)
    r = np.exp(x - alpha)
    o = cfg.offpolicy_grpo
    rp = np.exp(f64(bt.prox_logp) - alpha) if o.r_prime == "prox" else np.ones_like(r)
    a = f64(bt.advantages)
    lo, hi = np.maximum(rp - cfg.clip.eps_low, 0.0), rp + cfg.clip.eps_high
    f = np.minimum(r * a, np.clip(r, lo, hi) * a)  # Revisiting GRPO's f_eps(r, r', A)
    keep = zero_variance_keep(np.asarray(bt.rewards), np.asarray(bt.group_ids)) if o.zero_var_mask else np.ones(r.shape[0])
    return finish(-f * keep[:, None], x, s, cfg, kl_scale=keep[:, None])


def jackpot_parts(xs, s, cfg, u):
    """Acceptance, Z_approx (set-based union), kappa, rho from full distributions."""
    bt, pol, jc = s.batch, s.policy, cfg.jackpot
    m = f64(bt.loss_mask)
    inf = f64(bt.behav_logp)
    ref = f64(bt.prox_logp) if jc.p_ref == "prox" else xs
    tgt = xs if jc.p_target == "new" else ref
    if jc.correction != "obrs":  # the paper's baselines: every token kept, rho = 1 or TIS
        rho = np.ones_like(m) if jc.correction == "none" else np.minimum(np.exp(ref - inf), jc.c1)
        return np.ones_like(m), None, None, rho, ref
    accepted = (u < np.minimum(1.0, np.exp(tgt) / (jc.lam * np.exp(inf)))).astype(np.float64)
    b, L = m.shape
    z = np.zeros((b, L))
    full_tgt = s.policy_logp_BxLxV if jc.p_target == "new" else s.prox_logp_BxLxV
    inf_ids, pol_ids = np.asarray(bt.topk_ids), np.asarray(pol.topk_ids)
    for i in range(b):
        for t in range(L):
            support = set(inf_ids[i, t].tolist())
            if jc.p_target == "new":
                support |= set(pol_ids[i, t].tolist())
            z[i, t] = sum(min(np.exp(s.behav_logp_BxLxV[i, t, v]), np.exp(full_tgt[i, t, v]) / jc.lam) for v in support)
    acc_rate = (accepted * m).sum() / m.sum()
    kappa = acc_rate / ((z * m).sum() / m.sum())
    w = kappa * z * np.maximum(jc.lam, np.exp(tgt - inf))
    rho = np.minimum(w, jc.c1) * np.minimum(np.exp(ref - tgt), jc.c2)
    return accepted, z, kappa, rho, ref


def jackpot(x, xs, s, cfg, u):
    accepted, _, _, rho, ref = jackpot_parts(xs, s, cfg, u)
    c = cfg.clip
    r = np.exp(x - ref)
    tok = accepted * rho * clip_loss(r, f64(s.batch.advantages), 1 - c.eps_low, 1 + c.eps_high, c.dual_clip)
    return finish(tok, x, s, cfg)


def m2po_keep(behav, prox, mask, tau):
    """AReaL's rule, written as a loop: sort the loss tokens' (log prox - log behav)^2 in
    descending order, drop the first k where k is the first index whose suffix mean is below
    tau (all but one when none is); 1 on kept loss tokens."""
    idx = np.argwhere(mask > 0)
    m2 = np.array([(prox[i, j] - behav[i, j]) ** 2 for i, j in idx])
    order = np.argsort(-m2, kind="stable")
    k = len(m2) - 1
    for i in range(len(m2)):
        if m2[order[i:]].mean() < tau:
            k = i
            break
    keep = np.zeros(mask.shape)
    for rank, t in enumerate(order):
        if rank >= k:
            keep[tuple(idx[t])] = 1.0
    return keep


def m2po(x, xs, s, cfg):
    bt = s.batch
    behav, prox, m = f64(bt.behav_logp), f64(bt.prox_logp), f64(bt.loss_mask)
    keep = m2po_keep(behav, prox, m, cfg.m2po.tau)
    w = F(np.exp(prox - behav), cfg.is_correction)
    r, a = np.exp(x - prox), f64(bt.advantages)
    c = cfg.clip
    surr = clip_loss(r, a, 1 - c.eps_low, 1 + c.eps_high, c.dual_clip) if cfg.m2po.clip else -r * a
    mask = m * keep if cfg.loss_agg_rejected == "drop" else m
    return finish(w * surr * keep, x, s, cfg, kl_scale=keep, mask=mask)


def cispo(x, xs, s, cfg):
    bt = s.batch
    w = np.clip(np.exp(xs - f64(bt.behav_logp)), 1 - cfg.cispo.eps_low, 1 + cfg.cispo.eps_high)  # a constant
    return finish(-w * f64(bt.advantages) * x, x, s, cfg)


def fd_grad(fn, x0, h=1e-6):
    g = np.zeros_like(x0)
    for idx in np.ndindex(*x0.shape):
        e = np.zeros_like(x0)
        e[idx] = h
        g[idx] = (fn(x0 + e) - fn(x0 - e)) / (2 * h)
    return g
