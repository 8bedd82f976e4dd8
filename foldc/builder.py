"""Build the decode-attention graph of an AttentionSpec (before any fold decision).

    scores[b, kv, h, n] = sum_c q[b, kv, h, c] * k[b, kv, n, c]      (the "qk" product)
    logits = sm_scale * scores
    p = online_softmax(logits) along token                            (eq. 9)
    pv[b, kv, h, c] = sum_n p[b, kv, h, n] * v[b, kv, n, c]           (the "pv" product, per tile)
    acc = accumulate(pv) over token tiles, rescaled by the softmax
    out = acc / denominator                                           (eq. 10)

GQA: the query heads of one KV head form the ``q_per_kv`` axis (query head
``kv * q_per_kv + j`` reads KV head ``kv``).
"""
from __future__ import annotations

from .ir import (BATCH, CHANNEL, KV_HEAD, Q_PER_KV, TOKEN, Accumulate, Contract, Divide, Graph, Input,
                 MulScalar, OnlineSoftmax, verify)
from .spec import AttentionSpec

QUERY_AXES = (BATCH, KV_HEAD, Q_PER_KV, CHANNEL)
CACHE_AXES = (BATCH, KV_HEAD, TOKEN, CHANNEL)
SCORE_AXES = (BATCH, KV_HEAD, Q_PER_KV, TOKEN)


def build_decode_attention(spec: AttentionSpec) -> Graph:
    """The unfolded decode-attention graph; the passes in foldc.passes decide the folds."""
    g = Graph(f"decode_attention({spec.describe()})",
              sizes={Q_PER_KV: spec.q_per_kv, CHANNEL: spec.head_dim, KV_HEAD: spec.num_kv_heads})
    g.add(Input("q", QUERY_AXES, role="query"))
    g.add(Input("k", CACHE_AXES, role="key", encoding=spec.k))
    g.add(Input("v", CACHE_AXES, role="value", encoding=spec.v))
    g.add(Contract("scores", SCORE_AXES, lhs="q", rhs="k", reduce=CHANNEL, product="qk"))
    g.add(MulScalar("logits", SCORE_AXES, input="scores"))
    g.add(OnlineSoftmax("p", SCORE_AXES, logits="logits"))
    g.add(Contract("pv", QUERY_AXES, lhs="p", rhs="v", reduce=TOKEN, product="pv"))
    g.add(Accumulate("acc", QUERY_AXES, input="pv", softmax="p"))
    g.add(Divide("out", QUERY_AXES, acc="acc", softmax="p"))
    g.output = "out"
    verify(g)
    return g
