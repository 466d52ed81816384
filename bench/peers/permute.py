"""permute and unpermute_reduce peers, in torch (same output contract as tessera: expert-grouped rows + offsets +
row index; fp8 e4m3 with per-128-column scales or one per-tensor scale; bf16 weighted sum with fp32 accumulation).

  permute    stable argsort of the flattened ids + index_select (+ a torch fp8 quantization, block-wise or per-tensor)
  unpermute  gather + weighted sum (fp32), and index_add_ (fp32); + residual for the /residual cases

Cases: tessera-bench's (bench/moe_cases.cpp): permute 'T<T>/k<k>/E<E>/H<H>/bf16/<none|fp8block|fp8tensor>',
unpermute_reduce 'T<T>/k<k>/H<H>/bf16[/residual]' (E = 256). Ids: k distinct experts per token, roughly uniform.
"""

import re

from . import common as C
from .common import Case, Row

PERMUTE, UNPERMUTE = "permute", "unpermute_reduce"
_PERMUTE_NAME = re.compile(r"^T(\d+)/k(\d+)/E(\d+)/H(\d+)/(bf16|fp16)/(none|fp8block|fp8tensor)$")
_UNPERMUTE_NAME = re.compile(r"^T(\d+)/k(\d+)/H(\d+)/(bf16|fp16)(/residual)?$")
_QUANT = {"none": None, "fp8block": "fp8_blockwise", "fp8tensor": "fp8_per_tensor"}


def registry(op):
    if op == PERMUTE:
        names = [f"T4096/k8/E256/H7168/bf16/{q}" for q in ("none", "fp8block", "fp8tensor")]
        names += ["T128/k8/E256/H7168/bf16/none", "T16384/k8/E256/H7168/bf16/none"]
    else:
        names = ["T4096/k8/H7168/bf16", "T4096/k8/H7168/bf16/residual", "T128/k8/H7168/bf16"]
    return [(op, n) for n in names]


def parse(op, name):
    if op == PERMUTE:
        m = _PERMUTE_NAME.match(name)
        if not m:
            return None
        return dict(T=int(m.group(1)), k=int(m.group(2)), E=int(m.group(3)), H=int(m.group(4)), dtype=m.group(5),
                    quant=_QUANT[m.group(6)])
    if op == UNPERMUTE:
        m = _UNPERMUTE_NAME.match(name)
        if not m:
            return None
        return dict(T=int(m.group(1)), k=int(m.group(2)), E=256, H=int(m.group(3)), dtype=m.group(4),
                    residual=bool(m.group(5)))
    return None


# ---- torch peers ------------------------------------------------------------------------------------------------


def torch_permute(x, ids, num_experts):
    torch = C.torch
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    x_perm = x.index_select(0, order // k)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.index_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
    offsets[1:] = torch.cumsum(counts, 0)
    row_index = torch.empty(T * k, dtype=torch.int32, device=x.device)
    row_index[order] = torch.arange(T * k, dtype=torch.int32, device=x.device)
    return x_perm, offsets, counts, row_index.view(T, k), order // k


def torch_fp8_blockwise(x):
    R, H = x.shape
    blocks = x.float().view(R, H // 128, 128)
    scale = blocks.abs().amax(dim=-1).clamp(min=1e-10) / 448.0
    q = (blocks / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(C.fp8_dtype())
    return q.view(R, H), scale


def torch_permute_quant(x, ids, num_experts, quant, input_scale):
    x_perm, offsets, counts, row_index, row_token = torch_permute(x, ids, num_experts)
    if quant == "fp8_blockwise":
        q, scale = torch_fp8_blockwise(x_perm)
        return q, scale, offsets, counts, row_index, row_token
    if quant == "fp8_per_tensor":
        q = (x_perm.float() / input_scale).clamp(-448.0, 448.0).to(C.fp8_dtype())
        return q, None, offsets, counts, row_index, row_token
    return x_perm, None, offsets, counts, row_index, row_token


def torch_unpermute_gather(y_perm, row_index, weights, routed_scale, residual):
    torch = C.torch
    T, k = row_index.shape
    rows = y_perm.index_select(0, row_index.reshape(-1)).view(T, k, -1)
    out = torch.einsum("tkh,tk->th", rows.float(), weights) * routed_scale
    if residual is not None:
        out = out + residual.float()
    return out.to(y_perm.dtype)


def torch_unpermute_index_add(y_perm, row_token, row_weight, num_tokens, routed_scale, residual):
    torch = C.torch
    if residual is not None:
        out = residual.float().clone()
    else:
        out = torch.zeros((num_tokens, y_perm.shape[1]), dtype=torch.float32, device=y_perm.device)
    out.index_add_(0, row_token, y_perm.float() * row_weight.unsqueeze(1), alpha=routed_scale)
    return out.to(y_perm.dtype)


def routing_inputs(T, k, H, E, dtype, seed):
    torch = C.torch
    g = C.generator(seed)
    x = torch.randn((T, H), device=C.DEVICE, generator=g).to(dtype)
    # k distinct experts per token, roughly uniform load
    ids = torch.rand((T, E), device=C.DEVICE, generator=g).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    return x, ids


# ---- rows -------------------------------------------------------------------------------------------------------


def rows(cases, args):
    def one(group, _):
        case = group[0]
        return [permute_row(case, args) if case.op == PERMUTE else unpermute_row(case, args)]

    return C.guarded_rows([[case] for case in cases], one)


def permute_row(case, args):
    torch = C.torch
    s = case.spec
    T, k, E, H, quant = s["T"], s["k"], s["E"], s["H"], s["quant"]
    dt = torch.bfloat16 if s["dtype"] == "bf16" else torch.float16
    out_elt = 1 if quant else dt.itemsize
    nbytes = (T * H * dt.itemsize + T * k * H * out_elt + (T * k * (H // 128) * 4 if quant == "fp8_blockwise" else 0)
              + T * k * 4 + (2 * E + 1) * 4 + T * k * 8)
    row = Row(case.op, case.name, nbytes)
    sets = C.rotating_sets(T * H * dt.itemsize + T * k * 4)
    inputs = [routing_inputs(T, k, H, E, dt, 7 + st) for st in range(sets)]
    input_scale = torch.full((1,), 4.0 / 448.0, dtype=torch.float32, device=C.DEVICE)
    calls = C.calls_for(nbytes / 3e12 * 1e6, sets, most=20)
    if sets > 1:
        row.notes.append(f"{sets} rotating input sets (L2)")

    def tessera_call(st):
        x, ids = inputs[st]
        return lambda: C.tessera.permute(x, ids, E, quant=quant, input_scale=input_scale if quant == "fp8_per_tensor"
                                         else None, with_row_token=True)

    ran = C.run_tessera_fn(row, lambda: C.rotating([tessera_call(st) for st in range(sets)]), calls, args)
    label = "torch" + ("" if quant is None else " +fp8")
    peer = [lambda st=st: torch_permute_quant(*inputs[st], E, quant, input_scale) for st in range(sets)]
    C.run_peer_fn(row, label, C.rotating(peer), calls, args)
    if ran is not None and row.peers.get(label):
        try:
            res = tessera_call(0)()
            p = peer[0]()
            ok = torch.equal(res.expert_offsets, p[2]) and torch.equal(res.row_index, p[4])
            row.notes.append("offsets / row_index equal to torch's" if ok else "offsets / row_index DIFFER from torch's")
        except Exception as e:  # noqa: BLE001
            row.notes.append(f"check failed: {C.short(e)}")
    return row


def unpermute_row(case, args):
    torch = C.torch
    s = case.spec
    T, k, H, E = s["T"], s["k"], s["H"], s["E"]
    dt = torch.bfloat16 if s["dtype"] == "bf16" else torch.float16
    th = T * H * dt.itemsize
    nbytes = k * th + T * k * 8 + (th if s["residual"] else 0) + th
    row = Row(case.op, case.name, nbytes, 2.0 * k * T * H + (T * H if s["residual"] else 0))
    sets = C.rotating_sets(k * th + T * k * 8 + (th if s["residual"] else 0))
    routed_scale = 2.5
    data = []
    for st in range(sets):
        x, ids = routing_inputs(T, k, H, E, dt, 11 + st)
        y_perm, _, _, row_index, row_token = torch_permute(x, ids, E)  # y_perm: the expert outputs, grouped
        weights = torch.rand((T, k), device=C.DEVICE, generator=C.generator(99 + st))
        row_weight = torch.empty(T * k, device=C.DEVICE)
        row_weight[row_index.reshape(-1).long()] = weights.reshape(-1)
        residual = torch.randn((T, H), device=C.DEVICE, generator=C.generator(5 + st)).to(dt) if s["residual"] else None
        data.append((y_perm, row_index, row_token, weights, row_weight, residual))
        del x, ids
    calls = C.calls_for(nbytes / 3e12 * 1e6, sets, most=20)
    if sets > 1:
        row.notes.append(f"{sets} rotating input sets (L2)")
    out = torch.empty((T, H), dtype=dt, device=C.DEVICE)

    def tessera_call(st):
        y, ri, _, w, _, res = data[st]
        return lambda: C.tessera.unpermute_reduce(y, ri, w, res, routed_scale, out=out)

    ran = C.run_tessera_fn(row, lambda: C.rotating([tessera_call(st) for st in range(sets)]), calls, args)
    got = None
    if ran is not None:
        tessera_call(0)()
        got = out.float().clone()
    peers = {
        "torch gather": [lambda st=st: torch_unpermute_gather(data[st][0], data[st][1], data[st][3], routed_scale,
                                                               data[st][5]) for st in range(sets)],
        "torch index_add_": [lambda st=st: torch_unpermute_index_add(data[st][0], data[st][2], data[st][4], T,
                                                                     routed_scale, data[st][5]) for st in range(sets)],
    }
    for label, fns in peers.items():
        if C.run_peer_fn(row, label, C.rotating(fns), calls, args) and got is not None:
            try:
                row.notes.append(f"{label}: rel. Frobenius difference to tessera {C.rel_error(got, fns[0]()):.2e}")
            except Exception as e:  # noqa: BLE001
                row.notes.append(f"{label}: check failed: {C.short(e)}")
    return row


def cases_from_args(args, op):
    """Standalone runs: the registry, filtered by --tokens (T; 0: all)."""
    out = []
    for o, name in registry(op):
        s = parse(o, name)
        if not args.tokens or s["T"] == args.tokens:
            out.append(Case(o, name, s))
    return out
