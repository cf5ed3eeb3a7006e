"""Recognise Mixture-of-Experts blocks from what the graph computes.

An MoE block is: a projection of the hidden state to one logit per expert (the router), a top-k over
those scores, and expert weights that come as E-way stacks (3-D parameters) or E identical sub-MLPs, whose
outputs are combined with the routing weights. Router details are read off the ops between the router
projection and the expert computation: which of softmax / sigmoid, before or after top-k; a second top-k
over groups (group-limited routing); a 1-D per-expert term added only for selection (bias correction); a
sum-and-divide of the chosen weights (renormalisation); a constant multiplier (routed scaling factor).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from onboard.inspect.graph import GraphView, common_prefix, op_name, parent
from onboard.inspect.spec import Router

ACTIVATIONS = ("silu", "gelu", "relu", "sigmoid", "tanh", "elu", "leaky_relu", "mish", "hardswish", "relu6")


@dataclass
class ExpertGroup:
    path: str  # module that holds the expert weights
    num_experts: int
    layout: str  # "fused" | "modules"
    params: dict[str, tuple] = field(default_factory=dict)  # path -> (E, rows, cols) as the experts read it
    flat: set[str] = field(default_factory=set)  # stacks stored (E·rows, cols) and viewed per expert (DBRX)


@dataclass
class MoEMatch:
    path: str
    experts: ExpertGroup
    router: Router
    router_weight: str
    top_k: int
    activation: str | None
    gated: bool | None
    shared_paths: list[str]
    shared_gate: bool
    aux_params: list[str] = field(default_factory=list)  # params of the block that are neither experts nor shared
    expert_weights: dict[str, str] = field(default_factory=dict)  # role -> parameter path
    interleaved: bool = False
    weight_on_input: bool = False
    shared_gate_weight: str | None = None
    post_norm: str | None = None  # a norm module applied to the block's output
    output_bias: str | None = None  # a hidden-size vector added to the combined expert output
    flat: dict[str, str] = field(default_factory=dict)  # role -> "out_in" | "in_out", for flat stacks


def expert_groups(view: GraphView) -> list[ExpertGroup]:
    """E-way expert weight stacks: modules with 3-D parameters, or lists of identical sub-modules."""
    groups: dict[str, ExpertGroup] = {}
    shapes = view.param_shapes
    conv_weights = {view.param(a) for n in view.ops(view.under(""), "conv1d", "convolution", "conv2d")
                    for a in view.inputs(n)}
    for path, shape in shapes.items():
        if shape is None or len(shape) != 3 or path in conv_weights or shape[0] < 2:
            continue
        owner = parent(path)
        group = groups.setdefault(owner, ExpertGroup(owner, shape[0], "fused"))
        group.params[path] = shape
        # some models allocate extra rows for "zero" (identity) experts in one of the stacks
        group.num_experts = min(group.num_experts, shape[0])
    for path, viewed in _viewed_stacks(view).items():
        if path in conv_weights:
            continue
        owner = parent(path)
        group = groups.setdefault(owner, ExpertGroup(owner, viewed[0], "fused"))
        group.params[path] = viewed
        group.flat.add(path)
        group.num_experts = min(group.num_experts, viewed[0])
    # stacks split over sibling modules (JetMoE: input_linear.weight and output_linear.weight) form one group
    by_parent: dict[tuple[str, int], list[ExpertGroup]] = {}
    for group in groups.values():
        by_parent.setdefault((parent(group.path), group.num_experts), []).append(group)
    for (owner, experts), siblings in by_parent.items():
        if len(siblings) > 1 and owner and all(len(g.params) == 1 for g in siblings):
            merged = ExpertGroup(owner, experts, "fused")
            for g in siblings:
                merged.params.update(g.params)
                del groups[g.path]
            groups[owner] = merged
    # one sub-module per expert: "<owner>.<i>.<rest>" with the same parameter shapes for every i
    numbered: dict[str, dict[int, dict[str, tuple]]] = {}
    for path, shape in shapes.items():
        m = re.match(r"^(.*?)\.(\d+)\.(.+)$", path)
        if m and shape is not None:
            numbered.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = shape
    for owner, members in numbered.items():
        if len(members) < 2 or owner in groups:
            continue
        layouts = {tuple(sorted(v.items())) for v in members.values()}
        if len(layouts) == 1 and any(len(s) == 2 for s in next(iter(members.values())).values()):
            params = {f"{owner}.{i}.{k}": s for i, v in members.items() for k, s in v.items()}
            groups[owner] = ExpertGroup(owner, len(members), "modules", params)
    return list(groups.values())


VIEWS = ("view", "reshape", "_unsafe_view", "unflatten", "_reshape_alias")


PICKS = ("getitem", "select", "index", "index_select")


def _viewed_stacks(view: GraphView) -> dict[str, tuple]:
    """2-D parameters the forward views as E-way stacks, (E·rows, cols) read as (E, rows, cols), and then picks
    from, one expert's matrix at a time (DBRX keeps its experts' matrices flat): path -> the viewed shape. A view
    used whole (a grouped projection every token goes through, as DeepSeek-V4's o_a_proj) is no stack of experts."""
    out = {}
    for n in view.nodes:
        if op_name(n) not in VIEWS or not n.args or getattr(n.args[0], "op", None) != "placeholder":
            continue
        path = view.param_of.get(n.args[0].name)
        stored, viewed = view.param_shapes.get(path) if path else None, view.shape(n)
        if (stored and viewed and len(stored) == 2 and len(viewed) == 3 and viewed[0] >= 2 and viewed[1] > 1
                and viewed[0] * viewed[1] == stored[0] and viewed[2] == stored[1]
                and n.users and all(op_name(u) in PICKS for u in n.users)):
            out[path] = viewed
    return out


TRANSPOSES = ("t", "T", "mT", "transpose")


def _reads_out_in(view: GraphView, param: str) -> bool | None:
    """Whether the first product that reads `param` takes it as (out, in), the layout of nn.Linear: a linear of it,
    or a matmul of its transpose; None when no product reads it. Followed through views, indexing and transposes
    (a permute counts as one when it swaps the last two dims)."""
    frontier = [(n, 0) for n in view.nodes if n.op == "placeholder" and view.param_of.get(n.name) == param]
    seen = set()
    while frontier:
        node, flips = frontier.pop(0)
        for user in sorted(node.users, key=lambda u: view.index[u]):
            if user in seen:
                continue
            seen.add(user)
            name = op_name(user)
            if name == "linear":
                return flips % 2 == 0
            if name in ("matmul", "mm", "bmm"):
                second = len(user.args) > 1 and user.args[1] is node
                return (flips % 2 == 1) if second else (flips % 2 == 0)
            if name in TRANSPOSES or (name == "permute" and _swaps_last_two(user)):
                frontier.append((user, flips + 1))
            elif name in TRANSPARENT_MOVES:
                frontier.append((user, flips))
    return None


TRANSPARENT_MOVES = ("view", "reshape", "_unsafe_view", "unflatten", "getitem", "select", "index", "contiguous",
                     "to", "clone", "_reshape_alias", "alias", "detach", "float", "type_as")


def _swaps_last_two(node) -> bool:
    dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
    dims = list(dims)
    n = len(dims)
    return n >= 2 and dims[:-2] == list(range(n - 2)) and [d % n for d in dims[-2:]] == [n - 1, n - 2]


def _downstream_of(view: GraphView, params: set[str]) -> set:
    """Every node computed from these parameters."""
    return view.descendants([n for n in view.nodes if n.op == "placeholder" and view.param_of.get(n.name) in params])


def _feeds_experts(view: GraphView, start, downstream: set) -> bool:
    """True when this choice reaches the expert computation directly: the expert weights themselves
    (dispatch) or anything computed from them (combine, as in dense "compute all, mask after" MoEs).
    The search stops at any other projection, so a top-k inside attention (which reaches the experts
    only through the attention output projection and the residual stream) does not count."""
    seen, frontier = set(), [start]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user in downstream:
                return True
            if view.linear_weight(user) is not None:
                continue
            frontier.append(user)
    return False


def _router_linear(view: GraphView, topk, num_experts: int):
    """The projection to one logit per expert that feeds this top-k."""
    best = None
    for node in view.ancestors(topk):
        weight = view.linear_weight(node)
        if weight is None:
            continue
        shape = view.param_shapes[weight]
        if shape[0] >= num_experts:  # zero / null experts may widen it
            if best is None or view.index[node] > view.index[best[0]]:
                best = (node, weight)
    return best


def find_activation(view: GraphView, nodes) -> tuple[str | None, bool | None]:
    """The activation of an MLP and whether it is gated: act(x W_gate) multiplied by a second projection
    x W_up before the output projection (a square of the activation, as in relu^2, is not a gate)."""
    acts = [n for n in nodes if op_name(n) in ACTIVATIONS]
    if not acts:
        return None, None
    act = acts[0]
    name = op_name(act)
    if name == "gelu" and act.kwargs.get("approximate", "none") == "tanh":
        name = "gelu_tanh"
    if name == "sigmoid":  # x * sigmoid(a x): SiLU-like gating written by hand (e.g. clamped SwiGLU)
        name = "swiglu_sigmoid"
    after = view.descendants(act)
    projections = [n for n in nodes if _is_projection(view, n)]
    out_proj = next((p for p in sorted(projections, key=lambda n: view.index[n]) if p in after), None)
    before_out = view.ancestors(out_proj) if out_proj is not None else set(nodes)
    act_inputs = view.ancestors(act)
    gated = False
    for u in after & before_out:
        if op_name(u) != "mul":
            continue
        for i in view.inputs(u):
            if i is act or i in after:
                continue
            # the other factor comes from a projection of the input, not from the activation's own branch
            if any(_is_projection(view, a) for a in view.ancestors(i) | {i}) and i not in act_inputs:
                gated = True
    return name, gated


def _is_projection(view: GraphView, node) -> bool:
    if view.linear_weight(node) is not None:
        return True
    return op_name(node) in ("grouped_mm", "_grouped_mm", "grouped_mm_fallback", "bmm", "mm", "linear") and any(
        len(view.param_shapes.get(view.param(a)) or ()) == 3 for a in view.inputs(node))


SELECTIONS = ("topk", "max", "argmax")


def _selection_k(view: GraphView, node) -> int | None:
    """How many experts a selection op picks per token: k for top-k, 1 for an arg-max along a dim."""
    if op_name(node) == "topk":
        return view.topk_k(node)
    if len(node.args) > 1 or "dim" in node.kwargs:
        return 1
    return None  # a global max, not a per-token choice


def match_moe(view: GraphView) -> list[MoEMatch]:
    layer_nodes = view.under("")
    selections = [n for n in layer_nodes if op_name(n) in SELECTIONS and _selection_k(view, n)]
    matches = []
    unrouted = []
    claimed: set = set()
    # largest stacks first: a selection picks among the biggest set of experts it reaches; a smaller stack
    # reached only through choices already claimed is computed for every token (shared experts)
    for group in sorted(expert_groups(view), key=lambda g: -g.num_experts):
        E = group.num_experts
        downstream = _downstream_of(view, set(group.params))
        # choices made over (at least) the E experts whose results reach the expert weights; a top-k over
        # groups of experts is narrower than E and only shapes which experts stay eligible
        feeding = [n for n in selections if (view.shape(view.inputs(n)[0]) or (0,))[-1] >= E
                   and n not in claimed and _feeds_experts(view, n, downstream)]
        claimed.update(feeding)
        if not feeding:
            unrouted.append(group)
            continue
        topks = [n for n in feeding if op_name(n) == "topk"]
        final = max(topks or feeding, key=lambda n: view.index[n])
        found = _router_linear(view, final, E)
        if found is None:
            continue
        router_node, router_weight = found
        # one top-k picks all k experts; arg-max rounds (sparse mixers) pick one expert each
        k = view.topk_k(final) if topks else len(feeding)
        block = common_prefix([parent(router_weight), group.path])
        router = _read_router(view, router_node, router_weight, final, E, block, set(group.params))
        activation, gated = find_activation(view, view.under(group.path))
        if gated is None:
            gated = any("gate" in p for p in group.params)
        shared, shared_gate = _shared(view, block, group.path, parent(router_weight))
        aux = [p for p in view.params_under(block) if not p.startswith(group.path + ".")
               and not any(p.startswith(s + ".") for s in shared)]
        match = MoEMatch(block, group, router, router_weight, k, activation, gated, shared, bool(shared_gate), aux)
        match.shared_gate_weight = shared_gate
        if group.layout == "fused":
            match.expert_weights = _expert_roles(view, group)
            match.interleaved = _interleaved(view, group)
            match.flat = {role: "out_in" if _reads_out_in(view, p) else "in_out"
                          for role, p in match.expert_weights.items() if p in group.flat}
        match.weight_on_input = _weight_on_input(view, final, group)
        if not topks:  # experts picked by rounds of arg-max (sparse mixer): its own weighting scheme
            router.order = "argmax_rounds"
        post_scale = _output_scaling(view, block, downstream, shared)
        if post_scale is not None:  # scaling the combined output equals scaling every routing weight
            router.scaling = (router.scaling or 1.0) * post_scale
        match.post_norm = _post_norm(view, block, group.path, parent(router_weight), shared, downstream)
        match.output_bias = _output_bias(view, block, downstream)
        router.logit_width = view.param_shapes[router_weight][0]
        router.direct = _reads_block_input(view, router_node, block)
        matches.append(match)
    for group in unrouted:
        owner = next((m for m in matches if group.path.startswith(m.path + ".") or not m.path), None)
        if owner is not None:  # stacked weights that every token goes through: shared experts
            owner.shared_paths = sorted({*owner.shared_paths, group.path})
        elif not matches and (static := _static_moe(view, group)) is not None:
            matches.append(static)
    return matches


def _first_use(view: GraphView, param: str) -> int:
    uses = [view.index[n] for n in view.nodes if n.op == "call_function"
            and any(view.param(a) == param for a in view.inputs(n))]
    return min(uses) if uses else len(view.nodes)


def _expert_roles(view: GraphView, group: ExpertGroup) -> dict[str, str]:
    """Which 3-D stack is the input projection (gate+up, or gate and up) and which the output one, by the
    order the graph uses them and by which one feeds the activation; biases by their width."""
    weights = sorted(group.params, key=lambda p: _first_use(view, p))
    roles: dict[str, str] = {}
    if len(weights) == 2:
        roles = {"gate_up": weights[0], "down": weights[1]}
    elif len(weights) == 3:
        acts = [n for n in view.under(group.path) if op_name(n) in ACTIVATIONS]
        feeds_act = set(view.ancestors(acts[0])) if acts else set()
        first_two = weights[:2]
        gate = next((w for w in first_two if any(view.param(a) == w for n in feeds_act for a in view.inputs(n))),
                    first_two[0])
        roles = {"gate": gate, "up": next(w for w in first_two if w != gate), "down": weights[2]}
    # per-expert biases, (E, out): the output projection's bias is as wide as the hidden state
    owners = {parent(p) for p in group.params}  # biases live beside their stacks, not elsewhere in the block
    biases = sorted((p for p, shape in view.params_under(group.path).items()
                     if shape is not None and len(shape) == 2 and p not in group.params and parent(p) in owners),
                    key=lambda p: _first_use(view, p))
    inputs = [r for r in ("gate_up", "gate", "up") if r in roles]
    for p in biases:
        if view.param_shapes[p][1] == view.hidden_size and "down_bias" not in roles:
            roles["down_bias"] = p
        elif inputs:
            roles[f"{inputs.pop(0)}_bias"] = p
    return roles


def _interleaved(view: GraphView, group: ExpertGroup) -> bool:
    """Gate and up rows alternate when the fused projection's output is split with a stride of 2."""
    for n in view.under(group.path):
        if op_name(n) == "slice" and len(n.args) > 4 and n.args[4] == 2:
            return True
        if op_name(n) == "getitem" and any(isinstance(a, slice) and a.step == 2 for a in _flat(n.args)):
            return True
    return False


def _flat(args):
    for a in args:
        if isinstance(a, (tuple, list)):
            yield from _flat(a)
        else:
            yield a


def _weight_on_input(view: GraphView, final, group: ExpertGroup) -> bool:
    """The chosen scores multiply the token before the first expert projection (Llama 4 style)."""
    first = min((n for n in view.nodes if n.op == "call_function"
                 and any(view.param(a) in group.params for a in view.inputs(n))),
                key=lambda n: view.index[n], default=None)
    values = next((u for u in final.users if op_name(u) == "getitem" and u.args[1] == 0), None)
    if first is None or values is None:
        return False
    hidden = (view.shape(view.inputs(first)[0]) or (0,))[-1]
    between = view.ancestors(first) & view.descendants(values)
    return any(op_name(n) == "mul" and (view.shape(n) or (0,))[-1] == hidden for n in between)


def _reads_block_input(view: GraphView, router_node, block: str) -> bool:
    """Is the router one projection of the block's tokens (no other projection inside the block before it)?"""
    inside = set(view.under(block))
    return not any(view.linear_weight(n) for n in view.ancestors(router_node) & inside)


def _output_scaling(view: GraphView, block: str, downstream: set, shared: list[str]) -> float | None:
    """A constant multiplying the combined routed output at the block level (not inside a sub-module)."""
    shared_nodes = set()
    for path in shared:
        shared_nodes |= set(view.under(path))
    shared_down = view.descendants(shared_nodes) if shared_nodes else set()
    for n in view.under(block):
        if view.path(n) != block or n not in downstream or n in shared_down or op_name(n) != "mul":
            continue
        consts = [a for a in n.args if isinstance(a, float) and a != 1.0]
        if consts:
            return float(consts[0])
    return None


def _output_bias(view: GraphView, block: str, downstream: set) -> str | None:
    """A hidden-size parameter of the block itself added to what the experts produced."""
    for n in view.under(block):
        if op_name(n) != "add" or n not in downstream:
            continue
        for arg in view.inputs(n):
            p = view.param(arg)
            if p and parent(p) == block and view.param_shapes.get(p) == (view.hidden_size,):
                return p
    return None


def _post_norm(view: GraphView, block: str, experts: str, router: str, shared: list[str], downstream: set):
    """A child module of the block that normalises the expert output (e.g. A.X-K1's post-MLP norm)."""
    skip = [experts, router, *shared]
    for n in view.under(block):
        path = view.path(n)
        if path == block or any(path == s or path.startswith(s + ".") for s in skip):
            continue
        if op_name(n) in ("rsqrt", "layer_norm", "native_layer_norm", "rms_norm") and n in downstream:
            return path
    return None


def _static_moe(view: GraphView, group: ExpertGroup) -> MoEMatch | None:
    """Experts chosen without a learned top-k: a fixed table indexed by token id (DeepSeek-V4's hash
    layers). The learned projection still scores the chosen experts. None when nothing chooses: a stack of
    weights that every token goes through, one slice of its channels each (RecurrentGemma's block-diagonal
    gates), is no mixture of experts."""
    block = parent(group.path)
    table, ids, lookup = _routing_table(view, block)
    if table is None:
        return None
    activation, gated = find_activation(view, view.under(group.path))
    router = Router(score="static", order="static", path="")
    router_weight, k = "", 0
    # the table decides; a learned projection, where there is one, scores the chosen experts
    found = None
    for n in view.under(block):
        weight = view.linear_weight(n)
        if weight and view.param_shapes[weight][0] == group.num_experts and weight not in group.params:
            found = (n, weight)
            break
    if found is not None:
        router_node, router_weight = found
        gathers = [n for n in view.descendants(lookup) if op_name(n) == "gather"]
        router = _read_router(view, router_node, router_weight, gathers[0] if gathers else lookup,
                              group.num_experts, block)
        router.order, router.table, router.token_input = "static", table, ids
        router.logit_width = view.param_shapes[router_weight][0]
        router.bias_correction, router.bias = False, None
        k = view.param_shapes[table][1]
    shared, shared_gate = _shared(view, block, group.path, parent(router_weight) if router_weight else group.path)
    match = MoEMatch(block, group, router, router_weight, k, activation, gated, shared, bool(shared_gate), [])
    match.shared_gate_weight = shared_gate
    if group.layout == "fused":
        match.expert_weights = _expert_roles(view, group)
        match.interleaved = _interleaved(view, group)
    return match


def _routing_table(view: GraphView, block: str):
    """(table parameter, token-id input name, lookup node) of a (vocab, k) expert table indexed by token ids."""
    for n in view.under(block):
        if op_name(n) != "index" or not n.args:
            continue
        table = view.param(n.args[0])
        shape = view.param_shapes.get(table) if table else None
        if not shape or len(shape) != 2:
            continue
        source = view.source(next(iter(view.inputs(n)[1:]), None))
        if source is not None and source.op == "placeholder" and source.name not in view.param_of:
            return table, source.name, n
    return None, None, None


def _read_router(view: GraphView, router_node, router_weight: str, final, E: int, block: str,
                 experts: set[str] = frozenset()) -> Router:
    path = view.path(router_node)
    span = view.between(router_node, final) | {final}
    region = view.descendants(router_node)
    score_ops = ("softmax", "_softmax", "sigmoid", "log_softmax", "softplus", "sqrt")
    scores_before = sorted((n for n in span if op_name(n) in score_ops), key=lambda n: view.index[n])
    after = [n for n in view.descendants(final)
             if op_name(n) in ("softmax", "_softmax", "sigmoid") and view.path(n).startswith(block)]
    if scores_before:
        chain = [op_name(n).lstrip("_") for n in scores_before]
        score = "sqrtsoftplus" if chain[:2] == ["softplus", "sqrt"] else chain[0]
        order = "score_then_topk"
    elif after:
        score = op_name(min(after, key=lambda n: view.index[n])).lstrip("_")
        order = "topk_then_score"
    else:
        score, order = "identity", "score_then_topk"
    if score == "log_softmax":
        score = "softmax"
    other_topks = [n for n in span if op_name(n) == "topk" and n is not final]
    group_limited = bool(other_topks)
    n_group = topk_group = None
    if group_limited:
        for t in sorted(other_topks, key=lambda n: view.index[n]):
            shape = view.shape(view.inputs(t)[0]) or ()
            if len(shape) >= 2 and shape[-1] * shape[-2] == E:
                n_group = shape[-2]
            elif shape and shape[-1] < E:
                topk_group = view.topk_k(t)
                n_group = n_group or shape[-1]
    bias = None
    for n in span:
        if op_name(n) in ("add", "sub"):
            for arg in view.inputs(n):
                p = view.param(arg)
                if p is not None and view.param_shapes.get(p) in ((E,), (1, E)):
                    bias = p
    # how a group is scored from its experts' scores: the sum of its best k (a top-k over the grouped view),
    # or its best one (a max over it: DeepSeek-V2's group-limited greedy), which is the sum of its best 1
    group_top = None
    for n in span:
        shape = view.shape(view.inputs(n)[0]) or () if view.inputs(n) else ()
        if len(shape) >= 2 and shape[-1] * shape[-2] == E:
            if op_name(n) == "topk" and n in other_topks:
                group_top = view.topk_k(n)
            elif op_name(n) in ("max", "amax") and group_top is None:
                group_top = 1
    # weights that leave the router: descendants of the final top-k (values, or a gather by its indices)
    weights = view.descendants(final)
    local = [n for n in weights
             if view.path(n).startswith(block) and view.index[n] < _first_expert_use(view, final, experts)]
    renorm = order == "topk_then_score" and score == "softmax"
    renorm_p = None
    for n in local:
        if op_name(n) == "div":
            divisor = view.inputs(n)[1:] if len(view.inputs(n)) > 1 else []
            if any(op_name(d) == "sum" or any(op_name(a) == "sum" for a in view.ancestors(d) & region)
                   for d in divisor):
                renorm = True
            norms = sorted({a for d in divisor for a in view.ancestors(d) & region | {d} if op_name(a) in NORMS},
                           key=lambda a: view.index[a])
            if norms:  # divided by a p-norm of the chosen weights (DBRX's moe_normalize_expert_weights)
                renorm, renorm_p = True, _norm_order(norms[0])
    scaling = None
    for n in local:
        if op_name(n) == "mul":
            consts = [a for a in n.args if isinstance(a, float) and a != 1.0]
            if consts:
                scaling = float(consts[0])
    return Router(score=score, order=order, renormalize=renorm, group_limited=group_limited,
                  n_group=n_group, topk_group=topk_group, bias_correction=bias is not None, scaling=scaling,
                  path=path, weight=router_weight, linear_bias=_linear_bias(view, router_node, router_weight),
                  bias=bias, group_score_top=group_top, renorm_p=None if renorm_p == 1.0 else renorm_p)


NORMS = ("norm", "linalg_vector_norm", "vector_norm")


def _norm_order(node) -> float:
    """The p of a p-norm node (2 when not given, as torch.norm's default)."""
    p = node.kwargs.get("p", node.kwargs.get("ord"))
    if p is None and len(node.args) > 1 and isinstance(node.args[1], (int, float)):
        p = node.args[1]
    return float(p) if p is not None else 2.0


def _linear_bias(view: GraphView, node, weight: str) -> str | None:
    """A 1-D parameter added inside the router projection (F.linear's bias, or addmm's input)."""
    for arg in view.inputs(node):
        p = view.param(arg)
        if p and p != weight and len(view.param_shapes.get(p) or ()) == 1:
            return p
    return None


def _first_expert_use(view: GraphView, final, experts: set[str] = frozenset()) -> int:
    """Graph position where expert weights (3-D stacks, or `experts`) are first touched (end of the router's
    region)."""
    positions = []
    for n in view.descendants(final):
        for arg in view.inputs(n):
            p = view.param(arg)
            shape = view.param_shapes.get(p) if p else None
            if p in experts or (shape is not None and len(shape) == 3):
                positions.append(view.index[n])
    return min(positions) if positions else len(view.nodes)


def _shared(view: GraphView, block: str, experts_path: str, router_path: str) -> tuple[list[str], str | None]:
    """Dense sub-MLPs of the block that every token goes through, and the 1-output projection whose
    sigmoid scales them (if any)."""
    owners: dict[str, list[str]] = {}
    for p, shape in view.params_under(block).items():
        if p.startswith(experts_path + ".") or p.startswith(router_path + ".") or p == router_path:
            continue
        if shape is not None and len(shape) == 2:
            owners.setdefault(parent(parent(p)) if parent(p) != block else parent(p), []).append(p)
    shared, gate = [], None
    for owner, params in owners.items():
        ones = [p for p in params if view.param_shapes[p][0] == 1]
        if owner == block or (len(params) == 1 and ones):
            # a lone 1-output projection: the shared experts' sigmoid gate
            gate = ones[0] if ones else gate
            continue
        if len(params) >= 2:
            shared.append(owner)
    return sorted(shared), gate
