"""What candidate code may call: the allow-list the guard (`onboard.agent.guard`) checks every name against.

A candidate computes with tensors. It may call the torch and torch.nn.functional functions below, anything in
`math`, the runtime ops of RUNTIME_API (what `show_runtime_api` shows a model), the builtins below, and the
tensor methods and value attributes below on values it holds. Everything else is out of reach: no module
object, class, frame, code object, file, process, or interpreter state is named by anything on these lists,
and a chain of attributes is allowed only when it ends in an entry. The lists are the capability; the guard
adds no exceptions of its own.
"""

from __future__ import annotations

# runtime ops a candidate may import and call: module -> names (reviewed runtime code)
RUNTIME_API = {
    "runtime.generated": ["Generated"],
    "runtime.hyper_connection": ["hyper_connection_weights", "sinkhorn"],
    "runtime.residual": ["affine_sum", "short_conv_residual"],
    "runtime.attention": ["causal_conv1d", "chunk_scalar_decay", "chunk_constant_decay", "chunk_gated_delta_rule"],
    "runtime.moe.sparse_mixer": ["jitter_input_", "sparse_mixer"],
}

# runtime ops whose backward is a fused kernel, differentiable once (training never differentiates twice): a
# candidate that calls one has its second derivatives left uncompared, and its record says so
ONCE_DIFFERENTIABLE = frozenset({"runtime.attention.chunk_scalar_decay", "runtime.attention.chunk_constant_decay",
                                 "runtime.attention.chunk_gated_delta_rule"})

TORCH = frozenset("""
abs absolute acos acosh add addcdiv addcmul addmm amax amin aminmax any all arange argmax argmin argsort asin
asinh atan atan2 atanh baddbmm bernoulli bmm broadcast_tensors broadcast_to bucketize cat ceil chunk clamp
clamp_max clamp_min clip clone concat concatenate cos cosh count_nonzero cummax cummin cumprod cumsum diag
diag_embed diagonal diff div divide dot einsum eq erf erfc erfinv exp exp2 expm1 eye flatten
flip floor floor_divide fmod frac full full_like gather ge gt hypot index_add index_select isclose isfinite
isinf isnan kron le lerp lgamma linspace log log10 log1p log2 log_softmax logaddexp logcumsumexp logical_and
logical_not logical_or logical_xor logit logsumexp lt masked_fill masked_select matmul max maximum mean median
min minimum mm movedim mul multinomial multiply mv nan_to_num ne neg negative nonzero norm normal ones
ones_like outer permute pow prod rand rand_like randint randn randn_like reciprocal relu remainder
repeat_interleave reshape roll round rsqrt scatter scatter_add scatter_reduce searchsorted select sigmoid sign
sin sinh softmax sort split sqrt square squeeze stack std sub subtract sum swapaxes t take_along_dim tan tanh
tensor tensor_split tile topk transpose tril triu true_divide trunc unbind unflatten unique unsqueeze var
view_as_complex view_as_real where xlogy zeros zeros_like finfo iinfo is_tensor is_floating_point numel
Tensor float16 bfloat16 float32 float64 float int8 int16 int32 int64 long int bool uint8 complex64 double half
""".split())

FUNCTIONAL = frozenset("""
linear bilinear silu gelu relu relu6 leaky_relu elu selu celu mish hardswish hardsigmoid hardtanh softplus
softsign sigmoid tanh logsigmoid glu softmax log_softmax softmin normalize layer_norm rms_norm group_norm pad
conv1d conv2d embedding one_hot dropout scaled_dot_product_attention cosine_similarity tanhshrink threshold
""".split())

# attribute chains rooted at an imported module that name an entry; torch.nn.functional also as torch.nn.F-less
ENTRIES = frozenset({f"torch.{n}" for n in TORCH} | {f"torch.nn.functional.{n}" for n in FUNCTIONAL}
                    | {f"{module}.{n}" for module, names in RUNTIME_API.items() for n in names})
MATH = "math"  # every public name of math is an entry: the module holds pure functions and constants only
MODULES = frozenset({"torch", "torch.nn", "torch.nn.functional", "math", "runtime", "runtime.moe", *RUNTIME_API})

CONTEXT_MANAGERS = frozenset({"torch.enable_grad", "torch.autocast"})  # no_grad is not one: gradients must flow

BUILTINS = frozenset("""
abs all any bool dict divmod enumerate filter float int isinstance len list map max min pow print range
reversed round slice sorted str sum tuple zip
ValueError RuntimeError NotImplementedError AssertionError TypeError IndexError KeyError
""".split())

# methods and properties of torch.Tensor a candidate may use on the values it holds (no storage, pointers,
# hooks, numpy views, grad_fn or Python callbacks: those lead out of the tensor API; no .data, .grad,
# requires_grad_ or retain_grad: a forward computes, it does not reach into autograd's state)
TENSOR = frozenset("""
H T mH mT abs abs_ absolute acos acosh add add_ addbmm addcdiv addcdiv_ addcmul addcmul_ addmm addmv addr
all allclose amax amin aminmax angle any argmax argmin argsort argwhere asin asinh atan atan2 atanh baddbmm
bernoulli bernoulli_ bfloat16 bincount bitwise_and bitwise_not bitwise_or bitwise_xor bmm bool broadcast_to
byte ceil ceil_ char chunk clamp clamp_ clamp_max clamp_min clip clone contiguous copy_ copysign cos cosh
count_nonzero cross cummax cummin cumprod cumsum detach device diag diag_embed diagonal diff digamma dim
div div_ divide dot double dtype element_size eq equal erf erfc erfinv exp exp_ exp2 expand expand_as expm1
exponential_ fill_ fill_diagonal_ flatten flip float float_power floor floor_divide fmax fmin fmod frac gather
ge geometric_ greater gt half hypot index_add index_add_ index_copy index_copy_ index_fill index_fill_
index_put index_put_ index_select indices inner int is_complex is_contiguous is_floating_point is_leaf isclose
isfinite isinf isnan item itemsize kthvalue le lerp lerp_ lgamma log log10 log1p log2 log_ log_normal_ log_softmax
logaddexp logcumsumexp logical_and logical_not logical_or logical_xor logit logsumexp long lt masked_fill
masked_fill_ masked_scatter masked_select matmul max maximum mean median min minimum mm mode moveaxis movedim
mul mul_ multinomial multiply mv nan_to_num nanmean nansum narrow ndim ndimension ne neg neg_ negative nelement
new_full new_ones new_tensor new_zeros nonzero norm normal_ numel outer permute pow pow_ prod
random_ ravel real reciprocal reciprocal_ relu relu_ remainder repeat repeat_interleave requires_grad
reshape reshape_as roll round rsqrt rsqrt_ scatter scatter_ scatter_add
scatter_add_ scatter_reduce select shape short sigmoid sigmoid_ sign sin sinh size softmax sort split sqrt
sqrt_ square squeeze std stride sub sub_ subtract sum swapaxes swapdims t tan tanh tanh_ tensor_split tile to
tolist topk transpose tril tril_ triu triu_ true_divide trunc type type_as unbind unflatten unfold uniform_
unique unsqueeze unsqueeze_ values var view view_as where xlogy zero_
""".split())

# attributes of the other values tensor code holds: dtypes, devices, finfo / iinfo, sizes, named tuples, and the
# keyword arguments a forward takes as a dict (kwargs.get("seq_idx"))
VALUES = frozenset("""
eps tiny bits resolution smallest_normal is_signed to_real to_complex index count values indices get keys items
""".split())
ATTRIBUTES = TENSOR | VALUES


def describe() -> str:
    """The allow-list in words, for a model's prompt and for refusals."""
    return ("torch functions (" + ", ".join(sorted(TORCH)[:12]) + ", ...), torch.nn.functional ("
            + ", ".join(sorted(FUNCTIONAL)[:10]) + ", ...), math, the runtime ops of show_runtime_api, tensor "
            "methods, and the builtins " + ", ".join(sorted(b for b in BUILTINS if b.islower())))
